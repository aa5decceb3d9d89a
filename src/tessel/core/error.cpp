#include "tessel/core/error.hpp"

#include <limits>

namespace tessel {

void check_positive_float_range(const std::string& field, double value, const char* who) {
  constexpr float kMax = std::numeric_limits<float>::max();
  if (value > double(kMax) || !(float(value) > 0.0f))  // compared as doubles first: no UB
    input_error(field, " = ", value, " is outside the float range ", who, " computes in (",
                std::numeric_limits<float>::denorm_min(), " to ", kMax, ")");
}

}  // namespace tessel

namespace tessel::detail {

void throw_check_failure(const char* file, int line, const char* expr, const std::string& message) {
  std::string what = concat(file, ":", line, ": check failed: ", expr);
  if (!message.empty()) what += concat(": ", message);
  throw Error(what);
}

}  // namespace tessel::detail
