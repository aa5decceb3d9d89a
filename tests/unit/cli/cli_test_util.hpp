#pragma once
// Running the real `tessel` binary from the CLI tests.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "support/train_fixture.hpp"

namespace tessel::cli_test {

struct Outcome {
  int exit_code;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs `tessel <args>` in a shell with stdout and stderr captured; with ranks > 0, on that
// many MPI ranks through scripts/launch.sh.
inline Outcome run_tessel(const std::string& args, int ranks = 0) {
  std::string dir = fixture::temp_dir("tessel-cli");
  std::string launcher = ranks > 0 ? "TESSEL_BIN=" + std::string(TESSEL_BINARY) +
                                         " OMPI_ALLOW_RUN_AS_ROOT=1 "
                                         "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " TESSEL_LAUNCHER " " +
                                         std::to_string(ranks)
                                   : std::string(TESSEL_BINARY);
  std::string cmd = launcher + " " + args + " >" + dir + "/out 2>" + dir + "/err";
  int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir + "/out"), slurp(dir + "/err")};
}

}  // namespace tessel::cli_test
