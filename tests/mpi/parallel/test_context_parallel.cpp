// Context-parallel attention on the MPI world as the cp group, against the naive dense attention
// in f64 on the whole sequence (computed on every rank from the same seed): O, LSE, dQ, dK, dV
// of the owned rows within kTol * max |reference| for all eleven masks and random masks, under
// contiguous, zigzag, balanced and random layouts (short last chunks included), with the
// default tiles (one tile per call) and with small ones (many); backward adds into gradient
// buffers that start nonzero; repeated runs bitwise identical, also with a rank arriving late
// and without overlap; every chunk a rank's rows see is sent to it and nothing else (checked
// against the dense global mask and the communicator's traffic counters); an error on every
// rank propagates instead of deadlocking.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "tessel/attention/mask_localization.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/parallel/context_parallel.hpp"
#include "unit/attention/attention_test_util.hpp"

namespace tessel::parallel {
namespace {

namespace at = attention;
using at::test::lse_error;
using at::test::random_mask;
using at::test::standard_masks;
using kernels::test::randn;
using kernels::test::rel_error;
using kernels::test::VecD;
using kernels::test::VecF;

// The worst error of these checks, measured at 2, 3 and 4 ranks, is 5.9e-7 (f32 against f64).
constexpr double kTol = 2e-6;
constexpr int64_t kN = 94, kB = 2, kHq = 4, kHk = 2, kD = 8;

struct Result {
  VecF o, lse, dq, dk, dv;
  bool operator==(const Result& r) const = default;
};

// Columns of chunk c that some row of rank r sees, from the first to the last such column
// (the dense oracle); empty when none.
at::ColumnSpan seen_span(const std::vector<uint8_t>& dense, const at::ColumnMask& m,
                         const at::CpLayout& l, int r, int64_t c) {
  const int64_t S = m.rows();
  at::ColumnSpan span{l.chunk_end(c), l.chunk_begin(c)};
  for (int64_t bh = 0; bh < m.batch() * m.mask_heads(); ++bh)
    for (int64_t rc : l.owned[size_t(r)])
      for (int64_t i = l.chunk_begin(rc); i < l.chunk_end(rc); ++i)
        for (int64_t j = l.chunk_begin(c); j < l.chunk_end(c); ++j)
          if (dense[size_t((bh * S + i) * S + j)])
            span = {std::min(span.begin, j), std::max(span.end, j + 1)};
  return span;
}

// Small tiles: several query tiles per call and key tiles inside one received span.
CpOptions small_tiles() {
  CpOptions opt;
  opt.flash.tile_q = 8;
  opt.flash.run_cols = 16;
  opt.tile_k = 8;
  return opt;
}

// With `vary_timing` also: each rank in turn entering forward and backward late (so its chunks
// arrive last), and overlap off, give the same bits.
void expect_matches_single_rank(const at::ColumnMask& mask, const at::CpLayout& layout,
                                uint64_t seed, const CpOptions& opt = {},
                                bool vary_timing = false) {
  comm::Communicator& world = comm::world();
  const int me = world.rank();
  Rng rng(seed);
  const int64_t nq = kB * kN * kHq * kD, nk = kB * kN * kHk * kD;
  const VecF q = randn(rng, size_t(nq)), k = randn(rng, size_t(nk)), v = randn(rng, size_t(nk)),
             dout = randn(rng, size_t(nq));
  // backward adds into dq, dk, dv: they start at these.
  const VecF dq0 = randn(rng, size_t(nq)), dk0 = randn(rng, size_t(nk)),
             dv0 = randn(rng, size_t(nk));
  // The naive reference over the whole sequence, in f64.
  const at::AttentionShape s{kB, kN, kN, kHq, kHk, kD};
  const auto f64 = [](const VecF& x) { return VecD(x.begin(), x.end()); };
  const VecD qd = f64(q), kd = f64(k), vd = f64(v), dod = f64(dout);
  VecD o(static_cast<size_t>(nq)), lse(static_cast<size_t>(kB * kHq * kN)),
      dq(static_cast<size_t>(nq)), dk(static_cast<size_t>(nk)), dv(static_cast<size_t>(nk));
  at::naive::masked_attention_forward(o.data(), lse.data(), qd.data(), kd.data(), vd.data(), s,
                                      mask);
  at::naive::masked_attention_backward(dq.data(), dk.data(), dv.data(), dod.data(), qd.data(),
                                       kd.data(), vd.data(), o.data(), lse.data(), s, mask);
  const std::vector<int64_t>& owned = layout.owned[size_t(me)];
  const auto local = [&](const auto& x, int64_t B, int64_t width) {
    return at::take_chunk_rows(x.data(), B, width, layout, owned);
  };
  const auto plus = [](VecD a, const VecF& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += double(b[i]);
    return a;
  };
  const VecF lq = local(q, kB, kHq * kD), lk = local(k, kB, kHk * kD), lv = local(v, kB, kHk * kD),
             ldo = local(dout, kB, kHq * kD), ldq0 = local(dq0, kB, kHq * kD),
             ldk0 = local(dk0, kB, kHk * kD), ldv0 = local(dv0, kB, kHk * kD);

  ContextParallelAttention cp(world, mask, layout, kHq, kHk, kD, opt);
  const auto run = [&](ContextParallelAttention& attn, int late_rank = -1) {
    const int64_t L = attn.local_rows();
    Result r{VecF(size_t(kB * L * kHq * kD)), VecF(size_t(kB * kHq * L)), ldq0, ldk0, ldv0};
    const auto arrive = [&] {
      if (me == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    };
    arrive();
    attn.forward(r.o.data(), r.lse.data(), lq.data(), lk.data(), lv.data());
    arrive();
    attn.backward(r.dq.data(), r.dk.data(), r.dv.data(), ldo.data(), lq.data(), lk.data(),
                  lv.data(), r.o.data(), r.lse.data());
    return r;
  };
  const comm::TrafficCounts before = world.traffic().bytes;
  const Result got = run(cp);
  const uint64_t sent = world.traffic().bytes.send - before.send;
  EXPECT_LT(rel_error(got.o, local(o, kB, kHq * kD), 1.0), kTol);
  EXPECT_LT(lse_error(got.lse, local(lse, kB * kHq, 1)), kTol);
  EXPECT_LT(rel_error(got.dq, plus(local(dq, kB, kHq * kD), ldq0), 1.0), kTol);
  EXPECT_LT(rel_error(got.dk, plus(local(dk, kB, kHk * kD), ldk0), 1.0), kTol);
  EXPECT_LT(rel_error(got.dv, plus(local(dv, kB, kHk * kD), ldv0), 1.0), kTol);

  // Pruning: of each chunk exactly the columns from the first to the last that some row of the
  // receiver sees travel; bytes = those columns' K and V.
  const std::vector<uint8_t> dense = at::naive::dense_mask(mask);
  int64_t expect_chunks = 0, expect_bytes = 0, received = 0, received_bytes = 0;
  for (int t = 0; t < world.size(); ++t)
    for (int64_t c = 0; c < layout.num_chunks(); ++c) {
      const at::ColumnSpan seen = seen_span(dense, mask, layout, t, c);
      const bool needed = !seen.empty();
      EXPECT_EQ(cp.needs(t, c), needed) << "rank " << t << " chunk " << c;
      if (needed) {
        EXPECT_EQ(cp.span(t, c), seen) << "rank " << t << " chunk " << c;
      }
      const int owner = layout.owners()[size_t(c)];
      const int64_t bytes = 2 * kB * seen.size() * kHk * kD * int64_t(sizeof(float));
      if (needed && owner == me && t != me) {
        ++expect_chunks;
        expect_bytes += bytes;
      }
      if (needed && t == me && owner != me) {
        ++received;
        received_bytes += bytes;
      }
    }
  // Forward and backward each exchange K/V once; backward returns a gradient per chunk received.
  const CpStats& st = cp.stats();
  EXPECT_EQ(st.kv_chunks_sent, 2 * expect_chunks);
  EXPECT_EQ(st.kv_bytes_sent, 2 * expect_bytes);
  EXPECT_EQ(st.grad_chunks_sent, received);
  EXPECT_EQ(st.grad_bytes_sent, received_bytes);
  EXPECT_EQ(int64_t(sent), st.kv_bytes_sent + st.grad_bytes_sent);
  // Repeated runs are bitwise identical.
  EXPECT_TRUE(run(cp) == got);
  if (!vary_timing) return;
  for (int late = 0; late < world.size(); ++late)
    EXPECT_TRUE(run(cp, late) == got) << "rank " << late << " late";
  CpOptions waiting = opt;
  waiting.overlap = false;
  ContextParallelAttention no_overlap(world, mask, layout, kHq, kHk, kD, waiting);
  EXPECT_TRUE(run(no_overlap) == got) << "overlap off";
}

std::vector<at::CpLayout> layouts(const at::ColumnMask& mask, Rng& rng) {
  const int P = comm::world().size();
  const int64_t chunk = (kN + 4 * P - 1) / (4 * P);  // 4 chunks per rank, a short last one
  const at::TiledMask tm(mask);
  std::vector<at::CpLayout> ls{
      at::contiguous_layout(kN, chunk, P), at::zigzag_layout(kN, P),
      at::balanced_layout(kN, chunk, P, at::chunk_work(tm, chunk, kHq, kHk, 16))};
  at::CpLayout random = ls[0];
  std::vector<int64_t> perm(static_cast<size_t>(random.num_chunks()));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.below(i)]);
  for (int r = 0; r < P; ++r) {
    random.owned[size_t(r)].assign(perm.begin() + 4 * r, perm.begin() + 4 * (r + 1));
    std::sort(random.owned[size_t(r)].begin(), random.owned[size_t(r)].end());
  }
  ls.push_back(random);
  return ls;
}

TEST(ContextParallel, MatchesSingleRankForEveryMaskType) {
  Rng rng(21);
  const auto first = standard_masks(kN, rng), second = standard_masks(kN, rng);
  for (size_t i = 0; i < first.size(); ++i) {
    SCOPED_TRACE(first[i].name);
    // A different mask of the same type per batch row.
    const at::ColumnMask mask =
        at::stack_masks(kN, kN, kB, 1, {first[i].columns, second[i].columns});
    int n = 0;
    for (const at::CpLayout& l : layouts(mask, rng)) {
      SCOPED_TRACE("layout " + std::to_string(n++));
      expect_matches_single_rank(mask, l, 100 + i);
    }
  }
}

// Tiles of 8 query rows and 8 keys (GEMM runs of 16 columns): several tiles per call, tiles
// straddling chunk boundaries, and received spans cut into tiles.
TEST(ContextParallel, MatchesSingleRankWithSmallTiles) {
  Rng rng(23);
  const auto first = standard_masks(kN, rng), second = standard_masks(kN, rng);
  const int P = comm::world().size();
  for (size_t i = 0; i < first.size(); ++i) {
    SCOPED_TRACE(first[i].name);
    const at::ColumnMask mask =
        at::stack_masks(kN, kN, kB, 1, {first[i].columns, second[i].columns});
    expect_matches_single_rank(mask, at::zigzag_layout(kN, P), 200 + i, small_tiles());
    expect_matches_single_rank(mask, at::contiguous_layout(kN, (kN + 4 * P - 1) / (4 * P), P),
                               300 + i, small_tiles());
  }
}

// The merge order is fixed: whichever rank's chunks arrive last, and with the overlap off, the
// result has the same bits.
TEST(ContextParallel, DoesNotDependOnArrivalOrder) {
  Rng rng(24);
  const auto masks = standard_masks(kN, rng);
  const int P = comm::world().size();
  uint64_t seed = 400;
  for (const at::test::MaskCase& m : masks) {
    if (m.name != "causal" && m.name != "causal_document" && m.name != "global_sliding_window")
      continue;
    SCOPED_TRACE(m.name);
    const at::ColumnMask mask = at::stack_masks(kN, kN, kB, 1, {m.columns, m.columns});
    expect_matches_single_rank(mask, at::zigzag_layout(kN, P), ++seed, {}, true);
    expect_matches_single_rank(mask, at::contiguous_layout(kN, (kN + 4 * P - 1) / (4 * P), P),
                               ++seed, small_tiles(), true);
  }
}

// Runs `body`; a rank still inside it after `limit` is taken as deadlocked and ends the job
// with a failure (mpirun then stops every rank), so a hang fails at once rather than at CTest's
// timeout.
void fail_if_hung(std::chrono::seconds limit, const std::function<void()>& body) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(mu);
    if (cv.wait_for(lock, limit, [&] { return done; })) return;
    std::fprintf(stderr, "[rank %d] still inside the test after %lld s: deadlocked\n",
                 comm::world().rank(), static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(3);
  });
  struct Finish {
    std::mutex& mu;
    std::condition_variable& cv;
    bool& done;
    std::thread& watchdog;
    ~Finish() {
      {
        std::lock_guard lock(mu);
        done = true;
      }
      cv.notify_all();
      watchdog.join();
    }
  } finish{mu, cv, done, watchdog};
  body();
}

