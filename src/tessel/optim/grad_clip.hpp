#pragma once
// Global-norm gradient clipping over a parameter list.
//
// The norm is sqrt of the sum of squares of every gradient element, accumulated in double
// in a fixed order (parameters in list order; within one, fixed-size chunks summed in
// chunk order), so it is bitwise independent of the thread count. When gradients are
// sharded (ZeRO-1: each rank holds a slice of every gradient), pass the group that shares
// them: the local sums are all-reduced, and the result is the norm of the concatenation.
// With replicated gradients pass nullptr.
#include <cstdint>
#include <string>

#include "tessel/comm/communicator.hpp"
#include "tessel/core/parameter.hpp"

namespace tessel::optim {

// Sum of x[i]^2 over x [n], in double, in the fixed chunk order above.
double sum_squares(const float* x, int64_t n);

// Sum over params, in list order, of sum_squares(grad).
double grad_sum_squares(const ParameterList& params);

// sqrt(grad_sum_squares(params)), the sum taken over `shard_group` when given.
double global_grad_norm(const ParameterList& params, comm::Communicator* shard_group = nullptr);

// Scales every gradient by min(1, max_norm / (norm + 1e-6)) and returns the pre-clip norm.
// max_norm <= 0 disables clipping (the norm is still returned). A non-finite norm leaves
// the gradients unscaled; the caller decides whether to skip the step.
double clip_grad_norm(ParameterList& params, double max_norm,
                      comm::Communicator* shard_group = nullptr);
// Throws DivergenceError ("<where>'s gradient norm is NaN|inf; stopping before the update<hint>")
// unless `norm` is finite.
void check_finite_grad_norm(double norm, const std::string& where, const std::string& hint);
// The scaling half of clip_grad_norm, for a norm computed elsewhere (pipeline stages sum
// theirs over the pp group; expert-sharded gradients, parallel/expert_sharding.hpp).
void scale_to_max_norm(ParameterList& params, double norm, double max_norm);

namespace naive {
// sqrt of the sequential double sum over every gradient element, in list order (one process).
double global_grad_norm(const ParameterList& params);
}  // namespace naive

}  // namespace tessel::optim
