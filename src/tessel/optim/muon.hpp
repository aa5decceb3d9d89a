#pragma once
// Muon, Dion2 and Dion3 (spec muon_dion3.md): orthogonalized momentum updates for the
// hidden 2-D matrices (ParamTag::hidden_matrix), AdamW for every other tag. Routing is by tag,
// never by dimension count.
//
// Per hidden matrix W [rows, cols] (or per row block of it, see `row_blocks`), gradient G:
//   muon:   B = mu B + G (sum form) or B = mu B + (1 - mu) G (lerp form);
//           U = G + mu B (lerp: (1 - mu) G + mu B) with Nesterov, else U = B;
//           O = orthogonalize(U) (newton_schulz.hpp); the selected rows are all rows.
//   dion2:  M = M + G; U = M; the rows S = select_rows(U, fraction) (row_selection.hpp);
//           O = orthogonalize(U[S]); then M[S] *= ef_decay (error feedback: unselected rows
//           keep accumulating).
//   dion3:  dion2 with NorMuon (normuon_normalize) on O, one second moment per row.
//   then    W = W * (1 - lr * wd);  W[S] -= lr * lr_adjust(rule, |S|, cols) * O.
// lr is the Muon base lr times the schedule's scale; weight decay uses it unadjusted. Rows
// are the selection dimension (and the shard dimension below) for every shape and mode, so
// every mode selects alike (spec section 5.1 takes the shorter side when not sharded:
// docs/architecture.md lists the difference). With f = 1, sum accumulation and ef_decay = mu,
// dion2 equals non-Nesterov sum-form Muon.
//
// Distribution over `group` (the data-parallel group; gradients and parameters replicated):
// matrices (after row-block splitting) are grouped by shape in parameter order; in each
// group, slot s is owned by rank s mod P.
//   sharded (ZeRO-1, default): each rank keeps the momentum of its row shard (ceil(rows/P)
//     rows per rank, the last shards short or empty). Per shape group one all_to_allv sends
//     each owner the rows of its matrices (all rows, or with dion2/3 in `local` scope each
//     shard's own top ceil(f * shard rows)); the owner orthogonalizes its matrices and one
//     all_gatherv returns the scaled updates (with their row numbers) to every rank, which
//     applies them to its replicated parameters. Exactly 2 collectives per shape group.
//     All-to-alls of every group start before the first group is computed, and each group's
//     all-gather starts as soon as it is computed (communication overlaps compute).
//   replicated: every rank keeps all momentum; owners compute, one all_gatherv per group.
//   allgather (the naive baseline): sharded momentum, one all_gatherv of every full matrix,
//     every rank orthogonalizes every matrix.
// A collective moves at most a shape group's n rows (cols + 1) floats (one matrix's in the
// allgather mode), within MPI's int count: a larger group is an InputError at construction.
// In `global` scope (and in the replicated and allgather modes) the selection is made on the
// whole matrix by its owner, so the result is independent of the rank count bitwise (for a
// fixed thread count); `local` scope equals global on one rank.
//
// State (names prefixed with name()): "<name>.step" (i32 [1]), "<name>.m/<param>" (the
// momentum, the parameter's shape), with dion3 "<name>.v/<param>" (f32 [rows]); then the
// AdamW state of the other parameters ("adamw.*"). state() lists what this rank holds, as
// views (no communication): with the momentum split over P > 1 ranks (sharded, allgather),
// one row shard per matrix (row block), rows [row0 + lo, row0 + hi) of "<name>.m/<param>";
// dion3's second moments, kept by each matrix's owner (except in the allgather mode, where
// every rank updates every matrix), as the owner's row shards of "<name>.v/<param>". Whole
// tensors otherwise. A restore written into these views is what the next step() reads.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/optim/adamw.hpp"
#include "tessel/optim/newton_schulz.hpp"
#include "tessel/optim/optimizer.hpp"

