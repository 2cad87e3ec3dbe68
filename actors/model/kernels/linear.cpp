// x @ W.T for float32 on a CPU, each output summed the same way whatever the call's row count, its
// other rows or the thread count: one vector accumulator an output (8 lanes, 16 with AVX-512), over
// the inputs in order (a fused multiply-add where the CPU has one), its lanes added in a fixed order. torch's float32
// products (MKL, oneDNN) choose their kernel and summation order by the call's shape, and on some
// CPUs (AMD's, without AVX-512) take slow paths for the few rows a decoding pass has.
//
// Blocking: a thread takes a block of weight rows small enough to stay in its L2 while every panel
// of input rows passes over it, so the weights are read from memory once a call; inside, a tile of
// kTileRows input rows by kTileOutputs weight rows keeps its 12 accumulators in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* at) {
  Lanes v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

// acc + a * b, rounded once where the CPU fuses it; every output takes this same step
inline Lanes multiply_add(Lanes a, Lanes b, Lanes acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(acc)));
#elif defined(__AVX__) && defined(__FMA__)
  return reinterpret_cast<Lanes>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(acc)));
#else
  return a * b + acc;
#endif
}

constexpr int64_t kTileRows = 4, kTileOutputs = 3;
constexpr int64_t kPanelRows = 64;
constexpr int64_t kBlockBytes = 96 * 1024;

// An output's lanes and the inputs past the last whole group of lanes, always in this order.
__attribute__((noinline)) float finish(Lanes acc, const float* x, const float* w, int64_t from, int64_t width) {
  float total = 0.f;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += acc[lane];
  for (int64_t k = from; k < width; ++k) total += x[k] * w[k];
  return total;
}

// rows x outputs of the product (rows <= kTileRows, outputs <= kTileOutputs)
template <int64_t Rows, int64_t Outputs>
void tile(const float* x, const float* weight, const float* bias, float* y, int64_t width, int64_t x_stride,
          int64_t y_stride) {
  Lanes acc[Rows][Outputs];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t o = 0; o < Outputs; ++o) acc[r][o] = Lanes{};
  const int64_t whole = width - width % kLanes;
  for (int64_t k = 0; k < whole; k += kLanes) {
    Lanes w[Outputs];
    for (int64_t o = 0; o < Outputs; ++o) w[o] = load(weight + o * width + k);
    for (int64_t r = 0; r < Rows; ++r) {
      const Lanes v = load(x + r * x_stride + k);
      for (int64_t o = 0; o < Outputs; ++o) acc[r][o] = multiply_add(v, w[o], acc[r][o]);
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t o = 0; o < Outputs; ++o) {
      const float sum = finish(acc[r][o], x + r * x_stride, weight + o * width, whole, width);
      y[r * y_stride + o] = bias == nullptr ? sum : sum + bias[o];
    }
}

template <int64_t Outputs>
void tile_rows(int64_t rows, const float* x, const float* weight, const float* bias, float* y, int64_t width,
               int64_t x_stride, int64_t y_stride) {
  switch (rows) {
    case 1: tile<1, Outputs>(x, weight, bias, y, width, x_stride, y_stride); break;
    case 2: tile<2, Outputs>(x, weight, bias, y, width, x_stride, y_stride); break;
    case 3: tile<3, Outputs>(x, weight, bias, y, width, x_stride, y_stride); break;
    default: tile<kTileRows, Outputs>(x, weight, bias, y, width, x_stride, y_stride);
  }
}

void any_tile(int64_t rows, int64_t outputs, const float* x, const float* weight, const float* bias, float* y,
              int64_t width, int64_t x_stride, int64_t y_stride) {
  switch (outputs) {
    case 1: tile_rows<1>(rows, x, weight, bias, y, width, x_stride, y_stride); break;
    case 2: tile_rows<2>(rows, x, weight, bias, y, width, x_stride, y_stride); break;
    default: tile_rows<kTileOutputs>(rows, x, weight, bias, y, width, x_stride, y_stride);
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x [rows, in], float32, rows contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
              weight.size(1) == x.size(1), "weight [out, in], float32, contiguous");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0), "bias [out]");
  const int64_t rows = x.size(0), width = x.size(1), outputs = weight.size(0), x_stride = x.stride(0);
  at::Tensor y = at::empty({rows, outputs}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  const float* bs = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const int64_t block = std::max<int64_t>(
      kTileOutputs, kBlockBytes / (width * static_cast<int64_t>(sizeof(float))) / kTileOutputs * kTileOutputs);
  const int64_t blocks = (outputs + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t o_begin = b * block, o_end = std::min(outputs, o_begin + block);
      for (int64_t panel = 0; panel < rows; panel += kPanelRows) {
        const int64_t panel_end = std::min(rows, panel + kPanelRows);
        for (int64_t o = o_begin; o < o_end; o += kTileOutputs) {
          const int64_t n = std::min(kTileOutputs, o_end - o);
          for (int64_t r = panel; r < panel_end; r += kTileRows)
            any_tile(std::min(kTileRows, panel_end - r), n, xs + r * x_stride, ws + o * width,
                     bs == nullptr ? nullptr : bs + o, ys + r * outputs + o, width, x_stride, outputs);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) { m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("linear", &linear); }
