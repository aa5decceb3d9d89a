#include "tessel/optim/muon.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/error.hpp"
#include "tessel/optim/row_selection.hpp"

namespace tessel::optim {

double lr_adjust(LrRule rule, int64_t d_out, int64_t d_in) {
  const double o = double(d_out), i = double(d_in);
  switch (rule) {
    case LrRule::spectral_norm:
      return std::sqrt(o / i);
    case LrRule::rms_norm:
      return 0.2 * std::sqrt(std::max(o, i));
    case LrRule::keller:
      return std::sqrt(std::max(1.0, o / i));
  }
  return 1.0;
}

namespace {

// Rows [lo, hi) of rank p's shard of n rows over P ranks: ceil(n / P) rows each, the last
// shards short or empty.
std::pair<int64_t, int64_t> shard_rows(int64_t n, int P, int p) {
  const int64_t b = (n + P - 1) / P;
  return {std::min(n, p * b), std::min(n, (p + 1) * b)};
}

std::vector<size_t> counts_to_size_t(const std::vector<int64_t>& v) {
  return std::vector<size_t>(v.begin(), v.end());
}

}  // namespace

Muon::Muon(ParameterList params, const MuonHyper& hyper, const AdamWHyper& adam,
           std::vector<ParamTag> decay_tags, comm::Communicator* group,
           const std::map<std::string, std::vector<int64_t>>& row_blocks)
    : h_(hyper), group_(group), step_(Shape{1}, DType::i32) {
  if (!group_) {
    own_group_ = std::make_unique<comm::SingleCommunicator>();
    group_ = own_group_.get();
  }
  ParameterList rest;
  for (Parameter& p : params)
    (p.tag == ParamTag::hidden_matrix ? params_ : rest).push_back(std::move(p));
  adam_ = std::make_unique<AdamW>(std::move(rest), adam, std::move(decay_tags));
  const int P = group_->size(), me = group_->rank();
  int64_t local = 0, vrows = 0;
  for (size_t pi = 0; pi < params_.size(); ++pi) {
    const Parameter& p = params_[pi];
    TESSEL_CHECK(p.value.shape().size() == 2 && p.value.shape() == p.grad.shape(), "hidden matrix ",
                 p.name, " must be 2-D with a gradient of its shape, got ",
                 shape_str(p.value.shape()));
    const int64_t rows = p.value.shape()[0], cols = p.value.shape()[1];
    // Row numbers travel as f32 beside the update rows: exact below 2^24.
    TESSEL_CHECK(rows < (int64_t(1) << 24), "hidden matrix ", p.name, " has too many rows");
    std::vector<int64_t> blocks{rows};
    if (auto it = row_blocks.find(p.name); it != row_blocks.end()) blocks = it->second;
    TESSEL_CHECK(std::accumulate(blocks.begin(), blocks.end(), int64_t(0)) == rows,
                 "row blocks of ", p.name, " do not sum to its ", rows, " rows");
    int64_t row0 = 0;
    for (int64_t b : blocks) {
      TESSEL_CHECK(b > 0, "empty row block of ", p.name);
      auto g = std::find_if(groups_.begin(), groups_.end(),
                            [&](const Group& x) { return x.rows == b && x.cols == cols; });
      if (g == groups_.end()) g = groups_.insert(groups_.end(), Group{b, cols, {}, {}, 0});
      Matrix m{pi, row0, b, cols, local, 0, b, vrows, g->mats.size(), 0};
      m.owner = int(m.slot % size_t(P));
      if (h_.mode != MuonMode::replicated) std::tie(m.lo, m.hi) = shard_rows(b, P, me);
      g->mats.push_back(mats_.size());
      mats_.push_back(m);
      local += (m.hi - m.lo) * cols;
      vrows += b;
      row0 += b;
    }
  }
  for (Group& g : groups_) {
    for (int p = 0; p < P; ++p) g.sent.push_back(rows_sent(g.rows, p));
    g.updated = rows_updated(g.rows);
    check_collective_size(g);
  }
  m_ = Tensor(Shape{local});
  v_ = Tensor(Shape{h_.variant == MuonVariant::dion3 ? vrows : 0});
}

Muon::~Muon() = default;

// MPI counts a collective's elements and offsets in an int. A collective moves a whole shape
// group's rows (one matrix's in the allgather mode) as [row number, row] records: refused at
// construction rather than at the first step(). One process moves nothing through MPI.
void Muon::check_collective_size(const Group& g) const {
  if (group_->backend() == "single") return;
  constexpr int64_t kLimit = std::numeric_limits<int>::max();
  const int64_t per_matrix = g.rows * (g.cols + 1);
  const std::string& first = params_[mats_[g.mats[0]].param].name;
  if (per_matrix > kLimit)
    input_error("hidden matrix ", first, " [", g.rows, ", ", g.cols, "]: one collective moves its ",
                g.rows, " x (", g.cols, " + 1) = ", per_matrix,
                " floats, more than MPI's int count limit ", kLimit,
                "; split it (optim.qkv_split for a fused QKV weight) or train on one process");
  const int64_t n = h_.mode == MuonMode::allgather ? 1 : int64_t(g.mats.size());
  if (per_matrix > kLimit / n)
    input_error("optim.muon_mode = ", kMuonModes[size_t(h_.mode)], ": the ", n,
                " hidden matrices of shape [", g.rows, ", ", g.cols, "] (", first, ", ...) move ",
                n, " x ", g.rows, " x (", g.cols, " + 1) floats in one collective, ",
                "more than MPI's int count limit ", kLimit,
                "; use optim.muon_mode = allgather (one collective per matrix) or one process");
}

std::string Muon::name() const {
  switch (h_.variant) {
    case MuonVariant::muon:
      return "muon";
    case MuonVariant::dion2:
      return "dion2";
    case MuonVariant::dion3:
      return "dion3";
  }
  return "muon";
}

// Updates the momentum of rows [r0, r1) (mine) from the gradient and writes U row by row to
// dst: [row number, U row] with `stride` = cols + 1.
void Muon::momentum_rows(const Matrix& mat, int64_t r0, int64_t r1, float* dst, int64_t stride) {
  const int64_t cols = mat.cols;
  const float mu = float(h_.momentum), one_minus = float(1.0 - h_.momentum);
  const bool dion = h_.variant != MuonVariant::muon;
  for (int64_t r = r0; r < r1; ++r) {
    float* B = m_.f32() + mat.local_off + (r - mat.lo) * cols;
    const float* G = grad(mat) + r * cols;
    float* U = dst + (r - r0) * stride;
    U[0] = float(r);
    ++U;
    if (dion) {
      for (int64_t j = 0; j < cols; ++j) U[j] = B[j] = B[j] + G[j];
    } else if (h_.lerp) {
      for (int64_t j = 0; j < cols; ++j) {
        B[j] = mu * B[j] + one_minus * G[j];
        U[j] = h_.nesterov ? one_minus * G[j] + mu * B[j] : B[j];
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        B[j] = mu * B[j] + G[j];
        U[j] = h_.nesterov ? G[j] + mu * B[j] : B[j];
      }
    }
  }
}

int64_t Muon::rows_sent(int64_t rows, int rank) const {
  auto [lo, hi] = shard_rows(rows, group_->size(), rank);
  const bool local_select = h_.variant != MuonVariant::muon && h_.local_scope;
  return local_select ? selected_count(h_.fraction, hi - lo) : hi - lo;
}

int64_t Muon::rows_updated(int64_t rows) const {
  if (h_.variant == MuonVariant::muon) return rows;
  if (h_.mode != MuonMode::sharded || !h_.local_scope) return selected_count(h_.fraction, rows);
  int64_t k = 0;
  for (int p = 0; p < group_->size(); ++p) k += rows_sent(rows, p);
  return k;
}

// From k_in input rows [row number, U row] (selecting the top rows when `select`): out =
// rows_updated rows [row number, lr * lr_adjust * O row].
void Muon::owner_update(const Matrix& mat, const float* in, int64_t k_in, bool select, double lr,
                        float* out) {
  const int64_t cols = mat.cols, stride = cols + 1;
  std::vector<int64_t> pos;
  if (select) {
    pos = select_rows(in + 1, k_in, cols, stride, h_.fraction);
  } else {
    pos.resize(size_t(k_in));
    std::iota(pos.begin(), pos.end(), int64_t(0));
  }
  const int64_t k = int64_t(pos.size());
  std::vector<float> A(size_t(k * cols)), O(size_t(k * cols));
  std::vector<int64_t> ids(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    const float* row = in + pos[size_t(i)] * stride;
    ids[size_t(i)] = int64_t(row[0]);
    std::copy(row + 1, row + stride, A.data() + i * cols);
  }
  orthogonalize(A.data(), k, cols, h_.ns, O.data());
  if (h_.variant == MuonVariant::dion3)
    normuon_normalize(O.data(), k, cols, ids.data(), v_.f32() + mat.v_off, h_.normuon_beta2,
                      h_.normuon_eps);
  const float s = float(lr * lr_adjust(h_.lr_rule, k, cols));
  for (int64_t i = 0; i < k; ++i) {
    float* o = out + i * stride;
    o[0] = float(ids[size_t(i)]);
    for (int64_t j = 0; j < cols; ++j) o[1 + j] = s * O[size_t(i * cols + j)];
  }
}

void Muon::apply(const Matrix& mat, const float* upd, int64_t k, float decay) {
  const int64_t cols = mat.cols, stride = cols + 1;
  float* W = value(mat);
  for (int64_t i = 0; i < mat.rows * cols; ++i) W[i] *= decay;
  const float ef = float(h_.ef_decay);
  for (int64_t i = 0; i < k; ++i) {
    const float* u = upd + i * stride;
    const int64_t r = int64_t(u[0]);
    TESSEL_CHECK(r >= 0 && r < mat.rows, "update row ", r, " outside ", mat.rows, " rows");
    float* w = W + r * cols;
    for (int64_t j = 0; j < cols; ++j) w[j] -= u[1 + j];
    if (h_.variant != MuonVariant::muon && r >= mat.lo && r < mat.hi) {
      float* B = m_.f32() + mat.local_off + (r - mat.lo) * cols;
      for (int64_t j = 0; j < cols; ++j) B[j] *= ef;
    }
  }
}

void Muon::step_sharded(double lr, float decay) {
  const int P = group_->size(), me = group_->rank();
  const bool local_select = h_.variant != MuonVariant::muon && h_.local_scope;
  const bool owner_select = h_.variant != MuonVariant::muon && !h_.local_scope;
  const size_t G = groups_.size();
  std::vector<std::vector<float>> send(G), recv(G), out(G), all(G);
  std::vector<std::vector<size_t>> recv_counts(G), out_counts(G);
  std::vector<comm::Request> to_owner(G), from_owner(G);
  for (size_t g = 0; g < G; ++g) {
    const Group& grp = groups_[g];
    const int64_t stride = grp.cols + 1;
    std::vector<int64_t> sc(size_t(P), 0), rc(size_t(P), 0);
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      sc[size_t(mat.owner)] += grp.sent[size_t(me)] * stride;
      if (mat.owner == me)
        for (int p = 0; p < P; ++p) rc[size_t(p)] += grp.sent[size_t(p)] * stride;
    }
    send[g].resize(size_t(std::accumulate(sc.begin(), sc.end(), int64_t(0))));
    recv[g].resize(size_t(std::accumulate(rc.begin(), rc.end(), int64_t(0))));
    const auto scount = counts_to_size_t(sc);
    recv_counts[g] = counts_to_size_t(rc);
    const auto sdispl = comm::packed_displacements(scount);
    std::vector<size_t> fill = sdispl;
    std::vector<float> rows;
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      const int64_t n = mat.hi - mat.lo;
      rows.resize(size_t(n * stride));
      momentum_rows(mat, mat.lo, mat.hi, rows.data(), stride);
      float* dst = send[g].data() + fill[size_t(mat.owner)];
      if (local_select && n > 0) {
        for (int64_t i : select_rows(rows.data() + 1, n, mat.cols, stride, h_.fraction))
          dst = std::copy_n(rows.data() + i * stride, stride, dst);
      } else {
        dst = std::copy(rows.begin(), rows.end(), dst);
      }
      fill[size_t(mat.owner)] = size_t(dst - send[g].data());
    }
    to_owner[g] = group_->iall_to_allv(send[g], scount, sdispl, recv[g], recv_counts[g],
                                       comm::packed_displacements(recv_counts[g]));
  }
  for (size_t g = 0; g < G; ++g) {
    const Group& grp = groups_[g];
    const int64_t stride = grp.cols + 1;
    to_owner[g].wait();
    // recv: source p's block holds its rows of my matrices, in slot order.
    std::vector<int64_t> oc(size_t(P), 0);
    std::vector<const Matrix*> mine;
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      oc[size_t(mat.owner)] += grp.updated * stride;
      if (mat.owner == me) mine.push_back(&mat);
    }
    std::vector<size_t> at = comm::packed_displacements(recv_counts[g]);
    out[g].resize(size_t(oc[size_t(me)]));
    float* o = out[g].data();
    std::vector<float> in;
    for (const Matrix* mat : mine) {
      in.clear();
      for (int p = 0; p < P; ++p) {
        const size_t n = size_t(grp.sent[size_t(p)] * stride);
        in.insert(in.end(), recv[g].begin() + long(at[size_t(p)]),
                  recv[g].begin() + long(at[size_t(p)] + n));
        at[size_t(p)] += n;
      }
      owner_update(*mat, in.data(), int64_t(in.size()) / stride, owner_select, lr, o);
      o += grp.updated * stride;
    }
    // This group's momentum rows are spent: freed now, their memory holds the updates
    // gathered next, instead of every group's rows and updates being live at once.
    send[g] = std::vector<float>();
    recv[g] = std::vector<float>();
    out_counts[g] = counts_to_size_t(oc);
    all[g].resize(size_t(std::accumulate(oc.begin(), oc.end(), int64_t(0))));
    from_owner[g] = group_->iall_gatherv(out[g], all[g], out_counts[g]);
  }
  for (size_t g = 0; g < G; ++g) {
    from_owner[g].wait();
    const Group& grp = groups_[g];
    std::vector<size_t> at = comm::packed_displacements(out_counts[g]);
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      apply(mat, all[g].data() + at[size_t(mat.owner)], grp.updated, decay);
      at[size_t(mat.owner)] += size_t(grp.updated * (grp.cols + 1));
    }
  }
}

