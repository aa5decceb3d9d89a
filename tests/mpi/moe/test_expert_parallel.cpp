// Expert parallelism over real MPI: the MoE layer with experts spread over the world (as
// the ep group) against the same layer with every expert local, EQB's exact global k-th
// smallest and the histogram estimate on 1 .. world ranks against the sorted pool, and the
// layer's (damped) EQB and qb_hist updates the same for every group size and sharding.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "tessel/comm/world.hpp"
#include "tessel/core/bf16.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/moe/quantile.hpp"
#include "tessel/parallel/expert_parallel.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

using namespace tessel;
using moe::testing::bind;
using moe::testing::Layout;
using VecF = std::vector<float>;

namespace {

Layout ep_layout(moe::ExpertMlp mlp, moe::ScoreFn score, int64_t Fs, double cf,
                 moe::Balance balance) {
  Layout l;
  l.config.experts = 8;  // divisible by 2 and 4 ranks
  l.config.top_k = 2;
  l.config.score = score;
  l.config.capacity = cf;
  l.config.drop = moe::DropPolicy::position;
  l.config.balance = balance;
  l.config.z_coeff = 0.01;
  l.shape = {12, 7, Fs, mlp};
  return l;
}

// One forward (tokens `token_index` of their micro-batch; null: the micro-batch), backward and
// balancing update.
struct Outcome {
  VecF y, dx, grads;
  double balance_loss = 0;
  int64_t dropped = 0;
  VecF beta;  // after the update
};

Outcome run(const Layout& l, const VecF& params, const VecF& x, const VecF& dy, moe::ExpertComm& c,
            std::optional<std::span<const int32_t>> token_index = std::nullopt) {
  const int64_t N = int64_t(x.size()) / l.shape.C;
  moe::MoeLayer layer(l.config, l.shape);
  Outcome o;
  o.y.resize(x.size());
  o.dx.assign(x.size(), 0.0f);
  o.grads.assign(params.size(), 0.0f);
  o.beta.assign(size_t(l.config.experts), 0.1f);
  auto w = bind<const float>(params.data(), l);
  auto g = bind<float>(o.grads.data(), l);
  moe::LayerCache cache;
  moe::BalanceState state;
  layer.forward(cache, o.y.data(), x.data(), N, w, o.beta.data(), c, token_index);
  layer.backward(cache, o.dx.data(), g, dy.data(), x.data(), w, 0.5f, state, c);
  o.balance_loss = cache.balance_loss;
  o.dropped = cache.dropped;
  layer.update(state, o.beta.data(), c);
  return o;
}

TEST(ExpertParallel, ForwardBackwardEqualsAllExpertsLocal) {
  comm::Communicator& world = comm::world();
  using moe::Balance;
  // Expert choice selects over each rank's own micro-batch, so its experts' tokens arrive
  // through the same exchange (cf 0 = 1, and 0.5: tokens that no expert takes).
  auto expert_choice = [](double cf) {
    Layout l =
        ep_layout(moe::ExpertMlp::swiglu, moe::ScoreFn::softmax, 0, cf, Balance::expert_choice);
    l.config.drop = moe::DropPolicy::probability;
    return l;
  };
  const Layout layouts[] = {
      ep_layout(moe::ExpertMlp::swiglu, moe::ScoreFn::softmax, 5, 0, Balance::aux),
      ep_layout(moe::ExpertMlp::gelu, moe::ScoreFn::sigmoid, 0, 1.0, Balance::lei),
      ep_layout(moe::ExpertMlp::gelu, moe::ScoreFn::softmax, 0, 0, Balance::eqb),
      expert_choice(0),
      expert_choice(0.5),
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(std::string(moe::to_string(l.config.balance)) + ", capacity " +
                 std::to_string(l.config.capacity));
    const VecF params = moe::testing::random_params(l, 77);  // the same on every rank
    Rng rng(100 + uint64_t(world.rank()));
    const int64_t N = 5 + 3 * world.rank();  // uneven token counts
    const VecF x = kernels::test::randn(rng, size_t(N * l.shape.C));
    const VecF dy = kernels::test::randn(rng, x.size());
    parallel::ExpertParallelComm ep(world, world, nullptr);
    moe::LocalExpertComm local;
    Outcome a = run(l, params, x, dy, ep), b = run(l, params, x, dy, local);
    // Outputs and input gradients per rank; parameter gradients summed over ranks (each
    // rank holds only its experts' share). 1e-6 relative: the same f32 arithmetic per row,
    // up to GEMM blocking over different row counts.
    EXPECT_LT(kernels::test::rel_error(a.y, kernels::test::to_f64(b.y)), 1e-6);
    EXPECT_LT(kernels::test::rel_error(a.dx, kernels::test::to_f64(b.dx)), 1e-6);
    world.all_reduce(a.grads);
    world.all_reduce(b.grads);
    EXPECT_LT(kernels::test::rel_error(a.grads, kernels::test::to_f64(b.grads)), 1e-6);
    EXPECT_EQ(a.dropped, b.dropped);
  }
}

// Context parallelism splits one micro-batch over the cp ranks: each routes its own tokens,
// and the terms defined per micro-batch (aux's and LEI's load fractions, the z-loss mean,
// qb_avg's quantile) sum over the micro-batch group, and expert capacity counts the whole
// micro-batch's assignments in its token order (gathered over that group). A micro-batch cut
// unevenly over the world (as that group; each rank with every expert; one rank without
// tokens; the rows in reverse rank order) equals the whole micro-batch on one rank: outputs and
// input gradients row by row, parameter gradients summed, the balancing loss's value, the drops
// and the selection bias after the step's update (aux_global, bias and EQB need only the
// balancing group, as with data parallelism). Capacity 1 drops by position and by gate.
TEST(ExpertParallel, AMicroBatchSplitOverRanksEqualsTheWholeMicroBatch) {
  comm::Communicator& world = comm::world();
  auto self = world.split(world.rank(), 0);
  using moe::Balance;
  struct Case {
    Balance balance;
    double capacity;
    moe::DropPolicy drop;
  };
  const Case cases[] = {{Balance::aux, 0, moe::DropPolicy::position},
                        {Balance::aux_global, 0, moe::DropPolicy::position},
                        {Balance::lei, 0, moe::DropPolicy::position},
                        {Balance::qb_avg, 0, moe::DropPolicy::position},
                        {Balance::bias, 0, moe::DropPolicy::position},
                        {Balance::eqb_lei, 0, moe::DropPolicy::position},
                        {Balance::eqb_lei, 1.0, moe::DropPolicy::position},
                        {Balance::aux, 1.0, moe::DropPolicy::probability},
                        {Balance::expert_choice, 0, moe::DropPolicy::probability},
                        {Balance::expert_choice, 0.5, moe::DropPolicy::probability}};
  for (const auto& [balance, capacity, drop] : cases) {
    SCOPED_TRACE(std::string(moe::to_string(balance)) + ", capacity " + std::to_string(capacity));
    Layout l = ep_layout(moe::ExpertMlp::gelu, moe::ScoreFn::softmax, 5, capacity, balance);
    l.config.drop = drop;
    const VecF params = moe::testing::random_params(l, 91);
    Rng rng(555);  // the same micro-batch on every rank
    const int64_t N = 29, C = l.shape.C;
    const VecF x = kernels::test::randn(rng, size_t(N * C));
    const VecF dy = kernels::test::randn(rng, x.size());
    // Rank r's rows [lo, hi), the rank order not the token order: shares ~ P - r on 2 ranks
    // (both hold tokens), ~ P - 1 - r on more (the last holds none, as a cp rank whose chunks
    // are padding alone). Every group size cuts unevenly.
    const int P = world.size(), r = P - 1 - world.rank(), shift = P == 2 ? 1 : 0;
    auto cut = [&](int64_t q) {  // rows before share q
      const int64_t before = (q + shift) * (q + shift - 1) / 2 - shift * (shift - 1) / 2;
      const int64_t all = (P + shift) * (P + shift - 1) / 2 - shift * (shift - 1) / 2;
      return N * before / all;
    };
    const int64_t lo = cut(r), hi = cut(r + 1);
    const VecF x_part(x.begin() + lo * C, x.begin() + hi * C);
    const VecF dy_part(dy.begin() + lo * C, dy.begin() + hi * C);
    std::vector<int32_t> index(size_t(hi - lo));
    std::iota(index.begin(), index.end(), int32_t(lo));
    parallel::ExpertParallelComm split(*self, world, &world);
    moe::LocalExpertComm local;
    Outcome a = run(l, params, x_part, dy_part, split, index);
    Outcome b = run(l, params, x, dy, local);
    const VecF y_rows(b.y.begin() + lo * C, b.y.begin() + hi * C);
    const VecF dx_rows(b.dx.begin() + lo * C, b.dx.begin() + hi * C);
    // 1e-6 relative: the same f32 arithmetic per row, up to GEMM blocking over different row
    // counts (the router's logits) and the order of the sums.
    if (hi > lo) {
      EXPECT_LT(kernels::test::rel_error(a.y, kernels::test::to_f64(y_rows)), 1e-6);
      EXPECT_LT(kernels::test::rel_error(a.dx, kernels::test::to_f64(dx_rows)), 1e-6);
    }
    world.all_reduce(a.grads);
    EXPECT_LT(kernels::test::rel_error(a.grads, kernels::test::to_f64(b.grads)), 1e-6);
    EXPECT_NEAR(a.balance_loss, b.balance_loss, 1e-6 * std::abs(b.balance_loss));
    std::vector<int64_t> dropped = {a.dropped};
    world.all_reduce(dropped);
    EXPECT_EQ(dropped[0], b.dropped);
    if (capacity > 0) {
      EXPECT_GT(b.dropped, 0);  // capacity 1 binds here
    }
    for (size_t e = 0; e < b.beta.size(); ++e)
      EXPECT_NEAR(a.beta[e], b.beta[e], 1e-6f) << "expert " << e;
  }
}

// The pool [rows, columns] every rank can build: spread, heavy ties, a constant column,
// +-0, +-max; and a validity mask.
struct Pool {
  int64_t rows, columns = 6;
  VecF values;
  std::vector<uint8_t> valid;
};

Pool make_pool(int64_t rows) {
  Rng rng(4242);
  Pool p{rows, 6, VecF(static_cast<size_t>(rows * 6)),
         std::vector<uint8_t>(static_cast<size_t>(rows))};
  const float big = std::numeric_limits<float>::max();
  for (int64_t t = 0; t < rows; ++t) {
    float* v = p.values.data() + t * p.columns;
    v[0] = rng.normal();
    v[1] = float(int(rng.below(4)));
    v[2] = -1.25f;
    v[3] = rng.below(2) ? 0.0f : -0.0f;
    v[4] = rng.below(2) ? big : -big;
    v[5] = rng.normal() * 1e-3f + (rng.below(2) ? 0.0f : -0.0f);
    p.valid[size_t(t)] = rng.below(5) != 0;
  }
  return p;
}

// The rows 0 .. rows - 1 in order, or shuffled (Fisher-Yates) by draws from `rng`.
std::vector<int64_t> row_order(int64_t rows, Rng& rng, bool shuffle) {
  std::vector<int64_t> order(static_cast<size_t>(rows));
  std::iota(order.begin(), order.end(), 0);
  if (shuffle)
    for (int64_t i = rows - 1; i > 0; --i)
      std::swap(order[size_t(i)], order[size_t(rng.below(uint64_t(i + 1)))]);
  return order;
}

// Rows `ids` of the pool as this rank's shard: column-major values and their keys, and the
// mask.
struct Shard {
  VecF values;
  std::vector<uint16_t> keys;
  std::vector<uint8_t> valid;
};

Shard shard_of(const Pool& p, const std::vector<int64_t>& ids) {
  const int64_t n = int64_t(ids.size());
  Shard s{VecF(static_cast<size_t>(n * p.columns)),
          std::vector<uint16_t>(static_cast<size_t>(n * p.columns)),
          std::vector<uint8_t>(static_cast<size_t>(n))};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < p.columns; ++c) {
      const float v = p.values[size_t(ids[size_t(i)] * p.columns + c)];
      s.values[size_t(c * n + i)] = v;
      s.keys[size_t(c * n + i)] = moe::bf16_order_key(v);
    }
    s.valid[size_t(i)] = p.valid[size_t(ids[size_t(i)])];
  }
  return s;
}

