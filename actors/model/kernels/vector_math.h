// Small math written so that the compiler vectorizes the loops calling it (with -fno-trapping-math).
#pragma once

#include <cmath>
#include <cstdint>

namespace specserve_kernels {

namespace exp_constants {  // Cephes' expf, shared with the kernels' 16-lane exp
inline constexpr float kLowest = -87.0f, kHighest = 88.0f;
inline constexpr float kLog2E = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
inline constexpr float kPolynomial[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

// e^x within a couple of float32 ulps (Cephes' expf: x = n ln2 + r, a polynomial in r, times 2^n),
// x clamped to [-87, 88]: below, about 1e-38 instead of 0; above, about 1.6e38 instead of infinity.
inline float exp_approx(float x) {
  namespace k = exp_constants;
  x = x < k::kLowest ? k::kLowest : (x > k::kHighest ? k::kHighest : x);
  const float whole = std::floor(x * k::kLog2E + 0.5f);
  const float r = x - whole * k::kLn2High + whole * k::kLn2Low;
  float p = k::kPolynomial[0];
  for (int i = 1; i < 6; ++i) p = p * r + k::kPolynomial[i];
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