void Muon::step_replicated(double lr, float decay) {
  const int P = group_->size(), me = group_->rank();
  const bool select = h_.variant != MuonVariant::muon;
  const size_t G = groups_.size();
  std::vector<std::vector<float>> out(G), all(G);
  std::vector<std::vector<size_t>> counts(G);
  std::vector<comm::Request> gathers(G);
  std::vector<float> rows;
  for (size_t g = 0; g < G; ++g) {
    const Group& grp = groups_[g];
    const int64_t stride = grp.cols + 1;
    std::vector<int64_t> oc(size_t(P), 0);
    for (size_t mi : grp.mats) oc[size_t(mats_[mi].owner)] += grp.updated * stride;
    out[g].resize(size_t(oc[size_t(me)]));
    float* o = out[g].data();
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      rows.resize(size_t(mat.rows * stride));
      momentum_rows(mat, 0, mat.rows, rows.data(), stride);  // every rank keeps all momentum
      if (mat.owner != me) continue;
      owner_update(mat, rows.data(), mat.rows, select, lr, o);
      o += grp.updated * stride;
    }
    counts[g] = counts_to_size_t(oc);
    all[g].resize(size_t(std::accumulate(oc.begin(), oc.end(), int64_t(0))));
    gathers[g] = group_->iall_gatherv(out[g], all[g], counts[g]);
  }
  for (size_t g = 0; g < G; ++g) {
    gathers[g].wait();
    const Group& grp = groups_[g];
    std::vector<size_t> at = comm::packed_displacements(counts[g]);
    for (size_t mi : grp.mats) {
      const Matrix& mat = mats_[mi];
      apply(mat, all[g].data() + at[size_t(mat.owner)], grp.updated, decay);
      at[size_t(mat.owner)] += size_t(grp.updated * (grp.cols + 1));
    }
  }
}

