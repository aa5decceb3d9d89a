#pragma once
// Softmax cross-entropy over a loss mask. logits [N, V], targets [N] in [0, V),
// weight [N] (0 = token not in the loss, usually 0/1).
//   forward: lse [N] saved; returns sum_n weight[n] * (lse[n] - logits[n, targets[n]])
//            (the caller divides by the global count of loss tokens)
//   backward: dlogits[n, :] += scale * weight[n] * (softmax(logits[n]) - onehot(targets[n]))
// Tokens with weight 0 do not read their target (it may be any value, e.g. -1).
#include <cstdint>

namespace tessel::kernels {

double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets,
                             const float* weight, int64_t N, int64_t V);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* weight, float scale, int64_t N,
                            int64_t V);

namespace naive {
template <class T>
double cross_entropy_forward(T* lse, const T* logits, const int32_t* targets, const T* weight,
                             int64_t N, int64_t V);
template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            const T* weight, T scale, int64_t N, int64_t V);
}  // namespace naive

}  // namespace tessel::kernels
