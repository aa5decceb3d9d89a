#include "tessel/kernels/cpu/embedding.hpp"

#include "tessel/kernels/cpu/embedding_ids.hpp"

namespace tessel::kernels::naive {

template <class T>
void embedding_forward(T* y, const int32_t* ids, const T* table, int64_t N, int64_t V, int64_t C) {
  detail::check_embedding_ids(ids, N, V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j) y[n * C + j] = table[ids[n] * C + j];
}

template <class T>
void embedding_backward(T* dtable, const T* dy, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C) {
  detail::check_embedding_ids(ids, N, V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j) dtable[ids[n] * C + j] += dy[n * C + j];
}

#define TESSEL_INSTANTIATE(T)                                                                  \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t); \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