void Muon::step_allgather(double lr, float decay) {
  const int P = group_->size();
  const bool select = h_.variant != MuonVariant::muon;
  std::vector<float> mine, full, upd;
  for (const Matrix& mat : mats_) {
    const int64_t stride = mat.cols + 1, k = rows_updated(mat.rows);
    mine.resize(size_t((mat.hi - mat.lo) * stride));
    momentum_rows(mat, mat.lo, mat.hi, mine.data(), stride);
    std::vector<size_t> counts(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) {
      auto [lo, hi] = shard_rows(mat.rows, P, p);
      counts[size_t(p)] = size_t((hi - lo) * stride);
    }
    full.resize(size_t(mat.rows * stride));
    group_->all_gatherv(mine, full, counts);
    upd.resize(size_t(k * stride));
    owner_update(mat, full.data(), mat.rows, select, lr, upd.data());
    apply(mat, upd.data(), k, decay);
  }
}

void Muon::step(double lr_scale) {
  int32_t& t = step_.i32()[0];
  TESSEL_CHECK(t < std::numeric_limits<int32_t>::max(), name(), " step counter overflow");
  ++t;
  adam_->step(lr_scale);
  const double lr = h_.lr * lr_scale;
  const float decay = float(1.0 - lr * h_.weight_decay);
  switch (h_.mode) {
    case MuonMode::sharded:
      step_sharded(lr, decay);
      break;
    case MuonMode::replicated:
      step_replicated(lr, decay);
      break;
    case MuonMode::allgather:
      step_allgather(lr, decay);
      break;
  }
}

