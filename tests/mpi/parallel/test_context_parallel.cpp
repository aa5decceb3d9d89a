// Context-parallel attention on the MPI world as the cp group, against the single-rank FlashMask
// kernel on the whole sequence (computed on every rank from the same seed): O, LSE, dQ, dK, dV
// of the owned rows within 1e-5 * max |reference| for all eleven masks and random masks, under
// contiguous, zigzag, balanced and random layouts (short last chunks included); repeated runs
// bitwise identical; every chunk a rank's rows see is sent to it and nothing else (checked
// against the dense global mask and the communicator's traffic counters).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

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
using kernels::test::to_f64;
using kernels::test::VecF;

constexpr double kTol = 1e-5;
constexpr int64_t kN = 94, kB = 2, kHq = 4, kHk = 2, kD = 8;

struct Result {
  VecF o, lse, dq, dk, dv;
  bool operator==(const Result& r) const = default;
};

// Whether some row of rank r's chunks sees some column of chunk c (dense global mask).
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

void expect_matches_single_rank(const at::ColumnMask& mask, const at::CpLayout& layout,
                                uint64_t seed) {
  comm::Communicator& world = comm::world();
  const int me = world.rank();
  Rng rng(seed);
  const int64_t nq = kB * kN * kHq * kD, nk = kB * kN * kHk * kD;
  const VecF q = randn(rng, size_t(nq)), k = randn(rng, size_t(nk)), v = randn(rng, size_t(nk)),
             dout = randn(rng, size_t(nq));
  // Single-rank reference over the whole sequence.
  const at::AttentionShape s{kB, kN, kN, kHq, kHk, kD};
  const at::TiledMask tm(mask);
  Result ref{VecF(size_t(nq)), VecF(size_t(kB * kHq * kN)), VecF(size_t(nq)), VecF(size_t(nk)),
             VecF(size_t(nk))};
  at::flash_attention_forward(ref.o.data(), ref.lse.data(), q.data(), k.data(), v.data(), s, tm);
  at::flash_attention_backward(ref.dq.data(), ref.dk.data(), ref.dv.data(), dout.data(), q.data(),
                               k.data(), v.data(), ref.o.data(), ref.lse.data(), s, tm);
  const std::vector<int64_t>& owned = layout.owned[size_t(me)];
  const auto local = [&](const VecF& x, int64_t B, int64_t width) {
    return at::take_chunk_rows(x.data(), B, width, layout, owned);
  };
  const Result want{local(ref.o, kB, kHq * kD), local(ref.lse, kB * kHq, 1),
                    local(ref.dq, kB, kHq * kD), local(ref.dk, kB, kHk * kD),
                    local(ref.dv, kB, kHk * kD)};
  const VecF lq = local(q, kB, kHq * kD), lk = local(k, kB, kHk * kD), lv = local(v, kB, kHk * kD),
             ldo = local(dout, kB, kHq * kD);

  ContextParallelAttention cp(world, mask, layout, kHq, kHk, kD);
  const int64_t L = cp.local_rows();
  const auto run = [&] {
    Result r{VecF(size_t(kB * L * kHq * kD)), VecF(size_t(kB * kHq * L)),
             VecF(size_t(kB * L * kHq * kD)), VecF(size_t(kB * L * kHk * kD)),
             VecF(size_t(kB * L * kHk * kD))};
    cp.forward(r.o.data(), r.lse.data(), lq.data(), lk.data(), lv.data());
    cp.backward(r.dq.data(), r.dk.data(), r.dv.data(), ldo.data(), lq.data(), lk.data(), lv.data(),
                r.o.data(), r.lse.data());
    return r;
  };
  const comm::TrafficCounts before = world.traffic().bytes;
  const Result got = run();
  const uint64_t sent = world.traffic().bytes.send - before.send;
  EXPECT_LT(rel_error(got.o, to_f64(want.o), 1.0), kTol);
  EXPECT_LT(lse_error(got.lse, to_f64(want.lse)), kTol);
  EXPECT_LT(rel_error(got.dq, to_f64(want.dq), 1.0), kTol);
  EXPECT_LT(rel_error(got.dk, to_f64(want.dk), 1.0), kTol);
  EXPECT_LT(rel_error(got.dv, to_f64(want.dv), 1.0), kTol);

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
  EXPECT_TRUE(run() == got);
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