// This rank's rows of the pool under sharding `sharding` of group `sub`: the same permutation
// (none for sharding 0) and uneven random cut points on every rank of the group.
std::vector<int64_t> random_shard(const Pool& p, comm::Communicator& sub, uint64_t sharding) {
  Rng rng(sharding);
  const std::vector<int64_t> order = row_order(p.rows, rng, sharding > 0);
  std::vector<int64_t> cuts = {0, p.rows};
  for (int r = 1; r < sub.size(); ++r) cuts.push_back(int64_t(rng.below(uint64_t(p.rows))));
  std::sort(cuts.begin(), cuts.end());
  return {order.begin() + cuts[size_t(sub.rank())], order.begin() + cuts[size_t(sub.rank() + 1)]};
}

TEST(ExactQuantile, EqualsTheSortedPoolOnEveryGroupSizeAndSharding) {
  comm::Communicator& world = comm::world();
  const Pool pool = make_pool(611);
  for (int g = 1; g <= world.size(); ++g) {
    auto sub = world.split(world.rank() < g ? 0 : -1, world.rank());
    if (!sub) continue;
    SCOPED_TRACE("group of " + std::to_string(g));
    parallel::ExpertParallelComm comm(*sub, *sub, nullptr);
    auto rank_of = [](int64_t n) { return moe::qb_rank(n, 2, 8); };
    std::vector<std::vector<uint16_t>> results;
    for (uint64_t sharding = 0; sharding < 3; ++sharding) {
      const Shard shard = shard_of(pool, random_shard(pool, *sub, sharding));
      sub->reset_traffic();
      results.push_back(
          moe::global_kth_smallest(shard.keys, pool.columns, shard.valid, rank_of, comm));
      // Exactly two all-reduces of columns x 256 int32 counters.
      EXPECT_EQ(sub->traffic().calls.all_reduce, 2u);
      EXPECT_EQ(sub->traffic().bytes.all_reduce, uint64_t(2 * pool.columns * 256 * 4));
      EXPECT_EQ(sub->traffic().calls.total(), 2u);
    }
    for (int64_t c = 0; c < pool.columns; ++c) {
      std::vector<uint16_t> sorted;
      for (int64_t t = 0; t < pool.rows; ++t)
        if (pool.valid[size_t(t)])
          sorted.push_back(moe::bf16_order_key(pool.values[size_t(t * pool.columns + c)]));
      std::sort(sorted.begin(), sorted.end());
      const uint16_t want = sorted[size_t(rank_of(int64_t(sorted.size())) - 1)];
      for (const auto& r : results) EXPECT_EQ(r[size_t(c)], want) << "column " << c;
    }
  }
}

