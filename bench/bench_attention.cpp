// FlashMask attention benchmark (issue #3). For head dims and sequence lengths given on the
// command line it times the forward and backward of the tiled kernel over the standard masks,
// and reports per case: the fraction of tiles computed, time, useful throughput (FLOPs of the
// computed tiles: 4 D per element forward, 10 D backward) as a share of the GEMM peak measured
// in the same run, and the mask's bytes against a dense Sq x Sk boolean mask. Then per
// (D, S): R^2 of time against computed-tile fraction over the masks, and the speed-up of
// skipping on causal-document masks (documents of 256-2048 tokens) against the same kernel
// with skipping disabled, next to the 0.8 / (visible-tile fraction) target, and the causal
// mask's speed-up on all threads against one thread (timed interleaved in the same run).
// Block masks: the causal mask ANDed with a FlashMask-3 block mask (diagonal 128-blocks on, each
// block below it on with probability 25 % or 50 %), timed right after the causal mask alone in
// each repetition; the speed-up is the median (and range) of the per-repetition ratios, next to
// the ratio of computed tiles.
//
//   bench_attention [--dims 64,128] [--seqs 4096,8192] [--heads 4] [--kv-heads HEADS] [--reps 3]
//                   [--tile-q 128] [--tile-k 64] [--run-cols 512]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "tessel/attention/block_mask.hpp"
#include "tessel/attention/flash_attention.hpp"
#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/gemm_peak.hpp"

using namespace tessel;
using namespace tessel::attention;

namespace {

std::vector<int64_t> documents(Rng& rng, int64_t N, int64_t lo, int64_t hi) {
  std::vector<int64_t> d;
  for (int64_t left = N; left > 0;) {
    const int64_t len = std::min(left, lo + int64_t(rng.below(uint64_t(hi - lo + 1))));
    d.push_back(len);
    left -= len;
  }
  return d;
}

struct Case {
  std::string name;
  MaskColumns columns;
};

std::vector<Case> masks(int64_t N, Rng& rng) {
  const auto docs = documents(rng, N, 256, 2048);
  std::vector<int64_t> prefix;
  for (int64_t len : docs) prefix.push_back(len / 4);
  std::vector<Span> spans;
  for (int64_t o = N / 8; o + N / 16 <= N; o += N / 4) spans.push_back({o, N / 16});
  std::vector<int64_t> evict(static_cast<size_t>(N));
  for (int64_t j = 0; j < N; ++j)
    evict[size_t(j)] = std::min(N, j + 1 + int64_t(rng.below(uint64_t(N / 2))));
  return {
      {"full (no mask)", MaskColumns{false, 2,
                                     [&] {
                                       std::vector<int32_t> v;
                                       for (int64_t j = 0; j < N; ++j)
                                         v.insert(v.end(), {int32_t(N), 0});
                                       return v;
                                     }()}},
      {"causal", causal_mask(N, N)},
      {"sliding window N/8", sliding_window_mask(N, N, N / 8)},
      {"causal document", causal_document_mask(docs)},
      {"document", document_mask(docs)},
      {"share question", share_question_mask(documents(rng, N, N / 8, N / 4))},
      {"global + sliding window", global_sliding_window_mask(N, 64, N / 16, N / 16)},
      {"causal blockwise", causal_blockwise_mask(documents(rng, N, N / 8, N / 4))},
      {"prefix-LM causal N/4", prefix_lm_causal_mask(N, N / 4)},
      {"prefix-LM document", prefix_lm_document_mask(docs, prefix)},
      {"QK-sparse", qk_sparse_mask(N, spans)},
      {"random eviction", random_eviction_mask(evict)},
  };
}

// Causal block pattern over N x N: diagonal blocks on (no row loses every key), each block
// below the diagonal on with probability percent_on / 100.
BlockMask causal_blocks(int64_t N, uint64_t percent_on, Rng& rng) {
  const int64_t nb = BlockMask::blocks(N);
  std::vector<uint8_t> on(size_t(nb * nb), 0);
  for (int64_t br = 0; br < nb; ++br)
    for (int64_t bc = 0; bc <= br; ++bc)
      on[size_t(br * nb + bc)] = bc == br || rng.below(100) < percent_on;
  return BlockMask(1, 1, N, N, std::move(on));
}

// Seconds per repetition, in order.
struct Timing {
  std::vector<double> fwd, bwd;
  double best_fwd() const { return *std::min_element(fwd.begin(), fwd.end()); }
  double best_bwd() const { return *std::min_element(bwd.begin(), bwd.end()); }
};

// Median and range of num[r] / den[r] over the repetitions: both timed in the same repetition,
// so load that changes between repetitions cancels.
struct Ratio {
  double median, lo, hi;
};
Ratio paired_ratio(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> r;
  for (size_t i = 0; i < num.size(); ++i) r.push_back(num[i] / den[i]);
  std::sort(r.begin(), r.end());
  const size_t n = r.size();
  return {n % 2 ? r[n / 2] : (r[n / 2 - 1] + r[n / 2]) / 2, r.front(), r.back()};
}

// One forward and one backward, appended to `t`.
void time_once(Timing& t, const AttentionShape& s, const TiledMask& tm, const FlashOptions& opt,
               const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, const BlockMask* block = nullptr) {
  std::vector<float> o(q.size()), lse(size_t(s.B * s.Hq * s.Sq)), dq(q.size()), dk(k.size()),
      dv(k.size());
  Timer f;
  flash_attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s, tm, opt, block);
  t.fwd.push_back(f.seconds());
  Timer b;
  flash_attention_backward(dq.data(), dk.data(), dv.data(), o.data(), q.data(), k.data(), v.data(),
                           o.data(), lse.data(), s, tm, opt, block);
  t.bwd.push_back(b.seconds());
}

