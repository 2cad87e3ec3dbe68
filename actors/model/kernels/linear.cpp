// x @ W.T for float32 and bfloat16 on a CPU, each output summed the same way whatever the call's row
// count, its other rows or the thread count: one float32 vector accumulator an output (8 lanes, 16
// with AVX-512), over the inputs in order (a fused multiply-add where the CPU has one), its lanes
// added in a fixed order; a bfloat16 result is that sum rounded. torch's products (MKL, oneDNN)
// choose their kernel and summation order by the call's shape, and on some CPUs take slow paths for
// the few rows a decoding pass has (float32 on AMD's without AVX-512) or give a row other bits by
// the call it is in (bfloat16 with 1,536 inputs on an AVX512-FP16 Xeon).
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
#include <type_traits>
#include <utility>
#include <vector>

#include "dtype_io.h"

#if (defined(__AVX__) && defined(__FMA__)) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using specserve_kernels::elements;
using specserve_kernels::put;
using specserve_kernels::to_float;

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

// bfloat16's bits widened to float32's (a shift: exact)
typedef uint16_t Bits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Bits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Lanes load(const uint16_t* at) {
  Bits16 bits;
  std::memcpy(&bits, at, sizeof bits);
  const Bits32 wide = __builtin_convertvector(bits, Bits32) << 16;
  Lanes v;
  std::memcpy(&v, &wide, sizeof v);
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

// How one step over the inputs reads its operands and adds their products to an output's lanes:
// kStep inputs a step, the same steps for every output.
template <typename T>
struct Operands {  // float32, and bfloat16 widened to it
  using Vector = Lanes;
  static constexpr int64_t kStep = kLanes;
  static Vector read(const T* at) { return load(at); }
  static Lanes accumulate(Vector a, Vector b, Lanes acc) { return multiply_add(a, b, acc); }
};

#if defined(__AVX512BF16__)
// bfloat16 pairs straight into float32 lanes (vdpbf16ps: twice the products a step, no widening)
template <>
struct Operands<uint16_t> {
  using Vector = __m512i;
  static constexpr int64_t kStep = 2 * kLanes;
  static Vector read(const uint16_t* at) { return _mm512_loadu_si512(at); }
  static Lanes accumulate(Vector a, Vector b, Lanes acc) {
    return reinterpret_cast<Lanes>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(a),
                                                    reinterpret_cast<__m512bh>(b)));
  }
};
#endif

#if defined(__AVX512F__)
constexpr int64_t kTileRows = 4, kTileOutputs = 6;  // 24 accumulators, 6 weight vectors, an input: 31 of 32 registers
#else
constexpr int64_t kTileRows = 4, kTileOutputs = 3;  // 12 + 3 + 1: AVX2's 16
#endif
constexpr int64_t kPanelRows = 64;
constexpr int64_t kBlockBytes = 96 * 1024;

// An output's lanes added in halves (lane i and i + half, then again): additions alone, so their
// order is the one written however the compiler lays them out.
inline float lane_sum(Lanes acc) {
  float lanes[kLanes];
  std::memcpy(lanes, &acc, sizeof acc);
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t lane = 0; lane < half; ++lane) lanes[lane] += lanes[lane + half];
  return lanes[0];
}

