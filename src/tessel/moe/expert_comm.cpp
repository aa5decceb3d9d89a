#include "tessel/moe/expert_comm.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::moe {

void LocalExpertComm::exchange_counts(const int64_t* send, int64_t* recv, size_t n) {
  std::copy(send, send + n, recv);
}

void LocalExpertComm::exchange_rows(const float* send, std::span<const size_t> send_counts,
                                    float* recv, std::span<const size_t> recv_counts) {
  TESSEL_CHECK(
      send_counts.size() == 1 && recv_counts.size() == 1 && send_counts[0] == recv_counts[0],
      "a local exchange sends to itself only");
  std::copy(send, send + send_counts[0], recv);
}

}  // namespace tessel::moe