// Coefficient of determination of the least-squares line y = a + b x.
double r_squared(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = double(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i] / n, my += y[i] / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return syy > 0 && sxx > 0 ? sxy * sxy / (sxx * syy) : 1.0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> dims{64, 128}, seqs{4096, 8192};
  int64_t heads = 4, kv_heads = 0, tile_k = TiledMask::kDefaultTileK;
  FlashOptions opt;
  int reps = 3;
  CLI::App app{"FlashMask attention against the dense masked kernel, per mask family"};
  app.add_option("--dims", dims, "head dimensions, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--seqs", seqs, "sequence lengths, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--heads", heads, "query heads")->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "key/value heads (default: --heads)");
  app.add_option("--reps", reps, "repetitions, interleaved over the masks; the best counts")
      ->capture_default_str();
  app.add_option("--tile-q", opt.tile_q, "query rows per tile")->capture_default_str();
  app.add_option("--tile-k", tile_k, "key columns per tile")->capture_default_str();
  app.add_option("--run-cols", opt.run_cols, "key columns per dense run")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (kv_heads == 0) kv_heads = heads;
  const auto positive = [](int64_t v) { return v > 0; };
  if (!std::ranges::all_of(dims, positive) || !std::ranges::all_of(seqs, positive) ||
      !std::ranges::all_of(
          std::array{heads, kv_heads, int64_t(reps), opt.tile_q, tile_k, opt.run_cols}, positive)) {
    std::fprintf(stderr, "bench_attention: every size and count must be >= 1\n");
    return 2;
  }
  const int threads = num_threads();
  std::printf(
      "threads %d, tile_q %lld, tile_k %lld, run_cols %lld; repetitions interleaved over "
      "the masks, best of %d (block-mask speed-ups: paired per repetition); GEMM peak = best "
      "1024^3 sgemm of the repetitions\n",
      threads, (long long)opt.tile_q, (long long)tile_k, (long long)opt.run_cols, reps);
  for (int64_t D : dims)
    for (int64_t N : seqs) {
      const AttentionShape s{1, N, N, heads, kv_heads, D};
      Rng rng(uint64_t(N * 131 + D));
      std::vector<float> q(size_t(N * heads * D)), k(size_t(N * kv_heads * D)), v(k.size());
      rng.fill_normal(q.data(), int64_t(q.size()), 0, 1);
      rng.fill_normal(k.data(), int64_t(k.size()), 0, 1);
      rng.fill_normal(v.data(), int64_t(v.size()), 0, 1);
      const std::vector<Case> cases = masks(N, rng);
      std::vector<TiledMask> tiled;
      for (const Case& c : cases) tiled.emplace_back(stack_masks(N, N, 1, 1, {c.columns}), tile_k);
      const size_t causal_case = 1;  // also timed on one thread
      const size_t doc_case = 3;     // "causal document": also timed with skipping off
      std::vector<Timing> t(cases.size());
      Timing base, one_thread;
      const std::vector<uint64_t> block_percents{25, 50};
      std::vector<BlockMask> blocks;
      for (uint64_t pct : block_percents) blocks.push_back(causal_blocks(N, pct, rng));
      std::vector<Timing> tblock(blocks.size());
      FlashOptions no_skip = opt;
      no_skip.skip_tiles = false;
      double peak = 0;
      for (int r = 0; r < reps; ++r) {
        peak = std::max(peak, kernels::measure_gemm_peak_gflops(1024, 0.3));
        for (size_t c = 0; c < cases.size(); ++c) {
          time_once(t[c], s, tiled[c], opt, q, k, v);
          if (c != causal_case) continue;
          for (size_t i = 0; i < blocks.size(); ++i)  // right after causal alone: paired
            time_once(tblock[i], s, tiled[causal_case], opt, q, k, v, &blocks[i]);
        }
        time_once(base, s, tiled[doc_case], no_skip, q, k, v);
        set_num_threads(1);
        time_once(one_thread, s, tiled[causal_case], opt, q, k, v);
        set_num_threads(threads);
      }
      std::printf("\nD=%lld S=%lld B=1 H=%lld Hkv=%lld, GEMM peak %.1f GFLOP/s\n", (long long)D,
                  (long long)N, (long long)heads, (long long)kv_heads, peak);
      std::printf("%-24s %9s %9s %9s %8s %8s %18s\n", "mask", "computed", "fwd ms", "bwd ms",
                  "fwd/peak", "bwd/peak", "mask B vs dense B");
      std::vector<double> frac, tf, tb;
      for (size_t c = 0; c < cases.size(); ++c) {
        const TileCounts tc = count_tiles(tiled[c], heads, kv_heads, opt.tile_q);
        const double elems = double(tc.computed_elements);
        const double fwd = t[c].best_fwd(), bwd = t[c].best_bwd();
        const double fwd_gf = 4.0 * double(D) * elems / fwd * 1e-9;
        const double bwd_gf = 10.0 * double(D) * elems / bwd * 1e-9;
        std::printf("%-24s %9.3f %9.1f %9.1f %7.0f%% %7.0f%% %8lld vs %lld\n",
                    cases[c].name.c_str(), tc.computed_fraction(), fwd * 1e3, bwd * 1e3,
                    100 * fwd_gf / peak, 100 * bwd_gf / peak, (long long)tiled[c].bytes(),
                    (long long)(N * N));
        frac.push_back(tc.computed_fraction());
        tf.push_back(fwd);
        tb.push_back(bwd);
      }
      const double vis =
          count_tiles(tiled[doc_case], heads, kv_heads, opt.tile_q).computed_fraction();
      std::printf(
          "causal document, skipping off: fwd %.1f ms (%.2fx), bwd %.1f ms (%.2fx); "
          "target 0.8 / %.3f = %.2fx\n",
          base.best_fwd() * 1e3, base.best_fwd() / tf[doc_case], base.best_bwd() * 1e3,
          base.best_bwd() / tb[doc_case], vis, 0.8 / vis);
      std::printf(
          "causal on 1 thread: fwd %.1f ms, bwd %.1f ms; %d threads vs 1: fwd %.2fx, bwd %.2fx\n",
          one_thread.best_fwd() * 1e3, one_thread.best_bwd() * 1e3, threads,
          one_thread.best_fwd() / tf[causal_case], one_thread.best_bwd() / tb[causal_case]);
      const double causal_frac = frac[causal_case];
      for (size_t i = 0; i < blocks.size(); ++i) {
        const double bf =
            count_tiles(tiled[causal_case], heads, kv_heads, opt.tile_q, 0, -1, &blocks[i])
                .computed_fraction();
        const Ratio rf = paired_ratio(t[causal_case].fwd, tblock[i].fwd);
        const Ratio rb = paired_ratio(t[causal_case].bwd, tblock[i].bwd);
        std::printf(
            "causal + block mask, %llu%% of blocks below the diagonal on: computed %.3f, best fwd "
            "%.1f ms, bwd %.1f ms; causal without it, median of per-repetition ratios (range): "
            "fwd %.2fx (%.2f-%.2f), bwd %.2fx (%.2f-%.2f) (computed tiles %.2fx)\n",
            (unsigned long long)block_percents[i], bf, tblock[i].best_fwd() * 1e3,
            tblock[i].best_bwd() * 1e3, rf.median, rf.lo, rf.hi, rb.median, rb.lo, rb.hi,
            causal_frac / bf);
      }
      std::printf("R^2 of time vs computed fraction: forward %.4f, backward %.4f\n",
                  r_squared(frac, tf), r_squared(frac, tb));
    }
  return 0;
}
