// Context-parallel FlashMask attention (issue #6), an MPI driver: run under mpirun, one rank
// per cp rank, OMP_NUM_THREADS=1.
//   1. balance (rank 0, no communication): max / mean per-rank tile work of the contiguous,
//      zigzag and balanced layouts for causal and causal-document masks, K = 4 and 8 chunks
//      per rank (zigzag always has 2), P = 2, 4, 8;
//   2. traffic (all ranks, P = world size): key/value bytes one forward sends, summed over the
//      ranks, against a dense all-gather ((P - 1) x all key/value bytes), per layout and mask:
//      as sent (each needed chunk's span of seen columns) and, in brackets, what whole needed
//      chunks would be (the pruning before spans);
//   3. overlap: forward, and forward + backward, of the balanced causal layout with and
//      without overlap: time, seconds waiting for remote data (exposed communication; in the
//      backward also the wait for the peers' dK/dV partials, which depend on their compute) and
//      its share of the blocking wait (the whole transfer time).
//
//   mpirun -np 4 -x OMP_NUM_THREADS=1 bench_context_parallel [--seq 16384] [--overlap-seq 8192]
//          [--only-overlap]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tessel/attention/mask_builders.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/parallel/context_parallel.hpp"

using namespace tessel;
using namespace tessel::attention;

namespace {

constexpr int64_t kHeads = 4, kDim = 64, kTileQ = 128;

// Documents of 256 to 2048 tokens in a fixed cycle, the last one cut to fit.
ColumnMask causal_documents(int64_t N) {
  const int64_t cycle[] = {1024, 256, 2048, 512, 1536, 768};
  std::vector<int64_t> docs;
  for (int64_t left = N, i = 0; left > 0; ++i) {
    docs.push_back(std::min(left, cycle[i % 6]));
    left -= docs.back();
  }
  return stack_masks(N, N, 1, 1, {causal_document_mask(docs)});
}

struct MaskCase {
  const char* name;
  ColumnMask mask;
};

std::vector<CpLayout> layouts(const TiledMask& tm, int64_t N, int P, int64_t K) {
  const int64_t chunk = N / (K * P);
  return {contiguous_layout(N, chunk, P), zigzag_layout(N, P),
          balanced_layout(N, chunk, P, chunk_work(tm, chunk, kHeads, kHeads, kTileQ))};
}

void balance(const std::vector<MaskCase>& cases, int64_t N) {
  std::printf("\n## balance: max/mean tile work (tile_q %ld, tile_k %ld, S = %ld)\n", long(kTileQ),
              long(TiledMask::kDefaultTileK), long(N));
  std::printf("%-16s %3s %3s %11s %11s %11s\n", "mask", "P", "K", "contiguous", "zigzag(K=2)",
              "balanced");
  for (const MaskCase& mc : cases) {
    const TiledMask tm(mc.mask);
    for (int P : {2, 4, 8})
      for (int64_t K : {4, 8}) {
        std::printf("%-16s %3d %3ld", mc.name, P, long(K));
        const std::vector<CpLayout> ls = layouts(tm, N, P, K);
        for (const CpLayout& l : ls)
          std::printf(" %11.4f", imbalance(l, chunk_work(tm, l.chunk, kHeads, kHeads, kTileQ)));
        std::printf("\n");
      }
  }
}

std::vector<float> random_values(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(n));
  rng.fill_normal(x.data(), n, 0.0f, 1.0f);
  return x;
}

// One forward (and, with `backward`, one backward) of this rank's part; returns seconds.
double run(parallel::ContextParallelAttention& cp, bool backward) {
  const int64_t L = cp.local_rows(), nq = L * kHeads * kDim;
  const std::vector<float> q = random_values(nq, 1), k = random_values(nq, 2),
                           v = random_values(nq, 3), dout = random_values(nq, 4);
  std::vector<float> o(static_cast<size_t>(nq)), lse(static_cast<size_t>(L * kHeads));
  std::vector<float> dq(o.size()), dk(o.size()), dv(o.size());
  comm::world().barrier();
  const Timer t;
  cp.forward(o.data(), lse.data(), q.data(), k.data(), v.data());
  if (backward)
    cp.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                o.data(), lse.data());
  return t.seconds();
}

