// A decoder layer's elementwise steps fused, for a CPU: each reads its inputs once, computes in float32
// and rounds once, one call for every row of a pass. Each row's result depends on that row alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_io.h"

#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kLanes = 16;

using specserve_kernels::elements;
using specserve_kernels::put;
using specserve_kernels::with_element_type;
using specserve_kernels::to_float;

// hidden + delta (when given, rounded to hidden's dtype as a separate add would), and that sum's
// rows scaled by the reciprocal root of their mean square (summed in kLanes partial sums, added in
// order) and by weight.
template <typename T>
void add_rms_norm_rows(const T* hidden, const T* delta, const T* weight, T* sum, T* out, int64_t rows, int64_t width,
                       float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* x = hidden + row * width;
      T* s = sum + row * width;
      if (delta != nullptr) {
        const T* d = delta + row * width;
        for (int64_t i = 0; i < width; ++i) put(s + i, to_float(x[i]) + to_float(d[i]));
        x = s;
      }
      float partial[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes)
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          const float v = to_float(x[i + lane]);
          partial[lane] += v * v;
        }
      for (int64_t lane = 0; i < width; ++i, ++lane) {
        const float v = to_float(x[i]);
        partial[lane] += v * v;
      }
      float squares = 0.f;
      for (int64_t lane = 0; lane < kLanes; ++lane) squares += partial[lane];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* y = out + row * width;
      for (int64_t j = 0; j < width; ++j) put(y + j, to_float(x[j]) * scale * to_float(weight[j]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden [rows, width], contiguous");
  TORCH_CHECK(weight.numel() == hidden.size(1) && weight.scalar_type() == hidden.scalar_type(), "weight [width]");
  if (delta.has_value())
    TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->is_contiguous() && delta->scalar_type() == hidden.scalar_type(),
                "delta like hidden");
  at::Tensor weight_c = weight.contiguous();
  at::Tensor sum = delta.has_value() ? at::empty_like(hidden) : hidden;
  at::Tensor out = at::empty_like(hidden);
  const float e = static_cast<float>(eps);
  with_element_type(hidden.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    add_rms_norm_rows<T>(elements<T>(hidden), delta.has_value() ? elements<T>(*delta) : nullptr, elements<T>(weight_c),
                         elements<T>(sum), elements<T>(out), hidden.size(0), hidden.size(1), e);
  });
  return {sum, out};
}

// One row's silu(gate) * up. A function of its own: inlined into the loop over rows, GCC's code for
// it ran 6x slower (measured with bfloat16 rows of 1,536).
template <typename T>
__attribute__((noinline)) void silu_and_mul_row(const T* gate, const T* up, T* y, int64_t width) {
  for (int64_t i = 0; i < width; ++i) {
    const float g = to_float(gate[i]);
    put(y + i, g / (1.f + specserve_kernels::exp_approx(-g)) * to_float(up[i]));
  }
}

// gate_up [rows, 2 x width] (gate, then up) -> silu(gate) * up [rows, width]
template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      silu_and_mul_row(gate_up + row * 2 * width, gate_up + row * 2 * width + width, out + row * width, width);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up [rows, 2 x width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  with_element_type(gate_up.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_rows<T>(elements<T>(gate_up), elements<T>(out), rows, width);
  });
  return out;
}

// qkv [tokens, (heads + 2 kv_heads) x dim] (a fused projection's output): q and k rotated by cos/sin
// [tokens, dim] (half-split rotation: x * cos + (-x2, x1) * sin), k and v written to keys/values
// [kv_heads, stored, dim] at storage[token]. Returns the rotated q [tokens, heads, dim].
template <typename T>
void rotary_rows(const T* qkv, const float* cos, const float* sin, T* keys, T* values, const int64_t* storage, T* q_out,
                 int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t stored) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      auto rotate = [&](const T* x, T* y) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x[i]), b = to_float(x[i + half]);
          put(y + i, a * c[i] - b * s[i]);
          put(y + i + half, b * c[i + half] + a * s[i + half]);
        }
      };
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, q_out + (t * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(row + (heads + h) * dim, keys + (h * stored + storage[t]) * dim);
        const T* v = row + (heads + kv_heads + h) * dim;
        T* target = values + (h * stored + storage[t]) * dim;
        for (int64_t i = 0; i < dim; ++i) target[i] = v[i];
      }
    }
  });
}

at::Tensor rotary_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                            at::Tensor values, const at::Tensor& storage, int64_t heads, int64_t kv_heads) {
  const int64_t tokens = qkv.size(0), dim = keys.size(2), stored = keys.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv [tokens, (heads + 2 kv_heads) x dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(), "float32 cos/sin [tokens, dim]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.size(0) == kv_heads && keys.sizes() == values.sizes() &&
              keys.scalar_type() == qkv.scalar_type() && values.scalar_type() == qkv.scalar_type(), "keys/values [kv_heads, stored, dim]");
  TORCH_CHECK(storage.scalar_type() == at::kLong && storage.is_contiguous() && storage.numel() == tokens, "int64 storage [tokens]");
  TORCH_CHECK(dim % 2 == 0, "an even head dimension");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  with_element_type(qkv.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    rotary_rows<T>(elements<T>(qkv), elements<float>(cos), elements<float>(sin), elements<T>(keys), elements<T>(values),
                   storage.data_ptr<int64_t>(), elements<T>(q), tokens, heads, kv_heads, dim, stored);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("add_rms_norm(Tensor hidden, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_and_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor storage, "
        "int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_and_write", &rotary_and_write);
}
