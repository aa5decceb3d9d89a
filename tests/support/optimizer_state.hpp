#pragma once
// An optimizer's checkpoint state as bytes, and restoring it, for resume tests: what a
// checkpoint saves and loads back in place (optim/optimizer.hpp), without the files.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tessel/optim/optimizer.hpp"

namespace tessel::fixture {

// Every state tensor's bytes, in state() order (of sharded state, this rank's rows).
inline std::vector<std::vector<uint8_t>> state_bytes(optim::Optimizer& opt) {
  std::vector<std::vector<uint8_t>> out;
  for (const optim::StateTensor& s : opt.state()) {
    const auto* p = static_cast<const uint8_t*>(s.tensor.raw());
    out.emplace_back(p, p + s.tensor.bytes());
  }
  return out;
}

// Writes `saved` (state_bytes of an optimizer over the same parameters) into `opt`'s state.
inline void load_state_bytes(optim::Optimizer& opt,
                             const std::vector<std::vector<uint8_t>>& saved) {
  auto st = opt.state();
  ASSERT_EQ(st.size(), saved.size());
  for (size_t i = 0; i < st.size(); ++i) {
    ASSERT_EQ(st[i].tensor.bytes(), saved[i].size()) << st[i].name;
    std::memcpy(st[i].tensor.raw(), saved[i].data(), saved[i].size());
  }
}

}  // namespace tessel::fixture