// lane_sum of `count` accumulators, each added exactly as lane_sum adds it (the same pairs, the same
// halving order), sixteen at a time with AVX-512: a tile's scalar lane sums cost as much as its
// products over 576 inputs.
inline void lane_sums(const Lanes* acc, int64_t count, float* sums) {
#if defined(__AVX512F__)
  for (int64_t first = 0; first < count; first += 16) {
    __m512 a[16];
    for (int64_t i = 0; i < 16; ++i)
      a[i] = first + i < count ? reinterpret_cast<__m512>(acc[first + i]) : _mm512_setzero_ps();
    __m512 halves[8], quarters[4], eighths[2];
    for (int64_t p = 0; p < 8; ++p)  // lane l + lane l + 8: two accumulators' 8 partial sums a vector
      halves[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int64_t q = 0; q < 4; ++q)  // + 4: four accumulators' 4 a vector, one a 128-bit block
      quarters[q] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(halves[2 * q], halves[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int64_t r = 0; r < 2; ++r)  // + 2, inside each block
      eighths[r] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * r], quarters[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(quarters[2 * r], quarters[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
    float lanes[16];  // lane 4m + t holds accumulator m + 4t's sum
    _mm512_storeu_ps(lanes, total);
    for (int64_t i = 0; i < 16 && first + i < count; ++i) sums[first + i] = lanes[4 * (i % 4) + i / 4];
  }
#else
  for (int64_t i = 0; i < count; ++i) sums[i] = lane_sum(acc[i]);
#endif
}

// The inputs past the last whole step, after the lanes, in order: one function for every tile, so
// that no tile's copy of it multiplies and adds another way.
template <typename T>
__attribute__((noinline)) float add_rest(float total, const T* x, const T* w, int64_t from, int64_t width) {
  for (int64_t k = from; k < width; ++k) total += to_float(x[k]) * to_float(w[k]);
  return total;
}

// rows x outputs of the product (rows <= kTileRows, outputs <= kTileOutputs)
template <int64_t Rows, int64_t Outputs, typename T>
void tile(const T* x, const T* weight, const T* bias, T* y, int64_t width, int64_t x_stride, int64_t y_stride) {
  Lanes acc[Rows][Outputs];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t o = 0; o < Outputs; ++o) acc[r][o] = Lanes{};
  using Step = Operands<T>;
  const int64_t whole = width - width % Step::kStep;
  for (int64_t k = 0; k < whole; k += Step::kStep) {
    typename Step::Vector w[Outputs];
    for (int64_t o = 0; o < Outputs; ++o) w[o] = Step::read(weight + o * width + k);
    for (int64_t r = 0; r < Rows; ++r) {
      const typename Step::Vector v = Step::read(x + r * x_stride + k);
      for (int64_t o = 0; o < Outputs; ++o) acc[r][o] = Step::accumulate(v, w[o], acc[r][o]);
    }
  }
  float sums[Rows * Outputs];
  lane_sums(&acc[0][0], Rows * Outputs, sums);
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t o = 0; o < Outputs; ++o) {
      float sum = sums[r * Outputs + o];
      if (whole < width) sum = add_rest(sum, x + r * x_stride, weight + o * width, whole, width);
      put(y + r * y_stride + o, bias == nullptr ? sum : sum + to_float(bias[o]));
    }
}

template <int64_t... Rows, typename Body>
void each_row_count(std::integer_sequence<int64_t, Rows...>, int64_t rows, Body&& body) {
  ((rows == Rows + 1 && (body(std::integral_constant<int64_t, Rows + 1>{}), true)) || ...);
}

// Calls body(rows, count) with both as compile-time constants (std::integral_constant): `rows` from
// 1 to MaxRows, `count` from 1 to MaxCount. Both product kernels tile this way: every tile shape is
// its own unrolled loop.
template <int64_t MaxRows, int64_t... Counts, typename Body>
void each_count(std::integer_sequence<int64_t, Counts...>, int64_t rows, int64_t count, Body& body) {
  const auto with_rows = [&](auto count_constant) {
    each_row_count(std::make_integer_sequence<int64_t, MaxRows>{}, rows, [&](auto rows_constant) { body(rows_constant, count_constant); });
  };
  ((count == Counts + 1 && (with_rows(std::integral_constant<int64_t, Counts + 1>{}), true)) || ...);
}

template <int64_t MaxRows, int64_t MaxCount, typename Body>
void tile_shape(int64_t rows, int64_t count, Body body) {
  each_count<MaxRows>(std::make_integer_sequence<int64_t, MaxCount>{}, rows, count, body);
}

template <typename T>
void product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t rows = x.size(0), width = x.size(1), outputs = weight.size(0), x_stride = x.stride(0);
  const T* xs = elements<T>(x);
  const T* ws = elements<T>(weight);
  const T* bs = bias.has_value() ? elements<T>(*bias) : nullptr;
  T* ys = elements<T>(y);
  const int64_t block = std::max<int64_t>(
      kTileOutputs, kBlockBytes / (width * static_cast<int64_t>(sizeof(T))) / kTileOutputs * kTileOutputs);
  const int64_t blocks = (outputs + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t o_begin = b * block, o_end = std::min(outputs, o_begin + block);
      for (int64_t panel = 0; panel < rows; panel += kPanelRows) {
        const int64_t panel_end = std::min(rows, panel + kPanelRows);
        for (int64_t o = o_begin; o < o_end; o += kTileOutputs) {
          const int64_t n = std::min(kTileOutputs, o_end - o);
          for (int64_t r = panel; r < panel_end; r += kTileRows)
            tile_shape<kTileRows, kTileOutputs>(std::min(kTileRows, panel_end - r), n, [&](auto tile_rows, auto count) {
              tile<decltype(tile_rows)::value, decltype(count)::value>(xs + r * x_stride, ws + o * width,
                                                                       bs == nullptr ? nullptr : bs + o,
                                                                       ys + r * outputs + o, width, x_stride, outputs);
            });
        }
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto type = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (type == at::kFloat || type == at::kBFloat16) && x.stride(1) == 1,
              "x [rows, in], float32 or bfloat16, rows contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == type && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight [out, in], x's dtype, contiguous");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == type && bias->is_contiguous() && bias->numel() == weight.size(0), "bias [out]");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (type == at::kFloat)
    product<float>(x, weight, bias, y);
  else
    product<uint16_t>(x, weight, bias, y);
  return y;
}

