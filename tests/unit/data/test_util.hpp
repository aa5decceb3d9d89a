#pragma once
// Helpers shared by the data tests: a scratch directory, the Bible corpus loaded once per
// test binary, and a check that a call throws an InputError mentioning given text.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "support/expect_input_error.hpp"
#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"

namespace tessel::data::testing {

// A fresh directory under the system temp directory, removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("tessel_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline const std::vector<std::string>& bible_documents() {
  static const std::vector<std::string> docs = load_corpus("bible");
  return docs;
}

using fixture::expect_input_error;

}  // namespace tessel::data::testing
