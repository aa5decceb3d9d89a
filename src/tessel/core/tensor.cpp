#include "tessel/core/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "tessel/core/bf16.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/memory.hpp"

namespace tessel {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
  }
  TESSEL_CHECK(false, "unknown dtype");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
  }
  TESSEL_CHECK(false, "unknown dtype");
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    TESSEL_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Storage::Storage(size_t bytes) : bytes_(bytes) {
  retain_freed_memory();
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  data_ = static_cast<std::byte*>(std::aligned_alloc(kAlignment, rounded ? rounded : kAlignment));
  TESSEL_CHECK(data_ != nullptr, "out of memory allocating ", bytes, " bytes");
  std::memset(data_, 0, rounded);
}

Storage::~Storage() {
  std::free(data_);
}

Tensor::Tensor(Shape shape, DType dtype) : shape_(std::move(shape)), dtype_(dtype) {
  storage_ = std::make_shared<Storage>(bytes());
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  TESSEL_CHECK(i >= 0 && i < n, "dimension ", i, " out of range for shape ", shape_str(shape_));
  return shape_[i];
}

float* Tensor::f32() {
  TESSEL_CHECK(dtype_ == DType::f32, "tensor is ", dtype_name(dtype_), ", not f32");
  return static_cast<float*>(raw());
}
const float* Tensor::f32() const {
  return const_cast<Tensor*>(this)->f32();
}
uint16_t* Tensor::bf16() {
  TESSEL_CHECK(dtype_ == DType::bf16, "tensor is ", dtype_name(dtype_), ", not bf16");
  return static_cast<uint16_t*>(raw());
}
const uint16_t* Tensor::bf16() const {
  return const_cast<Tensor*>(this)->bf16();
}
int32_t* Tensor::i32() {
  TESSEL_CHECK(dtype_ == DType::i32, "tensor is ", dtype_name(dtype_), ", not i32");
  return static_cast<int32_t*>(raw());
}
const int32_t* Tensor::i32() const {
  return const_cast<Tensor*>(this)->i32();
}

Tensor Tensor::view(int64_t offset, Shape shape) const {
  TESSEL_CHECK(defined(), "view of an undefined tensor");
  int64_t n = shape_numel(shape);
  TESSEL_CHECK(offset >= 0 && offset + n <= numel(), "view [", offset, ", ", offset + n,
               ") outside tensor of ", numel(), " elements");
  Tensor t;
  t.storage_ = storage_;
  t.offset_bytes_ = offset_bytes_ + size_t(offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype_;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  TESSEL_CHECK(ndim() >= 1, "slice of a scalar tensor");
  TESSEL_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
               ") outside dimension 0 of ", shape_str(shape_));
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  Shape s = shape_;
  s[0] = end - begin;
  return view(begin * row, std::move(s));
}

Tensor Tensor::reshape(Shape shape) const {
  TESSEL_CHECK(shape_numel(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ",
               shape_str(shape));
  return view(0, std::move(shape));
}

Tensor Tensor::clone() const {
  Tensor t(shape_, dtype_);
  std::memcpy(t.raw(), raw(), bytes());
  return t;
}

void Tensor::fill_zero() {
  std::memset(raw(), 0, bytes());
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  Tensor t(shape_, dtype);
  int64_t n = numel();
  if (dtype_ == DType::f32 && dtype == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) t.bf16()[i] = f32_to_bf16(f32()[i]);
  } else if (dtype_ == DType::bf16 && dtype == DType::f32) {
    for (int64_t i = 0; i < n; ++i) t.f32()[i] = bf16_to_f32(bf16()[i]);
  } else if (dtype_ == DType::i32 && dtype == DType::f32) {
    for (int64_t i = 0; i < n; ++i) t.f32()[i] = float(i32()[i]);
  } else if (dtype_ == DType::f32 && dtype == DType::i32) {
    for (int64_t i = 0; i < n; ++i) t.i32()[i] = int32_t(f32()[i]);
  } else {
    TESSEL_CHECK(false, "no conversion from ", dtype_name(dtype_), " to ", dtype_name(dtype));
  }
  return t;
}

}  // namespace tessel