// The histogram baseline over the same shardings: every group size and sharding gives the
// same bits (integer counts, an exact range), never below the exact order statistic of the
// pooled valid values and at most one bin width above it, in one maximum of 2 E floats and
// one sum of E B counters.
TEST(HistogramQuantile, IsOneBinFromTheSortedPoolAndBitwiseTheSameOnEveryGroupSizeAndSharding) {
  comm::Communicator& world = comm::world();
  const Pool pool = make_pool(611);
  const int64_t bins = 1000;
  auto rank_of = [](int64_t n) { return moe::qb_rank(n, 2, 8); };
  std::vector<VecF> results;
  for (int g = 1; g <= world.size(); ++g) {
    auto sub = world.split(world.rank() < g ? 0 : -1, world.rank());
    if (!sub) continue;
    SCOPED_TRACE("group of " + std::to_string(g));
    parallel::ExpertParallelComm comm(*sub, *sub, nullptr);
    for (uint64_t sharding = 0; sharding < 3; ++sharding) {
      const Shard shard = shard_of(pool, random_shard(pool, *sub, sharding));
      sub->reset_traffic();
      results.push_back(moe::global_histogram_quantile(shard.values, pool.columns, shard.valid,
                                                       bins, rank_of, comm));
      EXPECT_EQ(sub->traffic().calls.all_reduce, 2u);
      EXPECT_EQ(sub->traffic().bytes.all_reduce,
                uint64_t(2 * pool.columns * 4 + pool.columns * bins * 4));
      EXPECT_EQ(sub->traffic().calls.total(), 2u);
    }
  }
  for (int64_t c = 0; c < pool.columns; ++c) {
    VecF sorted;
    for (int64_t t = 0; t < pool.rows; ++t)
      if (pool.valid[size_t(t)]) sorted.push_back(pool.values[size_t(t * pool.columns + c)]);
    std::sort(sorted.begin(), sorted.end());
    const float x = sorted[size_t(rank_of(int64_t(sorted.size())) - 1)];
    const double w = (double(sorted.back()) - double(sorted.front())) / double(bins);
    const float q = results.front()[size_t(c)];
    EXPECT_GE(q, x) << "column " << c;
    EXPECT_LE(double(q) - double(x), w * (1 + 1e-12)) << "column " << c;
  }
  for (const VecF& r : results) EXPECT_TRUE(kernels::test::bitwise_equal(r, results.front()));
}

