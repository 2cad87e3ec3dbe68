// Small math written so that the compiler vectorizes the loops calling it (with -fno-trapping-math).
#pragma once

#include <cmath>
#include <cstdint>

namespace specserve_kernels {

// e^x within a couple of float32 ulps (Cephes' expf: x = n ln2 + r, a polynomial in r, times 2^n),
// x clamped to [-87, 88]: below, about 1e-38 instead of 0; above, about 1.6e38 instead of infinity.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float whole = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - whole * 0.693359375f + whole * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(whole) + 127) << 23);
}

// bfloat16 <-> float32 on the raw bits, written so loops over them vectorize (c10's conversions are
// calls the compiler keeps scalar). Rounding is c10's: to nearest even, any NaN to 0x7FC0.
inline float from_bfloat16_bits(uint16_t bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16); }

inline uint16_t to_bfloat16_bits(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return x != x ? static_cast<uint16_t>(0x7FC0) : rounded;
}

}  // namespace specserve_kernels