void traffic(const std::vector<MaskCase>& cases, int64_t N) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const double dense = double(P - 1) * double(N) * 2 * kHeads * kDim * sizeof(float);
  if (world.rank() == 0) {
    std::printf(
        "\n## traffic: forward K/V bytes, all ranks, / dense all-gather (P = %d); spans "
        "(whole chunks)\n",
        P);
    std::printf("%-16s %3s %17s %17s %17s\n", "mask", "K", "contiguous", "zigzag(K=2)", "balanced");
  }
  for (const MaskCase& mc : cases) {
    const TiledMask tm(mc.mask);
    for (int64_t K : {4, 8}) {
      if (world.rank() == 0) std::printf("%-16s %3ld", mc.name, long(K));
      for (const CpLayout& l : layouts(tm, N, P, K)) {
        parallel::ContextParallelAttention cp(world, mc.mask, l, kHeads, kHeads, kDim);
        run(cp, false);
        std::vector<int64_t> bytes{cp.stats().kv_bytes_sent};
        world.all_reduce(bytes);
        double chunks = 0;  // every rank knows every rank's needs: no reduction
        for (int t = 0; t < P; ++t)
          for (int64_t c = 0; c < l.num_chunks(); ++c)
            if (cp.needs(t, c) && l.owners()[size_t(c)] != t)
              chunks += double(l.chunk_rows(c)) * 2 * kHeads * kDim * sizeof(float);
        if (world.rank() == 0)
          std::printf("   %6.4f (%6.4f)", double(bytes[0]) / dense, chunks / dense);
      }
      if (world.rank() == 0) std::printf("\n");
    }
  }
}

void overlap(int64_t N, int reps) {
  comm::Communicator& world = comm::world();
  const MaskCase mc{"causal", ColumnMask::causal_only(1, N, N)};
  const TiledMask tm(mc.mask);
  const CpLayout l = layouts(tm, N, world.size(), 4)[2];
  if (world.rank() == 0)
    std::printf(
        "\n## overlap: causal, balanced K = 4, S = %ld, P = %d, best of %d (slowest rank)\n"
        "%-9s %-10s %10s %12s %12s %14s\n",
        long(N), world.size(), reps, "pass", "mode", "seconds", "wait (s)", "wait/time",
        "wait/blocking");
  for (bool backward : {false, true}) {
    double base_wait = 0;
    for (bool ov : {false, true}) {
      parallel::CpOptions opt;
      opt.overlap = ov;
      parallel::ContextParallelAttention cp(world, mc.mask, l, kHeads, kHeads, kDim, opt);
      double best = 1e30, best_wait = 0;
      for (int r = 0; r < reps; ++r) {
        cp.reset_stats();
        std::vector<double> t{run(cp, backward), cp.stats().wait_seconds};
        world.all_reduce(t, comm::ReduceOp::max);
        if (t[0] < best) best = t[0], best_wait = t[1];
      }
      if (!ov) base_wait = best_wait;
      if (world.rank() == 0)
        std::printf("%-9s %-10s %10.4f %12.5f %12.4f %14.4f\n", backward ? "fwd+bwd" : "forward",
                    ov ? "overlap" : "blocking", best, best_wait, best_wait / best,
                    best_wait / base_wait);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  auto guard = comm::init_communication(&argc, &argv);
  int64_t seq = 16384, overlap_seq = 8192;
  bool only_overlap = false;
  CLI::App app{"Context-parallel FlashMask attention: layout balance, key/value traffic, overlap"};
  app.add_option("--seq", seq, "sequence length of the balance and traffic parts")
      ->capture_default_str();
  app.add_option("--overlap-seq", overlap_seq, "sequence length of the overlap part")
      ->capture_default_str();
  app.add_flag("--only-overlap", only_overlap, "run the overlap part alone");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // every rank parsed the same arguments: one speaks
    return comm::world().rank() == 0 ? app.exit(e) : e.get_exit_code();
  }
  if (seq < 1 || overlap_seq < 1) {
    if (comm::world().rank() == 0)
      std::fprintf(stderr, "bench_context_parallel: --seq and --overlap-seq must be >= 1\n");
    return 2;
  }
  const std::vector<MaskCase> cases{
      {"causal", ColumnMask::causal_only(1, seq, seq)},
      {"causal_document", causal_documents(seq)},
      {"window_1024", stack_masks(seq, seq, 1, 1, {sliding_window_mask(seq, seq, 1024)})}};
  if (!only_overlap) {
    if (comm::world().rank() == 0) balance(cases, seq);
    traffic(cases, seq);
  }
  overlap(overlap_seq, 3);
  return 0;
}
