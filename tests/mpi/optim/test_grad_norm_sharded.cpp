// Global gradient norm over sharded gradients (ZeRO-1 layout) on 2 and 4 ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessel/comm/world.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/optim/grad_clip.hpp"

using namespace tessel;
using namespace tessel::optim;

namespace {

// The full (unsharded) gradients, the same on every rank: one flat buffer, parameter views.
struct Full {
  Tensor grads;
  ParameterList params;
  explicit Full(uint64_t seed) {
    const std::vector<int64_t> sizes = {1, 3, 0, 4097, 10007, 65541, 2};
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    grads = Tensor({total});
    Rng rng(seed);
    rng.fill_normal(grads.f32(), total, 0.0f, 1.0f);
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor g = grads.view(offset, {sizes[i]});
      params.push_back(
          {std::string("p").append(std::to_string(i)), ParamTag::hidden_matrix, g.clone(), g});
      offset += sizes[i];
    }
  }
};

// Rank r's share of [0, n) out of p: [n*r/p, n*(r+1)/p) (empty for small n).
std::pair<int64_t, int64_t> share(int64_t n, int r, int p) {
  return {n * r / p, n * (r + 1) / p};
}

// Each rank keeps its share of every parameter (per-parameter sharding).
ParameterList shard_each(const ParameterList& full, int r, int p) {
  ParameterList out;
  for (const Parameter& q : full) {
    auto [lo, hi] = share(q.grad.numel(), r, p);
    out.push_back({q.name, q.tag, q.value.view(lo, {hi - lo}), q.grad.view(lo, {hi - lo})});
  }
  return out;
}

// Each rank keeps its share of the flat buffer: the pieces of the parameters it overlaps.
ParameterList shard_flat(const Full& full, int r, int p) {
  auto [lo, hi] = share(full.grads.numel(), r, p);
  ParameterList out;
  int64_t offset = 0;
  for (const Parameter& q : full.params) {
    int64_t n = q.grad.numel();
    int64_t a = std::max(lo, offset), b = std::min(hi, offset + n);
    if (a < b) {
      out.push_back(
          {q.name, q.tag, q.value.view(a - offset, {b - a}), q.grad.view(a - offset, {b - a})});
    }
    offset += n;
  }
  return out;
}

// The norm is all-reduced, so every rank must hold bitwise the same value.
void expect_same_on_all_ranks(double x) {
  double lo = x, hi = x;
  comm::world().all_reduce(&lo, 1, comm::ElemType::f64, comm::ReduceOp::min);
  comm::world().all_reduce(&hi, 1, comm::ElemType::f64, comm::ReduceOp::max);
  EXPECT_EQ(lo, hi);
}

}  // namespace

// Sharded norm = single-process naive norm of the concatenation, rel 1e-12 (double sums of
// exact f32 squares; only the summation order differs).
TEST(GradNormSharded, EqualsSingleProcessNorm) {
  const int r = comm::world().rank(), p = comm::world().size();
  Full full(42);
  const double ref = naive::global_grad_norm(full.params);
  ASSERT_GT(ref, 0.0);
  for (const ParameterList& shards : {shard_each(full.params, r, p), shard_flat(full, r, p)}) {
    const double norm = global_grad_norm(shards, &comm::world());
    EXPECT_NEAR(norm, ref, 1e-12 * ref);
    expect_same_on_all_ranks(norm);
  }
}

// Clipping the shards scales them as clipping the full list does: by
// float(max_norm / (norm + 1e-6)), where the two norms agree to 1e-12, so each element
// matches the single-process result to 1 ulp.
TEST(GradNormSharded, ClipMatchesSingleProcess) {
  const int r = comm::world().rank(), p = comm::world().size();
  Full sharded(7), single(7);
  ParameterList shards = shard_flat(sharded, r, p);
  const double max_norm = 0.5;
  const double norm = clip_grad_norm(shards, max_norm, &comm::world());
  const double ref = clip_grad_norm(single.params, max_norm);
  EXPECT_NEAR(norm, ref, 1e-12 * ref);
  auto [lo, hi] = share(single.grads.numel(), r, p);
  const float* got = sharded.grads.f32();
  const float* want = single.grads.f32();
  for (int64_t i = lo; i < hi; ++i) {
    ASSERT_NEAR(got[i], want[i], std::abs(want[i]) * std::numeric_limits<float>::epsilon()) << i;
  }
  EXPECT_NEAR(global_grad_norm(shards, &comm::world()), max_norm, 1e-6);
}
