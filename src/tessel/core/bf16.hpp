#pragma once
// bfloat16 storage: the upper 16 bits of an IEEE float32. Conversion from f32
// rounds to nearest even; NaN stays NaN (quiet).
#include <bit>
#include <cstdint>

namespace tessel {

inline uint16_t f32_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

inline float bf16_to_f32(uint16_t b) {
  return std::bit_cast<float>(uint32_t(b) << 16);
}

}  // namespace tessel
