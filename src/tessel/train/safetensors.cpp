#include "tessel/train/safetensors.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessel/core/error.hpp"

namespace tessel::train {

namespace {

const char* st_dtype(DType d) {
  switch (d) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
  }
  return "?";
}

DType from_st_dtype(const std::string& path, const std::string& name, const std::string& d) {
  if (d == "F32") return DType::f32;
  if (d == "BF16") return DType::bf16;
  if (d == "I32") return DType::i32;
  input_error(path, ": tensor '", name, "' has unsupported dtype '", d, "'");
}

// The JSON header of the safetensors file `path`, open in `in`; `file_size` and `header_bytes`
// (its length) are set for reading the data after it.
nlohmann::ordered_json read_header(const std::string& path, std::ifstream& in, uint64_t& file_size,
                                   uint64_t& header_bytes) {
  if (!in) input_error(path, ": cannot open checkpoint file");
  in.seekg(0, std::ios::end);
  file_size = uint64_t(in.tellg());
  in.seekg(0);
  if (file_size < 8) input_error(path, ": not a safetensors file (", file_size, " bytes)");
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n > file_size - 8)
    input_error(path, ": corrupt safetensors header (length ", n, " beyond file size ", file_size,
                ")");
  std::string text(n, '\0');
  in.read(text.data(), std::streamsize(n));
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    input_error(path, ": corrupt safetensors header (", e.what(), ")");
  }
  if (!header.is_object()) input_error(path, ": corrupt safetensors header (not an object)");
  header_bytes = n;
  return header;
}

// Its "__metadata__" (string values only, as the format has them).
std::map<std::string, std::string> header_metadata(const std::string& path,
                                                   const nlohmann::ordered_json& header) {
  std::map<std::string, std::string> metadata;
  if (!header.contains("__metadata__")) return metadata;
  try {
    for (const auto& [k, v] : header.at("__metadata__").items()) metadata[k] = v.get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    input_error(path, ": corrupt safetensors header (", e.what(), ")");
  }
  return metadata;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata, uint32_t* crc32) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // "{}" when empty
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TESSEL_CHECK(name != "__metadata__" && !header.contains(name), "bad tensor name ", name);
    header[name] = {{"dtype", st_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.bytes()}}};
    offset += t.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) input_error(path, ": cannot open for writing");
  uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (n >> (8 * i)) & 0xff;
  uLong crc = ::crc32(0L, Z_NULL, 0);
  auto put = [&](const void* data, size_t bytes) {
    out.write(static_cast<const char*>(data), std::streamsize(bytes));
    if (!crc32) return;
    // zlib takes uInt lengths: feed large tensors in pieces.
    for (size_t at = 0; at < bytes; at += size_t(1) << 30)
      crc = ::crc32(crc, static_cast<const Bytef*>(data) + at,
                    uInt(std::min(bytes - at, size_t(1) << 30)));
  };
  put(len, 8);
  put(text.data(), text.size());
  for (const auto& nt : tensors) put(nt.tensor.raw(), nt.tensor.bytes());
  out.flush();
  if (!out) input_error(path, ": write failed (disk full?)");
  if (crc32) *crc32 = uint32_t(crc);
}

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& nt : tensors)
    if (nt.name == name) return &nt.tensor;
  return nullptr;
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t file_size = 0, n = 0;
  return header_metadata(path, read_header(path, in, file_size, n));
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t file_size = 0, n = 0;
  const nlohmann::ordered_json header = read_header(path, in, file_size, n);
  uint64_t data_size = file_size - 8 - n;
  SafetensorsFile file;
  file.metadata = header_metadata(path, header);
  try {
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") continue;
      DType dtype = from_st_dtype(path, name, entry.at("dtype").get<std::string>());
      Shape shape = entry.at("shape").get<Shape>();
      auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      Tensor t(shape, dtype);
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size ||
          offsets[1] - offsets[0] != t.bytes())
        input_error(path, ": tensor '", name, "' has data offsets that do not match its shape ",
                    shape_str(shape), " or lie outside the file");
      in.seekg(std::streamoff(8 + n + offsets[0]));
      in.read(static_cast<char*>(t.raw()), std::streamsize(t.bytes()));
      if (!in) input_error(path, ": truncated while reading tensor '", name, "'");
      file.tensors.push_back({name, std::move(t)});
    }
  } catch (const nlohmann::json::exception& e) {
    input_error(path, ": corrupt safetensors header (", e.what(), ")");
  }
  return file;
}

}  // namespace tessel::train
