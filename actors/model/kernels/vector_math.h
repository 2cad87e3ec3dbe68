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

}  // namespace specserve_kernels
