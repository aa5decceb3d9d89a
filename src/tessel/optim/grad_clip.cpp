#include "tessel/optim/grad_clip.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/core/error.hpp"

namespace tessel::optim {

namespace {
// Chunk size of the fixed-order sum: a chunk is one vectorizable loop; chunk sums are
// added serially, so the order never depends on the thread count.
constexpr int64_t kChunk = 4096;
// Below this many elements a parallel region costs more than the loop.
constexpr int64_t kParallelMin = int64_t(1) << 15;
}  // namespace

double sum_squares(const float* x, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c * kChunk; i < end; ++i) s += double(x[i]) * double(x[i]);
    partial[size_t(c)] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

double grad_sum_squares(const ParameterList& params) {
  double total = 0.0;
  for (const Parameter& p : params) total += sum_squares(p.grad.f32(), p.grad.numel());
  return total;
}

double global_grad_norm(const ParameterList& params, comm::Communicator* shard_group) {
  double total = grad_sum_squares(params);
  if (shard_group != nullptr)
    shard_group->all_reduce(&total, 1, comm::ElemType::f64, comm::ReduceOp::sum);
  return std::sqrt(total);
}

double clip_grad_norm(ParameterList& params, double max_norm, comm::Communicator* shard_group) {
  const double norm = global_grad_norm(params, shard_group);
  scale_to_max_norm(params, norm, max_norm);
  return norm;
}

void scale_to_max_norm(ParameterList& params, double norm, double max_norm) {
  if (max_norm <= 0 || !std::isfinite(norm)) return;
  const double scale = max_norm / (norm + 1e-6);
  if (scale >= 1.0) return;  // within bounds: leave the gradients bitwise untouched
  const float s = float(scale);
  for (Parameter& p : params) {
    float* g = p.grad.f32();
    const int64_t n = p.grad.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) g[i] *= s;
  }
}

void check_finite_grad_norm(double norm, const std::string& where, const std::string& hint) {
  if (std::isfinite(norm)) return;
  throw DivergenceError(where + "'s gradient norm is " + (std::isnan(norm) ? "NaN" : "inf") +
                        "; stopping before the update" + hint);
}

namespace naive {
double global_grad_norm(const ParameterList& params) {
  double s = 0;
  for (const Parameter& p : params) {
    const float* g = p.grad.f32();
    for (int64_t i = 0; i < p.grad.numel(); ++i) s += double(g[i]) * double(g[i]);
  }
  return std::sqrt(s);
}
}  // namespace naive

}  // namespace tessel::optim