// Cuts [0, rows] into g uneven shards (rank r gets a share ~ r + 1) of a permutation of
// the rows drawn from `seed` (0: identity); the same on every rank.
std::vector<int64_t> shard_ids(int64_t rows, int g, int rank, uint64_t seed) {
  Rng rng(seed);
  const std::vector<int64_t> order = row_order(rows, rng, seed > 0);
  const int64_t total = int64_t(g) * (g + 1) / 2;
  const int64_t lo = rows * (int64_t(rank) * (rank + 1) / 2) / total;
  const int64_t hi = rows * (int64_t(rank + 1) * (rank + 2) / 2) / total;
  return {order.begin() + lo, order.begin() + hi};
}

// Margins [rows, E] every rank can build: spread, heavy ties, small values, a constant.
VecF update_margins(int64_t rows, int64_t E) {
  VecF margins(static_cast<size_t>(rows * E));
  Rng rng(808);
  for (int64_t t = 0; t < rows; ++t) {
    float* m = margins.data() + t * E;
    m[0] = rng.normal();
    m[1] = float(int(rng.below(4))) - 1.5f;
    m[2] = rng.normal() * 1e-3f;
    m[3] = -1.25f;
  }
  return margins;
}

// beta0 after the layer's update from margin rows `ids` on this rank, recorded as backward
// records them (per expert, the order keys of its tokens), over the balancing group `sub`.
VecF updated_beta(const moe::MoeConfig& config, const VecF& margins, const VecF& beta0,
                  const std::vector<int64_t>& ids, comm::Communicator& self,
                  comm::Communicator& sub) {
  const int64_t E = config.experts;
  const moe::MoeLayer layer(config, {12, 7, 0, moe::ExpertMlp::gelu});
  moe::BalanceState state;
  state.keys.resize(size_t(E));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t id : ids)
      state.keys[size_t(e)].push_back(moe::bf16_order_key(margins[size_t(id * E + e)]));
  parallel::ExpertParallelComm comm(self, sub, nullptr);
  VecF beta = beta0;
  layer.update(state, beta.data(), comm);
  return beta;
}

