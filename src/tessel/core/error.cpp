#include "tessel/core/error.hpp"

namespace tessel::detail {

void throw_check_failure(const char* file, int line, const char* expr, const std::string& message) {
  std::string what = concat(file, ":", line, ": check failed: ", expr);
  if (!message.empty()) what += concat(": ", message);
  throw Error(what);
}

}  // namespace tessel::detail
