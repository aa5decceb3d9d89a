#pragma once
// The check every bad-input test makes: `f()` throws tessel::InputError, as one line,
// whose message contains each of `parts` (the file or field it must name).
#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "tessel/core/error.hpp"

namespace tessel::fixture {

inline void expect_input_error(const std::function<void()>& f,
                               std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no InputError thrown";
  } catch (const InputError& e) {
    const std::string what = e.what();
    for (const auto& part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' not in: " << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << "error spans several lines: " << what;
  }
}

}  // namespace tessel::fixture
