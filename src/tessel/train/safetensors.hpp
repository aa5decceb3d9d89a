#pragma once
// safetensors files: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F32"|"BF16"|"I32", "shape": [...], "data_offsets": [b, e]},
//  "__metadata__": {"key": "value"}}, then the raw tensor bytes back to back.
// Readable by the `safetensors` Python package, PyTorch and numpy.
#include <map>
#include <string>
#include <vector>

#include "tessel/core/tensor.hpp"

namespace tessel::train {

struct NamedTensor {
  std::string name;
  Tensor tensor;
};

// Writes `tensors` in the given order to `path` (overwrites). With `crc32`, also returns
// the CRC-32 (zlib) of the file's bytes, computed while writing.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       uint32_t* crc32 = nullptr);

struct SafetensorsFile {
  std::vector<NamedTensor> tensors;  // in file order
  std::map<std::string, std::string> metadata;
  const Tensor* find(const std::string& name) const;
};
// Reads and validates `path`; every defect is an InputError naming the file.
SafetensorsFile read_safetensors(const std::string& path);
// The "__metadata__" of `path`, reading and validating only its header (InputErrors as above).
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

}  // namespace tessel::train
