#pragma once
// Seeded, platform-independent random numbers (std distributions are not
// specified bit-exactly, so tessel draws its own). The generator is xoshiro256**
// seeded through splitmix64; its whole state can be saved and restored.
#include <array>
#include <cstdint>

namespace tessel {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next_u64();
  // Uniform in [0, 1) with 24 random bits.
  float uniform();
  // Uniform integer in [0, n) without modulo bias.
  uint64_t below(uint64_t n);
  // Standard normal by Box-Muller (uses two uniforms per pair, caches none: simple and exact to
  // replay).
  float normal();
  // Fills x[0..n) with normal(mean, stddev).
  void fill_normal(float* x, int64_t n, float mean, float stddev);
  void fill_uniform(float* x, int64_t n, float lo, float hi);

  using State = std::array<uint64_t, 4>;

 private:
  State s_;
};

}  // namespace tessel
