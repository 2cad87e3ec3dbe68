// Reading and writing a tensor element as float32, for every dtype the kernels take. The kernels
// take bfloat16 as its raw bits (uint16_t, converted in vector_math.h): loops over c10::BFloat16
// do not vectorize. The results are c10's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "vector_math.h"

namespace specserve_kernels {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bfloat16_bits) { return from_bfloat16_bits(bfloat16_bits); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

inline void put(float* at, float x) { *at = x; }
inline void put(uint16_t* at, float x) { *at = to_bfloat16_bits(x); }
inline void put(c10::Half* at, float x) { *at = static_cast<c10::Half>(x); }

// Calls `run` with a value of the kernels' element type for `type` (float, bfloat16's bits as
// uint16_t, c10::Half), so each kernel instantiates its template once per dtype in one place.
template <typename Run>
void with_element_type(at::ScalarType type, Run&& run) {
  switch (type) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(uint16_t{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16 only");
  }
}

// A tensor's elements as T (uint16_t for bfloat16).
template <typename T>
T* elements(const at::Tensor& tensor) {
  return static_cast<T*>(tensor.data_ptr());
}

}  // namespace specserve_kernels