std::vector<StateTensor> Muon::state() {
  const int P = group_->size(), me = group_->rank();
  // Whole momentum when every rank holds all of it; m_ is then in parameter layout.
  const bool split_m = h_.mode != MuonMode::replicated && P > 1;
  const bool split_v = h_.mode != MuonMode::allgather && P > 1;
  std::vector<StateTensor> out;
  const std::string n = name();
  out.push_back({n + ".step", step_});
  for (const Matrix& mat : mats_) {
    const Parameter& p = params_[mat.param];
    const int64_t rows = p.value.shape()[0];
    const std::string m = n + ".m/" + p.name, v = n + ".v/" + p.name;
    if (!split_m && mat.row0 == 0) out.push_back({m, m_.view(mat.local_off, p.value.shape())});
    if (split_m && mat.hi > mat.lo)
      out.push_back(
          {m, m_.view(mat.local_off, Shape{mat.hi - mat.lo, mat.cols}), mat.row0 + mat.lo, rows});
    if (h_.variant != MuonVariant::dion3) continue;
    if (!split_v && mat.row0 == 0) out.push_back({v, v_.view(mat.v_off, Shape{rows})});
    if (split_v && mat.owner == me)
      out.push_back({v, v_.view(mat.v_off, Shape{mat.rows}), mat.row0, rows});
  }
  for (auto& st : adam_->state()) out.push_back(std::move(st));
  return out;
}

}  // namespace tessel::optim