namespace tessel::optim {

enum class MuonVariant { muon, dion2, dion3 };
enum class LrRule { spectral_norm, rms_norm, keller };
enum class MuonMode { sharded, replicated, allgather };

// spectral_norm: sqrt(d_out / d_in); rms_norm: 0.2 sqrt(max(d_out, d_in));
// keller: sqrt(max(1, d_out / d_in)).
double lr_adjust(LrRule rule, int64_t d_out, int64_t d_in);

struct MuonHyper {
  MuonVariant variant = MuonVariant::muon;
  double lr = 0.02;  // base lr of the hidden matrices
  double momentum = 0.95;
  bool lerp = false;  // momentum form (muon only)
  bool nesterov = false;
  double weight_decay = 0.0;
  LrRule lr_rule = LrRule::spectral_norm;
  NsOptions ns;
  double fraction = 0.25;  // dion2/3
  double ef_decay = 0.7;   // OptimizerConfig's default (optimizer.hpp says why)
  bool local_scope = true;
  double normuon_beta2 = 0.95;  // dion3
  double normuon_eps = 1e-8;
  MuonMode mode = MuonMode::sharded;
};

class Muon : public Optimizer {
 public:
  // `params`: the whole model; hidden matrices get `hyper`, the rest AdamW with `adam` and
  // `decay_tags`. `row_blocks[name]`: row counts (summing to the rows) of blocks of that
  // parameter orthogonalized separately (fused QKV per block or per head). `group`: the
  // data-parallel group (nullptr: one process).
  Muon(ParameterList params, const MuonHyper& hyper, const AdamWHyper& adam,
       std::vector<ParamTag> decay_tags, comm::Communicator* group,
       const std::map<std::string, std::vector<int64_t>>& row_blocks = {});
  ~Muon() override;

  void step(double lr_scale) override;
  std::vector<StateTensor> state() override;
  std::string name() const override;
  int64_t step_count() const override { return step_.i32()[0]; }

  // Shape groups of the orthogonalized matrices (collectives per step: 2 per group sharded,
  // 1 replicated; one per matrix in the allgather mode).
  int64_t shape_groups() const { return int64_t(groups_.size()); }
  int64_t matrices() const { return int64_t(mats_.size()); }

 private:
  // One orthogonalized matrix: rows [row0, row0 + rows) of hidden matrix `param`.
  struct Matrix {
    size_t param;
    int64_t row0, rows, cols;
    int64_t local_off;  // offset of my rows in m_
    int64_t lo, hi;     // my momentum rows [lo, hi)
    int64_t v_off;      // offset of its rows in v_
    size_t slot;        // position in its shape group
    int owner;          // slot mod group size
  };
  struct Group {
    int64_t rows, cols;
    std::vector<size_t> mats;  // indices into mats_, slot order
    // Per matrix (alike for one shape): rows each rank sends its owner (sharded), and rows of
    // its update.
    std::vector<int64_t> sent;
    int64_t updated = 0;
  };
  float* value(const Matrix& mat) { return params_[mat.param].value.f32() + mat.row0 * mat.cols; }
  const float* grad(const Matrix& mat) const {
    return params_[mat.param].grad.f32() + mat.row0 * mat.cols;
  }
  // InputError when a collective of `g` would exceed MPI's int element count.
  void check_collective_size(const Group& g) const;
  void momentum_rows(const Matrix& mat, int64_t r0, int64_t r1, float* dst, int64_t stride);
  // For a matrix of `rows` rows: rows `rank` sends its owner, rows of its update.
  int64_t rows_sent(int64_t rows, int rank) const;
  int64_t rows_updated(int64_t rows) const;
  void owner_update(const Matrix& mat, const float* in, int64_t k_in, bool select, double lr,
                    float* out);
  void apply(const Matrix& mat, const float* upd, int64_t k, float decay);
  void step_sharded(double lr, float decay);
  void step_replicated(double lr, float decay);
  void step_allgather(double lr, float decay);

  ParameterList params_;  // the hidden matrices
  MuonHyper h_;
  std::unique_ptr<AdamW> adam_;
  std::unique_ptr<comm::Communicator> own_group_;  // one process: a SingleCommunicator
  comm::Communicator* group_;
  std::vector<Matrix> mats_;
  std::vector<Group> groups_;
  Tensor step_;  // i32 [1]
  Tensor m_;     // momentum: my shard rows (sharded, allgather) or all rows (replicated)
  Tensor v_;     // dion3: [rows] per matrix, maintained by the owner
};

}  // namespace tessel::optim