// Every rank fails inside the call after posting its receives (flash tile_q = 0 is refused only
// when the kernel runs): in the backward the receives of the peers' dK/dV partials, which no
// peer will send. The error must reach the caller on every rank, not leave each waiting for them
// while it unwinds. On a split communicator of its own: an abandoned exchange may leave stray
// messages behind.
TEST(ContextParallel, AnErrorOnEveryRankPropagatesInsteadOfDeadlocking) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const int64_t S = 8 * P;
  const at::ColumnMask mask = at::stack_masks(S, S, 1, 1, {at::causal_mask(S, S)});
  const at::CpLayout layout = at::contiguous_layout(S, 8, P);  // rank r: chunk r, needs 0..r-1
  CpOptions broken;
  broken.flash.tile_q = 0;
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    auto group = world.split(0, world.rank());
    ASSERT_NE(group, nullptr);
    ContextParallelAttention cp(*group, mask, layout, 1, 1, 4, broken);
    const VecF x(size_t(8 * 4), 0.5f), lse(8, 0.0f);
    VecF o(x.size()), l(lse.size()), dq(x.size()), dk(x.size()), dv(x.size());
    fail_if_hung(std::chrono::seconds(60), [&] {
      try {
        if (backward)
          cp.backward(dq.data(), dk.data(), dv.data(), x.data(), x.data(), x.data(), x.data(),
                      x.data(), lse.data());
        else
          cp.forward(o.data(), l.data(), x.data(), x.data(), x.data());
        ADD_FAILURE() << "tile_q = 0 must throw";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("tile_q"), std::string::npos) << e.what();
      }
    });
  }
}

TEST(ContextParallel, MatchesSingleRankForRandomMasksPerHead) {
  Rng rng(22);
  for (bool causal : {false, true}) {
    std::vector<at::MaskColumns> cols;
    for (int64_t i = 0; i < kB * kHk; ++i) cols.push_back(random_mask(rng, kN, kN, causal));
    const at::ColumnMask mask = at::stack_masks(kN, kN, kB, kHk, cols);
    for (const at::CpLayout& l : layouts(mask, rng)) expect_matches_single_rank(mask, l, 7);
  }
}

}  // namespace
}  // namespace tessel::parallel
