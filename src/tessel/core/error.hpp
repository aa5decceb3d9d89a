#pragma once
// Errors. Two kinds:
//  - tessel::Error: an internal invariant broke (a bug); TESSEL_CHECK names file and line.
//  - tessel::InputError: the user gave bad input (file, config field, world size);
//    the message names the file or field and the expected value. The CLI prints it
//    as one line and exits non-zero.
#include <sstream>
#include <stdexcept>
#include <string>

namespace tessel {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InputError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_check_failure(const char* file, int line, const char* expr,
                                      const std::string& message);
}  // namespace detail

// Throws InputError with the streamed arguments as message.
template <class... Args>
[[noreturn]] void input_error(const Args&... args) {
  throw InputError(detail::concat(args...));
}

}  // namespace tessel

// TESSEL_CHECK(cond, "message", value, ...): throws tessel::Error naming file and line.
#define TESSEL_CHECK(cond, ...)                                                                \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::tessel::detail::throw_check_failure(                                                   \
          __FILE__, __LINE__, #cond, ::tessel::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
