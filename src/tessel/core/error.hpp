#pragma once
// Errors. Three kinds, each with its exit status:
//  - tessel::Error: an internal invariant broke (a bug); TESSEL_CHECK names file and line.
//  - tessel::InputError: the user gave bad input (file, config field, world size);
//    the message names the file or field and the expected value.
//  - tessel::DivergenceError: training produced a non-finite gradient norm, validation loss
//    or MoE router logits (a model's non-finite output, in generate and eval). A resume from
//    the last checkpoint would repeat it bit for bit, so `tessel run` does not relaunch.
// The CLI prints the message as one line and exits with the kind's status.
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

class DivergenceError : public Error {
 public:
  using Error::Error;
};

// Exit statuses of the `tessel` executable (1: an internal error, an Error).
inline constexpr int kExitInputError = 2;
inline constexpr int kExitTtrOverBound = 3;  // ett-report / run: a failure's TTR over --max-ttr
inline constexpr int kExitDiverged = 4;

// The exit status for a failure that ends the process: kExitInputError for an InputError,
// kExitDiverged for a DivergenceError, else 1.
inline int exit_status(const std::exception& e) {
  if (dynamic_cast<const InputError*>(&e)) return kExitInputError;
  if (dynamic_cast<const DivergenceError*>(&e)) return kExitDiverged;
  return 1;
}

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

// InputError "<field> = <value> is outside the float range <who> computes in (...)" when the
// positive, finite `value` is 0 or inf as a float, the type the f32 code that takes it holds.
void check_positive_float_range(const std::string& field, double value, const char* who);

}  // namespace tessel

// TESSEL_CHECK(cond, "message", value, ...): throws tessel::Error naming file and line.
#define TESSEL_CHECK(cond, ...)                                                                \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::tessel::detail::throw_check_failure(                                                   \
          __FILE__, __LINE__, #cond, ::tessel::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