// bfloat16 over a weight in pairs (`linear_pairs`): W [out, in] laid out as [out / 16][in / 2][16][2]
// (outputs padded to a multiple of 16 with zeros), so one vector holds an input pair's weights for
// 16 outputs. Each output is summed over the pairs in order, each pair as `vdpbf16ps` adds it (the
// odd input's product, then the even's, each exact and rounded once into the sum: a fused
// multiply-add), lanes never crossing, so there is no lane sum and a row's bits do not depend on the
// call. The sums are float32 fused multiply-adds, not `vdpbf16ps` (same bits but for denormals,
// which it flushes to zero): on the AVX512-BF16 Xeon of docs/benchmarks.md two multiply-adds of 16
// lanes cost 0.6 of one `vdpbf16ps`, and the products ran 1.7x faster from 16 rows on. A pair's
// weights widen to float32 in two integer steps (a shift, a mask) shared by a tile's rows; the
// inputs are widened once a panel.
#if defined(__AVX512BF16__)
constexpr int64_t kPairRows = 8, kPairGroup = 6;  // rows a tile; blocks of 16 outputs a thread's unit of work

// Blocks of 16 outputs a tile of `rows` takes: 6 for 1-2 rows, 3 for 3-4, 2 for 5-8 (12-16
// accumulators): enough independent sums to keep the multiply-adds busy while few rows' weights
// stream from memory, few enough that the widened weights stay in registers. No output's
// arithmetic depends on it.
constexpr int64_t tile_blocks(int64_t rows) { return rows <= 2 ? 6 : (rows <= 4 ? 3 : 2); }

template <int64_t Rows, int64_t Blocks>
void pair_tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t pairs, const float* bias, uint16_t* y,
               int64_t y_stride, int64_t valid_outputs) {
  __m512 acc[Rows][Blocks];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t block_elements = pairs * 32;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 even[Blocks], odd[Blocks];
    for (int64_t b = 0; b < Blocks; ++b) {
      // 16 pairs ahead (past a block's end it reads nothing that matters, and a prefetch never faults):
      // 1.2x the rate from memory at 1-8 rows
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_elements + (p + 16) * 32), _MM_HINT_T0);
      const __m512i both = _mm512_loadu_si512(w + b * block_elements + p * 32);
      even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      odd[b] = _mm512_castsi512_ps(_mm512_and_si512(both, high));
    }
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512 x_even = _mm512_set1_ps(x[r * x_stride + 2 * p]), x_odd = _mm512_set1_ps(x[r * x_stride + 2 * p + 1]);
      for (int64_t b = 0; b < Blocks; ++b) acc[r][b] = _mm512_fmadd_ps(x_even, even[b], _mm512_fmadd_ps(x_odd, odd[b], acc[r][b]));
    }
  }
  for (int64_t b = 0; b < Blocks; ++b) {
    const int64_t valid = std::min<int64_t>(16, valid_outputs - b * 16);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 add = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + b * 16);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512 sum = bias == nullptr ? acc[r][b] : _mm512_add_ps(acc[r][b], add);
      _mm256_mask_storeu_epi16(y + r * y_stride + b * 16, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
    }
  }
}

