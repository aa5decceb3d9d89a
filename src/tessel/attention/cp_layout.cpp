#include "tessel/attention/cp_layout.hpp"

#include <algorithm>
#include <numeric>

#include "tessel/core/error.hpp"

namespace tessel::attention {

namespace {

int64_t checked_chunks(int64_t seq, int64_t chunk, int P) {
  if (seq < 1 || chunk < 1 || P < 1)
    input_error("context-parallel layout: sequence ", seq, ", chunk ", chunk, ", ranks ", P,
                " must all be >= 1");
  const int64_t n = (seq + chunk - 1) / chunk;
  if (n % P != 0)
    input_error("context-parallel layout: ", n, " chunks of ", chunk, " rows (sequence ", seq,
                ") do not split evenly over ", P, " ranks");
  return n;
}

int64_t sum_of(const std::vector<int64_t>& ids, const std::vector<int64_t>& work) {
  int64_t s = 0;
  for (int64_t c : ids) s += work[size_t(c)];
  return s;
}

// The best split of `pool` (2K chunks) into two sets of K minimising the larger sum: every
// subset holding pool[0] for K <= 8, otherwise the best single swap from the split (a, b).
// Returns false when nothing beats max(sum a, sum b).
bool repartition(std::vector<int64_t>& a, std::vector<int64_t>& b,
                 const std::vector<int64_t>& work) {
  const int64_t current = std::max(sum_of(a, work), sum_of(b, work));
  const size_t K = a.size();
  if (K <= 8) {
    std::vector<int64_t> pool = a;
    pool.insert(pool.end(), b.begin(), b.end());
    std::sort(pool.begin(), pool.end());
    const int64_t total = sum_of(pool, work);
    const uint32_t n = uint32_t(pool.size());
    int64_t best = current;
    uint32_t best_set = 0;
    for (uint32_t set = 1; set < (1u << n); set += 2) {  // pool[0] always in the first half
      if (size_t(__builtin_popcount(set)) != K) continue;
      int64_t s = 0;
      for (uint32_t i = 0; i < n; ++i)
        if (set >> i & 1) s += work[size_t(pool[i])];
      const int64_t larger = std::max(s, total - s);
      if (larger < best) best = larger, best_set = set;
    }
    if (best_set == 0) return false;
    a.clear();
    b.clear();
    for (uint32_t i = 0; i < n; ++i) (best_set >> i & 1 ? a : b).push_back(pool[i]);
    return true;
  }
  const int64_t sa = sum_of(a, work), sb = sum_of(b, work);
  int64_t best = current;
  size_t bi = K, bj = K;
  for (size_t i = 0; i < K; ++i)
    for (size_t j = 0; j < K; ++j) {
      const int64_t d = work[size_t(b[j])] - work[size_t(a[i])];
      const int64_t larger = std::max(sa + d, sb - d);
      if (larger < best) best = larger, bi = i, bj = j;
    }
  if (bi == K) return false;
  std::swap(a[bi], b[bj]);
  return true;
}

}  // namespace

std::vector<int> CpLayout::owners() const {
  std::vector<int> o(size_t(num_chunks()), -1);
  for (int r = 0; r < ranks(); ++r)
    for (int64_t c : owned[size_t(r)]) o[size_t(c)] = r;
  return o;
}

int64_t CpLayout::local_rows(int r) const {
  int64_t n = 0;
  for (int64_t c : owned[size_t(r)]) n += chunk_rows(c);
  return n;
}

void CpLayout::check() const {
  TESSEL_CHECK(ranks() >= 1 && num_chunks() % ranks() == 0, "layout of ", num_chunks(),
               " chunks over ", ranks(), " ranks");
  std::vector<int> seen(size_t(num_chunks()), 0);
  for (const auto& ids : owned) {
    TESSEL_CHECK(int64_t(ids.size()) == num_chunks() / ranks(), "a rank owns ", ids.size(),
                 " chunks");
    TESSEL_CHECK(std::is_sorted(ids.begin(), ids.end()), "owned chunks not ascending");
    for (int64_t c : ids) {
      TESSEL_CHECK(c >= 0 && c < num_chunks(), "chunk ", c);
      ++seen[size_t(c)];
    }
  }
  for (int s : seen) TESSEL_CHECK(s == 1, "a chunk owned ", s, " times");
}

CpLayout contiguous_layout(int64_t seq, int64_t chunk, int P) {
  const int64_t n = checked_chunks(seq, chunk, P), K = n / P;
  CpLayout l{seq, chunk, std::vector<std::vector<int64_t>>(size_t(P))};
  for (int64_t c = 0; c < n; ++c) l.owned[size_t(c / K)].push_back(c);
  return l;
}

CpLayout zigzag_layout(int64_t seq, int P) {
  const int64_t chunk = (seq + 2 * P - 1) / std::max(1, 2 * P);
  const int64_t n = checked_chunks(seq, std::max<int64_t>(chunk, 1), P);
  if (n != 2 * P)
    input_error("zigzag layout: sequence ", seq, " is too short for 2 x ", P, " chunks");
  CpLayout l{seq, chunk, std::vector<std::vector<int64_t>>(size_t(P))};
  for (int r = 0; r < P; ++r) l.owned[size_t(r)] = {r, 2 * P - 1 - r};
  return l;
}

CpLayout balanced_layout(int64_t seq, int64_t chunk, int P, const std::vector<int64_t>& work) {
  const int64_t n = checked_chunks(seq, chunk, P), K = n / P;
  if (int64_t(work.size()) != n)
    input_error("balanced layout: ", work.size(), " chunk work values for ", n, " chunks");
  // LPT: heaviest chunk first onto the lightest rank that still has room.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work[size_t(a)] > work[size_t(b)]; });
  CpLayout l{seq, chunk, std::vector<std::vector<int64_t>>(size_t(P))};
  std::vector<int64_t> load(size_t(P), 0);
  for (int64_t c : order) {
    int best = -1;
    for (int r = 0; r < P; ++r)
      if (int64_t(l.owned[size_t(r)].size()) < K &&
          (best < 0 || load[size_t(r)] < load[size_t(best)]))
        best = r;
    l.owned[size_t(best)].push_back(c);
    load[size_t(best)] += work[size_t(c)];
  }
  // Refinement: the heaviest rank re-partitions with a partner while that lowers the pair's
  // maximum below the heaviest load; each step lowers the sorted load vector, so it ends.
  for (int iter = 0; iter < 64 * P; ++iter) {
    const int h = int(std::max_element(load.begin(), load.end()) - load.begin());
    bool improved = false;
    for (int p = 0; p < P && !improved; ++p) {
      if (p == h) continue;
      improved = repartition(l.owned[size_t(h)], l.owned[size_t(p)], work);
      if (improved) {
        load[size_t(h)] = sum_of(l.owned[size_t(h)], work);
        load[size_t(p)] = sum_of(l.owned[size_t(p)], work);
      }
    }
    if (!improved) break;
  }
  for (auto& ids : l.owned) std::sort(ids.begin(), ids.end());
  l.check();
  return l;
}

std::vector<int64_t> chunk_work(const TiledMask& mask, int64_t chunk, int64_t Hq, int64_t Hk,
                                int64_t tile_q) {
  TESSEL_CHECK(chunk >= 1 && tile_q >= 1, "chunk ", chunk, " tile_q ", tile_q);
  const int64_t S = mask.mask().rows();
  std::vector<int64_t> work;
  for (int64_t r0 = 0; r0 < S; r0 += chunk) {
    const TileCounts t = count_tiles(mask, Hq, Hk, tile_q, r0, std::min(S, r0 + chunk));
    work.push_back(t.partial + t.unmasked);
  }
  return work;
}

std::vector<int64_t> rank_work(const CpLayout& layout, const std::vector<int64_t>& work) {
  std::vector<int64_t> w;
  for (const auto& ids : layout.owned) w.push_back(sum_of(ids, work));
  return w;
}

double imbalance(const CpLayout& layout, const std::vector<int64_t>& work) {
  const std::vector<int64_t> w = rank_work(layout, work);
  const double total = double(std::accumulate(w.begin(), w.end(), int64_t(0)));
  if (total == 0) return 1.0;
  return double(*std::max_element(w.begin(), w.end())) / (total / double(w.size()));
}

void add_chunk_rows(float* x, const float* rows, int64_t B, int64_t width, const CpLayout& layout,
                    const std::vector<int64_t>& chunks) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c : chunks) {
      const int64_t n = layout.chunk_rows(c) * width;
      float* dst = x + (b * layout.seq + layout.chunk_begin(c)) * width;
      for (int64_t i = 0; i < n; ++i) dst[i] += rows[i];
      rows += n;
    }
}

}  // namespace tessel::attention
