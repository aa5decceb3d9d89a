#pragma once
// Tensor: a shape, a dtype and a view into shared, 64-byte aligned storage.
// Tensors are always contiguous row-major; a view is a contiguous sub-range of
// another tensor's storage (a slice along the first dimension, or a reshape).
// Kernels take raw pointers (tensor.f32() etc.); Tensor owns and describes memory.
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace tessel {

enum class DType : uint8_t { f32, bf16, i32 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "f32", "bf16", "i32"

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// Aligned, zero-initialized byte buffer shared by a tensor and its views.
class Storage {
 public:
  static constexpr size_t kAlignment = 64;
  explicit Storage(size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  std::byte* data() { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  std::byte* data_;
  size_t bytes_;
};

class Tensor {
 public:
  Tensor() = default;
  // A new zero-filled tensor.
  Tensor(Shape shape, DType dtype = DType::f32);
  static Tensor zeros(Shape shape, DType dtype = DType::f32) {
    return Tensor(std::move(shape), dtype);
  }

  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return int(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype_); }
  bool defined() const { return storage_ != nullptr; }

  void* raw() { return storage_->data() + offset_bytes_; }
  const void* raw() const { return storage_->data() + offset_bytes_; }
  // Typed access; checks the dtype.
  float* f32();
  const float* f32() const;
  uint16_t* bf16();
  const uint16_t* bf16() const;
  int32_t* i32();
  const int32_t* i32() const;

  // View of rows [begin, end) along dimension 0.
  Tensor slice(int64_t begin, int64_t end) const;
  // View with another shape of the same element count.
  Tensor reshape(Shape shape) const;
  // View of `shape` elements starting at element `offset` (flat).
  Tensor view(int64_t offset, Shape shape) const;
  // New tensor converted to `dtype` (f32 <-> bf16 rounds to nearest even; i32 <-> f32 casts).
  Tensor to(DType dtype) const;
  // New tensor with a copy of the data.
  Tensor clone() const;
  void fill_zero();
  // True when both tensors view the same storage.
  bool shares_storage(const Tensor& other) const { return storage_ == other.storage_; }

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace tessel