TEST(EqbUpdate, DampedStepIsTheSameForEveryGroupSizeAndSharding) {
  comm::Communicator& world = comm::world();
  auto self = world.split(world.rank(), 0);
  const int64_t rows = 203, E = 4, k = 2;
  const VecF margins = update_margins(rows, E);
  moe::MoeConfig config;
  config.experts = E;
  config.top_k = k;
  config.balance = moe::Balance::eqb_lei;
  const VecF beta0 = {0.5f, -0.25f, 1.0f, 0.125f};
  // The exact quantile of every column of all ranks' margins, from the sorted keys.
  VecF q(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    std::vector<uint16_t> col;
    for (int64_t t = 0; t < rows; ++t)
      col.push_back(moe::bf16_order_key(margins[size_t(t * E + e)]));
    std::sort(col.begin(), col.end());
    q[size_t(e)] = moe::value_of_order_key(col[size_t(moe::qb_rank(rows, k, E) - 1)]);
  }
  for (double eta : {1.0, 0.25}) {
    config.eqb_step = eta;
    std::vector<VecF> results;
    for (int g = 1; g <= world.size(); ++g) {
      auto sub = world.split(world.rank() < g ? 0 : -1, world.rank());
      if (!sub) continue;
      for (uint64_t sharding = 0; sharding < 3; ++sharding) {
        SCOPED_TRACE("eta " + std::to_string(eta) + ", group of " + std::to_string(g) +
                     ", sharding " + std::to_string(sharding));
        const auto ids = shard_ids(rows, g, sub->rank(), sharding);
        const VecF beta = updated_beta(config, margins, beta0, ids, *self, *sub);
        results.push_back(beta);
        for (int64_t e = 0; e < E; ++e) {
          const double want = (1.0 - eta) * double(beta0[size_t(e)]) + eta * double(q[size_t(e)]);
          if (eta == 1.0)
            EXPECT_EQ(beta[size_t(e)], q[size_t(e)]) << "expert " << e;
          else
            EXPECT_LE(std::abs(double(beta[size_t(e)]) - want),
                      std::abs(want) * std::numeric_limits<float>::epsilon())
                << "expert " << e;
        }
      }
    }
    // Bitwise the same on every group size and sharding.
    for (const VecF& r : results) EXPECT_TRUE(kernels::test::bitwise_equal(r, results.front()));
  }
}

