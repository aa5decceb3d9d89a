#include "tessel/core/file_io.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "tessel/core/error.hpp"

namespace tessel {

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) input_error(path, ": cannot open to sync: ", std::strerror(errno));
  bool ok = ::fsync(fd) == 0;
  int saved = errno;
  ::close(fd);
  if (!ok) input_error(path, ": fsync failed: ", std::strerror(saved));
}

namespace {

// Writes `bytes` to `path`'s temporary, synced; returns the temporary's name.
std::string write_temporary(const std::string& path, std::string_view bytes) {
  const std::string tmp = detail::concat(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) input_error(path, ": cannot create ", tmp, ": ", std::strerror(errno));
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) {
    std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    input_error(path, ": cannot write: ", reason);
  }
  return tmp;
}

// Renames the temporary `tmp` onto `path` and syncs the directory.
void commit(const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    input_error(path, ": cannot write: ", reason);
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  fsync_path(dir.empty() ? "." : dir.string());
}

}  // namespace

void write_file_atomically(const std::string& path, std::string_view bytes) {
  commit(write_temporary(path, bytes), path);
}

void write_files_atomically(const std::vector<std::pair<std::string, std::string>>& files) {
  for (const auto& [path, bytes] : files)
    if (std::filesystem::is_directory(path))
      input_error(path, ": is a directory, where a file is to be written (nothing was written)");
  std::vector<std::string> temporaries;
  try {
    for (const auto& [path, bytes] : files) temporaries.push_back(write_temporary(path, bytes));
  } catch (const InputError&) {
    for (const auto& tmp : temporaries) std::remove(tmp.c_str());
    throw;
  }
  for (size_t i = 0; i < files.size(); ++i) try {
      commit(temporaries[i], files[i].first);
    } catch (const InputError&) {  // the later temporaries are not left behind
      for (size_t j = i + 1; j < files.size(); ++j) std::remove(temporaries[j].c_str());
      throw;
    }
}

std::optional<std::string> temporary_file_target(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos || at + 5 == name.size() ||
      name.find_first_not_of("0123456789", at + 5) != std::string::npos)
    return std::nullopt;
  return name.substr(0, at);
}

void remove_temporary_files(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) return;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && temporary_file_target(e.path().filename().string()))
      fs::remove(e.path());
}

uint32_t file_crc32(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) input_error(path, ": not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) input_error(path, ": cannot open");
  std::vector<char> buf(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    std::streamsize got = in.gcount();
    if (got > 0) crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), uInt(got));
  }
  if (in.bad()) input_error(path, ": read failed");
  return uint32_t(crc);
}

}  // namespace tessel
