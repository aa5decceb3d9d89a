#pragma once
// Durable file writes. A reader either sees the old file or the whole new one, and
// after these return the bytes survive a machine crash: data is fsync'ed before the
// rename, and the directory after it.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessel {

// Writes `bytes` to `path` through `path.tmp.<pid>`, fsync, rename, directory fsync.
// Failures are InputErrors naming the path.
void write_file_atomically(const std::string& path, std::string_view bytes);

// Writes each of `files` (path, bytes) as write_file_atomically does, all or none as far as can
// be known in advance: a path that is a directory (which no rename replaces) is refused before
// any file is written, and every temporary is written before the first rename. A rename that
// still fails leaves the files renamed before it replaced (and no temporary behind).
void write_files_atomically(const std::vector<std::pair<std::string, std::string>>& files);

// fsync of an existing file or directory (a directory: its entries, e.g. after a rename).
void fsync_path(const std::string& path);

// The file whose temporary a file called `name` is (`<file>.tmp.<pid>`, as
// write_file_atomically names them): `<file>`; nullopt for any other name.
std::optional<std::string> temporary_file_target(const std::string& name);

// Removes the files `<name>.tmp.<pid>` that write_file_atomically leaves in `dir` when
// its process dies between the write and the rename.
void remove_temporary_files(const std::string& dir);

// CRC-32 (zlib) of a file's bytes; InputError naming it if it cannot be read.
uint32_t file_crc32(const std::string& path);

}  // namespace tessel