#endif

at::Tensor linear_pairs(const at::Tensor& x, const at::Tensor& paired, const c10::optional<at::Tensor>& bias,
                        int64_t outputs) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x [rows, in], bfloat16, rows contiguous, an even number of inputs");
  const int64_t rows = x.size(0), pairs = x.size(1) / 2, blocks = (outputs + 15) / 16;
  TORCH_CHECK(paired.scalar_type() == at::kBFloat16 && paired.is_contiguous() && paired.dim() == 4 &&
                  paired.size(0) == blocks && paired.size(1) == pairs && paired.size(2) == 16 && paired.size(3) == 2,
              "paired [out / 16, in / 2, 16, 2], bfloat16, contiguous (projection.paired_weight)");
  at::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  if (bias.has_value()) TORCH_CHECK(bias32.numel() == outputs, "bias [out]");
  at::Tensor y = at::empty({rows, outputs}, x.options());
  const uint16_t* xs = elements<uint16_t>(x);
  const uint16_t* ws = elements<uint16_t>(paired);
  const float* bs = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  uint16_t* ys = elements<uint16_t>(y);
  const int64_t width = x.size(1), x_stride = x.stride(0), block_elements = pairs * 32;
  const int64_t groups = (blocks + kPairGroup - 1) / kPairGroup;  // a group's weights stay in L2 over a panel
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> widened(std::min(rows, kPanelRows) * width);  // the panel's inputs as float32
    for (int64_t panel = 0; panel < rows; panel += kPanelRows) {
      const int64_t panel_end = std::min(rows, panel + kPanelRows);
      for (int64_t r = panel; r < panel_end; ++r)
        for (int64_t k = 0; k < width; ++k) widened[(r - panel) * width + k] = to_float(xs[r * x_stride + k]);
      for (int64_t group = first; group < last; ++group) {
        const int64_t group_block = group * kPairGroup, group_end = std::min(blocks, group_block + kPairGroup);
        for (int64_t r = panel; r < panel_end; r += kPairRows) {
          const int64_t tile_rows = std::min(kPairRows, panel_end - r);
          const int64_t step = tile_blocks(tile_rows);
          for (int64_t block = group_block; block < group_end; block += step) {
            const int64_t count = std::min(step, group_end - block);
            const int64_t output = block * 16, valid = std::min(count * 16, outputs - output);
            const auto tile = [&](auto rows_constant, auto blocks_constant) {
              pair_tile<decltype(rows_constant)::value, decltype(blocks_constant)::value>(
                  widened.data() + (r - panel) * width, width, ws + block * block_elements, pairs,
                  bs == nullptr ? nullptr : bs + output, ys + r * outputs + output, outputs, valid);
            };
            switch (step) {
              case tile_blocks(1): tile_shape<2, tile_blocks(1)>(tile_rows, count, tile); break;
              case tile_blocks(3): tile_shape<4, tile_blocks(3)>(tile_rows, count, tile); break;
              default: tile_shape<kPairRows, tile_blocks(kPairRows)>(tile_rows, count, tile);
            }
          }
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_pairs needs a build for a CPU with AVX512-BF16 (pairs_built() is false)");
#endif
}

bool pairs_built() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_pairs(Tensor x, Tensor paired, Tensor? bias, int outputs) -> Tensor");
  m.def("pairs_built() -> bool");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("linear", &linear); m.impl("linear_pairs", &linear_pairs); }

TORCH_LIBRARY_IMPL(specserve, CompositeExplicitAutograd, m) { m.impl("pairs_built", &pairs_built); }