// qb_hist under data / expert parallelism: the update runs over the balancing group as
// EQB's does, bitwise the same for every group size and sharding, and (eta = 1) its beta is
// never below EQB's exact quantile and at most one bin width of the expert's bf16 margin range
// above it.
TEST(QbHistUpdate, IsWithinOneBinAboveEqbAndTheSameForEveryGroupSizeAndSharding) {
  comm::Communicator& world = comm::world();
  auto self = world.split(world.rank(), 0);
  const int64_t rows = 203, E = 4;
  const VecF margins = update_margins(rows, E);
  moe::MoeConfig eqb;
  eqb.experts = E;
  eqb.top_k = 2;
  eqb.balance = moe::Balance::eqb;
  moe::MoeConfig hist = eqb;
  hist.balance = moe::Balance::qb_hist;
  const VecF beta0 = {0.5f, -0.25f, 1.0f, 0.125f};
  std::vector<double> width(
      static_cast<size_t>(E));  // of the bins, over each expert's bf16 margins
  for (int64_t e = 0; e < E; ++e) {
    VecF col;
    for (int64_t t = 0; t < rows; ++t)
      col.push_back(bf16_to_f32(f32_to_bf16(margins[size_t(t * E + e)])));
    const auto [lo, hi] = std::minmax_element(col.begin(), col.end());
    width[size_t(e)] = (double(*hi) - double(*lo)) / double(hist.hist_bins);
  }
  std::vector<VecF> results;
  for (int g = 1; g <= world.size(); ++g) {
    auto sub = world.split(world.rank() < g ? 0 : -1, world.rank());
    if (!sub) continue;
    for (uint64_t sharding = 0; sharding < 3; ++sharding) {
      SCOPED_TRACE("group of " + std::to_string(g) + ", sharding " + std::to_string(sharding));
      const auto ids = shard_ids(rows, g, sub->rank(), sharding);
      const VecF exact = updated_beta(eqb, margins, beta0, ids, *self, *sub);
      sub->reset_traffic();
      const VecF beta = updated_beta(hist, margins, beta0, ids, *self, *sub);
      EXPECT_EQ(sub->traffic().calls.all_reduce, 2u);  // the range, the counts
      results.push_back(beta);
      int64_t above = 0;  // experts where the estimate is not the exact quantile
      for (int64_t e = 0; e < E; ++e) {
        const size_t i = size_t(e);
        above += beta[i] > exact[i];
        EXPECT_GE(beta[i], exact[i]) << "expert " << e;
        EXPECT_LE(double(beta[i]) - double(exact[i]),
                  width[i] + 0.5 * double(std::nextafter(beta[i], 1e30f) - beta[i]))
            << "expert " << e;
      }
      EXPECT_GT(above, 0) << "an estimate, not EQB's selection";
    }
  }
  for (const VecF& r : results) EXPECT_TRUE(kernels::test::bitwise_equal(r, results.front()));
}

}  // namespace
