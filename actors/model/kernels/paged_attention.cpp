// Attention of a packed forward pass's rows over a paged KV cache, for a CPU.
//
// Each row lists the storage positions of the columns it attends, in position order. Its output is
// computed from those columns alone, in blocks of kBlock columns counted from its first, with one
// fixed order of every sum: so a token gets the same bits whether it is decoded alone, verified deep
// in a tree (its ancestors wherever the tree's scratch positions put them), prefilled in a chunk of
// any size, or beside any other rows. Rows of one sequence mostly attend the same leading positions
// (a committed prefix, a prompt chunk's earlier tokens): a block of those is loaded once for all of
// them (each row's arithmetic is the same either way). One call covers every row of a pass, for one layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dtype_io.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;     // columns per online-softmax step
constexpr int64_t kMaxDim = 256;   // head dimension
constexpr int64_t kMaxGroup = 16;  // query heads per kv head

using specserve_kernels::elements;
using specserve_kernels::put;
using specserve_kernels::with_element_type;
using specserve_kernels::to_bfloat16_bits;
using specserve_kernels::to_float;

__attribute__((noinline)) void exp_in_place(float* x, int64_t count) {
  for (int64_t j = 0; j < count; ++j) x[j] = specserve_kernels::exp_approx(x[j]);
}

// The bfloat16 keys of 16 columns, `run` their storage positions (the first `valid` of them real),
// as 16 rows of `dim`: where they lie in the cache when all 16 are real and at consecutive
// positions (a cache block's, the common case), else copied into `staged` with zero keys past
// `valid`. The same keys either way.
inline const uint16_t* sixteen_keys(const uint16_t* keys, const int64_t* run, int64_t valid, int64_t dim,
                                    uint16_t* staged) {
  static const uint16_t zeros[kMaxDim] = {};
  if (valid >= 16 && std::adjacent_find(run, run + 16, [](int64_t a, int64_t b) { return b != a + 1; }) == run + 16)
    return keys + run[0] * dim;
  for (int64_t j = 0; j < 16; ++j)
    std::memcpy(staged + j * dim, j < valid ? keys + run[j] * dim : zeros, dim * sizeof(uint16_t));
  return staged;
}

#ifdef __AVX512F__
// 16 rows of 16 floats (row j at src + j * src_stride) as 16 columns in registers (r[i] holds
// column i): 64 shuffles instead of 16 gathers (16 decoding rows, 30 layers of the default target
// in bfloat16: 7.8 -> 6.5 ms).
inline void transposed_16x16(const float* src, int64_t src_stride, __m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs of neighbouring rows
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs: 4 rows a 128-bit lane
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int half = 0; half < 16; half += 8)  // 128-bit lanes of rows 0-7, then 8-15
    for (int i = 0; i < 4; ++i) {
      t[half + i] = _mm512_shuffle_f32x4(r[half + i], r[half + i + 4], 0x88);
      t[half + i + 4] = _mm512_shuffle_f32x4(r[half + i], r[half + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// The same, column i stored at dst + i * dst_stride.
inline void transpose_16x16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16];
  transposed_16x16(src, src_stride, r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * dst_stride, r[i]);
}

// bfloat16 keys of a block as float32 transposed, keys_t [dim][kBlock]: each column's key read as
// 32-bit pairs of dims (from the cache where 16 columns lie at consecutive positions), 16 columns'
// pairs transposed at once, then each pair widened into its two dims' rows (a shift, a mask): half
// the shuffles of widening first and no copy, the same floats. Columns past `size` get zero keys.
inline void load_keys_in_pairs(const uint16_t* keys, const int64_t* positions, int64_t size, int64_t dim,
                               float* keys_t) {
  const int64_t pairs = dim / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  alignas(64) uint16_t staged[16 * kMaxDim];
  for (int64_t half = 0; half < kBlock; half += 16) {
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(sixteen_keys(keys, positions + half, size - half, dim, staged));
    for (int64_t p = 0; p < pairs; p += 16) {
      __m512 r[16];
      transposed_16x16(reinterpret_cast<const float*>(rows + p), pairs, r);
      for (int64_t i = 0; i < 16; ++i) {
        const __m512i both = _mm512_castps_si512(r[i]);
        _mm512_storeu_ps(keys_t + 2 * (p + i) * kBlock + half, _mm512_castsi512_ps(_mm512_slli_epi32(both, 16)));
        _mm512_storeu_ps(keys_t + (2 * (p + i) + 1) * kBlock + half, _mm512_castsi512_ps(_mm512_and_si512(both, high)));
      }
    }
  }
}
#endif

// Block columns as floats: keys transposed [dim][kBlock] (scores then vectorize over columns, with
// no horizontal sums), values [kBlock][dim]. Columns past `size` get zero keys.
template <typename T>
void load_block(const T* keys, const T* values, const int64_t* positions, int64_t size, int64_t dim,
                float* keys_t, float* rows) {
  for (int64_t j = 0; j < size; ++j) {
    const T* value = values + positions[j] * dim;
    for (int64_t i = 0; i < dim; ++i) rows[j * dim + i] = to_float(value[i]);
  }
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, uint16_t>)
    if (dim % 32 == 0) return load_keys_in_pairs(keys, positions, size, dim, keys_t);
#endif
  alignas(64) float staged[kBlock * kMaxDim];  // keys as rows, then transposed 16 columns at a time
  for (int64_t j = 0; j < size; ++j) {
    const T* key = keys + positions[j] * dim;
    for (int64_t i = 0; i < dim; ++i) staged[j * dim + i] = to_float(key[i]);
  }
  for (int64_t j = size; j < kBlock; ++j)
    for (int64_t i = 0; i < dim; ++i) staged[j * dim + i] = 0.f;
#ifdef __AVX512F__
  if (dim % 16 == 0) {
    for (int64_t first = 0; first < kBlock; first += 16)
      for (int64_t i = 0; i < dim; i += 16) transpose_16x16(staged + first * dim + i, dim, keys_t + i * kBlock + first, kBlock);
    return;
  }
#endif
  for (int64_t j = 0; j < kBlock; ++j)
    for (int64_t i = 0; i < dim; ++i) keys_t[i * kBlock + j] = staged[j * dim + i];
}

// A block's keys and values requested from memory ahead of use: the next block's, while this one
// is computed (decoding rows read every cached position once a pass, so their attention waits on memory).
template <typename T>
void prefetch_block(const T* keys, const T* values, const int64_t* positions, int64_t size, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < size; ++j)
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(keys + positions[j] * dim) + offset);
      __builtin_prefetch(reinterpret_cast<const char*>(values + positions[j] * dim) + offset);
    }
}

// One query vector (a row's query head): its running max, sum of weights and weighted values.
struct Vector {
  const float* query;  // [dim], scaled (the float32 blocks' product)
  const void* raw;     // [dim], the query as the tensor holds it (the AMX blocks' product)
  float max_score;
  float total;
  float* acc;  // [dim]
};

// Scores of `count` query vectors (compile-time, so their accumulators stay in registers) against a
// loaded block: each one the same fused multiply-adds in the same order, whichever vectors share the tile.
template <int count>
__attribute__((noinline)) void score_tile(Vector* const* vectors, const float* keys_t, int64_t dim, float* scores) {
  alignas(64) float tile[count][kBlock] = {};
  for (int64_t i = 0; i < dim; ++i) {
    const float* key = keys_t + i * kBlock;
    for (int v = 0; v < count; ++v) {
      const float q = vectors[v]->query[i];
      for (int64_t j = 0; j < kBlock; ++j) tile[v][j] = std::fma(q, key[j], tile[v][j]);
    }
  }
  std::memcpy(scores, tile, sizeof(tile));
}

constexpr int kTile = 4;  // query vectors scored and accumulated together

// The softmax step of a tile's `count` vectors over a block of `size` columns: each one's scores
// [kBlock] (vector v's at scores + v * kBlock) become its weights (0 past `size`), its max and total
// move on, and alphas[v] is the factor its earlier weighted sum is to be scaled by. A block's sum
// is taken in one fixed order (halves added pairwise). One call a tile, not a vector: the vectors'
// steps are independent, so the CPU overlaps their horizontal maxima and sums, and one exp call
// takes every score of the tile (elementwise, so a score's weight is the same in any tile).
__attribute__((noinline)) void weigh(Vector* const* vectors, int count, float* scores, int64_t size, float* alphas) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float block_max[kTile];
  for (int v = 0; v < count; ++v) {
    float* row = scores + v * kBlock;
    for (int64_t j = size; j < kBlock; ++j) row[j] = kNegInf;
    block_max[v] = vectors[v]->max_score;
#ifdef __AVX512F__
    static_assert(kBlock == 32, "two vectors of 16 floats");
    block_max[v] = std::max(block_max[v], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16))));
#else
    for (int64_t j = 0; j < size; ++j) block_max[v] = std::max(block_max[v], row[j]);
#endif
    for (int64_t j = 0; j < kBlock; ++j) row[j] -= block_max[v];
  }
  exp_in_place(scores, count * kBlock);
  for (int v = 0; v < count; ++v) {
    float* row = scores + v * kBlock;
    for (int64_t j = size; j < kBlock; ++j) row[j] = 0.f;
#ifdef __AVX512F__
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16)));
#else
    alignas(64) float partial[kBlock];
    std::memcpy(partial, row, sizeof(partial));
    for (int64_t width = kBlock / 2; width >= 1; width /= 2)
      for (int64_t j = 0; j < width; ++j) partial[j] += partial[j + width];
    const float sum = partial[0];
#endif
    Vector& vector = *vectors[v];
    alphas[v] = vector.max_score == kNegInf ? 0.f : std::exp(vector.max_score - block_max[v]);
    vector.total = vector.total * alphas[v] + sum;
    vector.max_score = block_max[v];
  }
}

// acc = acc * alpha, then acc = fma(weight_j, value_j, acc) for j in order: one vector at a time, or
// with AVX-512 `count` vectors at once with the head dimension known (accumulators in registers,
// each value row loaded once). Every vector's arithmetic is the same either way (exact fused
// multiply-adds, in the same order).
__attribute__((noinline)) void accumulate_one(Vector& vector, const float* weights, float alpha, const float* rows,
                                              int64_t size, int64_t dim) {
  float* acc = vector.acc;
  for (int64_t i = 0; i < dim; ++i) acc[i] *= alpha;
  for (int64_t j = 0; j < size; ++j) {
    const float w = weights[j];
    const float* row = rows + j * dim;
    for (int64_t i = 0; i < dim; ++i) acc[i] = std::fma(w, row[i], acc[i]);
  }
}

#ifdef __AVX512F__
template <int count, int chunks>  // chunks: the head dimension in 16-float vectors
__attribute__((noinline)) void accumulate_tile(Vector* const* vectors, const float* weights, const float* alphas,
                                               const float* rows, int64_t size) {
  __m512 acc[count][chunks];
#pragma GCC unroll 16
  for (int v = 0; v < count; ++v)
#pragma GCC unroll 16
    for (int c = 0; c < chunks; ++c)
      acc[v][c] = _mm512_mul_ps(_mm512_loadu_ps(vectors[v]->acc + 16 * c), _mm512_set1_ps(alphas[v]));
  for (int64_t j = 0; j < size; ++j) {
    __m512 row[chunks];
#pragma GCC unroll 16
    for (int c = 0; c < chunks; ++c) row[c] = _mm512_loadu_ps(rows + j * chunks * 16 + 16 * c);
#pragma GCC unroll 16
    for (int v = 0; v < count; ++v) {
      const __m512 w = _mm512_set1_ps(weights[v * kBlock + j]);
#pragma GCC unroll 16
      for (int c = 0; c < chunks; ++c) acc[v][c] = _mm512_fmadd_ps(w, row[c], acc[v][c]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < count; ++v)
#pragma GCC unroll 16
    for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(vectors[v]->acc + 16 * c, acc[v][c]);
}
#endif

template <int count>
void accumulate(Vector* const* vectors, const float* weights, const float* alphas, const float* rows, int64_t size,
                int64_t dim) {
#ifdef __AVX512F__
  if (dim == 64) return accumulate_tile<count, 4>(vectors, weights, alphas, rows, size);
  if (dim == 128 && count <= 2) return accumulate_tile<count, 8>(vectors, weights, alphas, rows, size);
#endif
  for (int v = 0; v < count; ++v) accumulate_one(*vectors[v], weights + v * kBlock, alphas[v], rows, size, dim);
}

template <int count>
void tile_step(Vector* const* vectors, const float* keys_t, const float* rows, int64_t size, int64_t dim) {
  alignas(64) float scores[kTile * kBlock];
  float alphas[kTile];
  score_tile<count>(vectors, keys_t, dim, scores);
  weigh(vectors, count, scores, size, alphas);
  accumulate<count>(vectors, scores, alphas, rows, size, dim);
}

// Every vector of `vectors` over one loaded block, kTile at a time.
void step(Vector* const* vectors, int64_t count, const float* keys_t, const float* rows, int64_t size, int64_t dim) {
  for (int64_t first = 0; first < count; first += kTile) {
    Vector* const* tile = vectors + first;
    switch (std::min<int64_t>(kTile, count - first)) {
      case 4: tile_step<4>(tile, keys_t, rows, size, dim); break;
      case 3: tile_step<3>(tile, keys_t, rows, size, dim); break;
      case 2: tile_step<2>(tile, keys_t, rows, size, dim); break;
      default: tile_step<1>(tile, keys_t, rows, size, dim); break;
    }
  }
}

// Blocks staged as float32 and multiplied with AVX-512 fused multiply-adds: every dtype, every CPU.
template <typename T>
struct FloatBlocks {
  static constexpr bool kScaledQueries = true;  // the scale is in the queries, before the product
  int64_t dim;
  alignas(64) float keys_t[kMaxDim * kBlock];
  alignas(64) float rows[kBlock * kMaxDim];

  FloatBlocks(int64_t dim, float) : dim(dim) {}

  void load(const T* keys, const T* values, const int64_t* positions, int64_t size) {
    load_block(keys, values, positions, size, dim, keys_t, rows);
  }
  // Each vector over the loaded block's first sizes[v] columns (runs of one size a call).
  void step(Vector* const* vectors, int64_t count, const int64_t* sizes) {
    for (int64_t first = 0, last; first < count; first = last) {
      for (last = first + 1; last < count && sizes[last] == sizes[first];) ++last;
      ::step(vectors + first, last - first, keys_t, rows, sizes[first], dim);
    }
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SPECSERVE_AMX 1

// Whether this process may use AMX tiles: Linux grants them on request (once, for every thread).
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ready;
}

// vector_math.h's exp_approx, 16 lanes at once (a loop of the scalar one was 6% slower on a
// 1024-token prompt's pass).
inline __m512 exp_approx(__m512 x) {
  namespace k = specserve_kernels::exp_constants;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(k::kLowest)), _mm512_set1_ps(k::kHighest));
  const __m512 whole = _mm512_floor_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(k::kLog2E), _mm512_set1_ps(0.5f)));
  const __m512 r = _mm512_fmadd_ps(whole, _mm512_set1_ps(k::kLn2Low), _mm512_fnmadd_ps(whole, _mm512_set1_ps(k::kLn2High), x));
  __m512 p = _mm512_set1_ps(k::kPolynomial[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k::kPolynomial[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, whole);
}

// bfloat16 blocks multiplied on AMX tiles, 16 query vectors a tile: the scores Q K^T and the
// weighted values P V each a few tile products, where the float32 blocks take dim fused
// multiply-adds a column per vector (a 256-token prompt chunk's attention: see docs/benchmarks.md).
// A vector's arithmetic is still its own and fixed: a tile row depends only on that row of its
// left operand, every block holds kBlock columns (zero keys and values past those loaded), the
// softmax runs lane by lane (a lane a vector, the block's columns summed in order), and the weights
// enter P V rounded to bfloat16 (zero past a row's size).
// So a token gets the same bits whatever else the call holds, as with the float32 blocks, whose
// bits these are not: a process takes one kind for every call (AMX where the CPU and OS have it).
struct AmxBlocks {
  static constexpr bool kScaledQueries = false;
  static constexpr int kRows = 16;  // query vectors a tile product (a tile's rows, or its columns' pairs)
  int64_t dim;
  float scale;
  alignas(64) uint16_t keys[kBlock * kMaxDim];        // [kBlock][dim], zero past the columns loaded
  const uint16_t* key_rows[kBlock / kRows] = {};      // each 16 columns' keys: `keys`, or the cache's own
  alignas(64) uint32_t values[kBlock / 2 * kMaxDim];  // [kBlock / 2][dim]: each dim's pairs of columns (VNNI)
  alignas(64) uint32_t queries[kMaxDim / 2 * kRows];  // [dim / 2][kRows]: each vector's pairs of dims (VNNI)
  alignas(64) float scores[kBlock * kRows];           // [kBlock][kRows]: a column's scores, one lane a vector
  alignas(64) float weights_t[kRows * kBlock];        // [kRows][kBlock]
  alignas(64) uint16_t weights[kRows * kBlock];
  alignas(64) float weighted[kRows * kMaxDim];
  const void* staged_for[kRows] = {};  // whose queries `queries` holds (the same again: a decoding row's every block)
  int64_t staged_rows = 0;

  AmxBlocks(int64_t dim, float scale) : dim(dim), scale(scale) {
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_per_row[16] = {64, 64, 64};
      uint8_t rows[16] = {kRows, kRows, kRows};
    } config;
    _tile_loadconfig(&config);
  }
  ~AmxBlocks() { _tile_release(); }

  // Keys of 16 columns held at consecutive storage positions (a cache block's, the common case) are
  // read by the tile loads where they lie; others are copied (zero past `size`). Same bits either way.
  void load(const uint16_t* keys_in, const uint16_t* values_in, const int64_t* positions, int64_t size) {
    static const uint16_t zeros[kMaxDim] = {};
    static_assert(kRows == 16, "sixteen_keys gives 16 columns' keys");
    for (int64_t half = 0; half < kBlock; half += kRows)
      key_rows[half / kRows] = sixteen_keys(keys_in, positions + half, size - half, dim, keys + half * dim);
    for (int64_t j = 0; j < kBlock; j += 2) {
      const uint16_t* even = j < size ? values_in + positions[j] * dim : zeros;
      const uint16_t* odd = j + 1 < size ? values_in + positions[j + 1] * dim : zeros;
      uint32_t* row = values + j / 2 * dim;
      for (int64_t i = 0; i < dim; ++i) row[i] = even[i] | static_cast<uint32_t>(odd[i]) << 16;
    }
  }

  // Each vector over the loaded block's first sizes[v] columns.
  void step(Vector* const* vectors, int64_t count, const int64_t* sizes) {
    const int64_t pairs = dim / 2;
    for (int64_t first = 0; first < count; first += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, count - first);
      const bool staged_already = rows == staged_rows &&
          std::equal(staged_for, staged_for + rows, vectors + first, [](const void* raw, const Vector* v) { return raw == v->raw; });
      if (!staged_already) {
        alignas(64) uint32_t staged[kRows * kMaxDim / 2];  // the vectors' queries as rows of pairs
        for (int64_t m = 0; m < rows; ++m) std::memcpy(staged + m * pairs, vectors[first + m]->raw, dim * sizeof(uint16_t));
        for (int64_t p = 0; p < pairs; p += 16)
          transpose_16x16(reinterpret_cast<const float*>(staged + p), pairs, reinterpret_cast<float*>(queries + p * kRows), kRows);
        for (int64_t m = 0; m < rows; ++m) staged_for[m] = vectors[first + m]->raw;
        staged_rows = rows;
      }
      for (int64_t half = 0; half < kBlock; half += 16) {  // scores, transposed: K Q^T, 16 columns a tile
        _tile_zero(2);
        for (int64_t k = 0; k < dim; k += 32) {
          _tile_loadd(0, key_rows[half / kRows] + k, dim * sizeof(uint16_t));
          _tile_loadd(1, queries + k / 2 * kRows, kRows * sizeof(uint32_t));
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, scores + half * kRows, kRows * sizeof(float));
      }
      // the online softmax with a lane a vector (lanes past `rows` see no column)
      constexpr float kNegInf = -std::numeric_limits<float>::infinity();
      alignas(64) float limit[kRows], old_max[kRows], alpha[kRows];
      for (int m = 0; m < kRows; ++m) {
        limit[m] = m < rows ? static_cast<float>(sizes[first + m]) : 0.f;
        old_max[m] = m < rows ? vectors[first + m]->max_score : kNegInf;
      }
      const __m512 limits = _mm512_load_ps(limit), previous = _mm512_load_ps(old_max);
      const __m512 scaling = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNegInf);
      __m512 maximum = previous, total = _mm512_setzero_ps();
      for (int64_t j = 0; j < kBlock; ++j) {
        const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j)), limits, _CMP_LT_OQ);
        const __m512 score = _mm512_mask_mul_ps(none, seen, _mm512_load_ps(scores + j * kRows), scaling);
        _mm512_store_ps(scores + j * kRows, score);
        maximum = _mm512_max_ps(maximum, score);
      }
      for (int64_t j = 0; j < kBlock; ++j) {
        const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j)), limits, _CMP_LT_OQ);
        const __m512 weight = _mm512_maskz_mov_ps(seen, exp_approx(_mm512_sub_ps(_mm512_load_ps(scores + j * kRows), maximum)));
        _mm512_store_ps(scores + j * kRows, weight);
        total = _mm512_add_ps(total, weight);
      }
      const __mmask16 started = _mm512_cmp_ps_mask(previous, none, _CMP_NEQ_OQ);
      _mm512_store_ps(alpha, _mm512_maskz_mov_ps(started, exp_approx(_mm512_sub_ps(previous, maximum))));
      alignas(64) float maxima[kRows], totals[kRows];
      _mm512_store_ps(maxima, maximum);
      _mm512_store_ps(totals, total);
      for (int64_t m = 0; m < rows; ++m) {
        Vector& vector = *vectors[first + m];
        vector.total = vector.total * alpha[m] + totals[m];
        vector.max_score = maxima[m];
      }
      for (int64_t half = 0; half < kBlock; half += 16)  // the weights as rows, in bfloat16
        transpose_16x16(scores + half * kRows, kRows, weights_t + half, kBlock);
      for (int64_t i = 0; i < rows * kBlock; ++i) weights[i] = to_bfloat16_bits(weights_t[i]);  // rows past: unread
      _tile_loadd(0, weights, kBlock * sizeof(uint16_t));
      for (int64_t i = 0; i < dim; i += 16) {  // weighted values: 16 dims a tile
        _tile_zero(2);
        _tile_loadd(1, values + i, dim * sizeof(uint32_t));
        _tile_dpbf16ps(2, 0, 1);
        _tile_stored(2, weighted + i, dim * sizeof(float));
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* acc = vectors[first + m]->acc;
        const float* block = weighted + m * dim;
        for (int64_t i = 0; i < dim; ++i) acc[i] = std::fma(acc[i], alpha[m], block[i]);
      }
    }
  }
};
#endif

// A run of one sequence's rows that one task attends. A sequence's rows are split where they hold
// more work (columns) than a thread's share over kPartsPerThread: a long prompt chunk's rows would
// otherwise be a task per kv head, too few to keep every thread busy. Which task attends a row
// changes none of its arithmetic.
struct Part {
  int64_t sequence, first, end;
};

constexpr int64_t kPartsPerThread = 4;

std::vector<Part> split_rows(const int64_t* sequence_rows, int64_t sequence_count, const int64_t* count_of,
                             int64_t threads) {
  int64_t total = 0;
  for (int64_t row = 0; row < sequence_rows[sequence_count]; ++row) total += count_of[row];
  const int64_t share = std::max<int64_t>(total / (kPartsPerThread * std::max<int64_t>(threads, 1)), 1);
  std::vector<Part> parts;
  for (int64_t sequence = 0; sequence < sequence_count; ++sequence) {
    int64_t first = sequence_rows[sequence], work = 0;
    for (int64_t row = first; row < sequence_rows[sequence + 1]; ++row) {
      work += count_of[row];
      if (work >= share && row + 1 < sequence_rows[sequence + 1]) {
        parts.push_back({sequence, first, row + 1});
        first = row + 1;
        work = 0;
      }
    }
    parts.push_back({sequence, first, sequence_rows[sequence + 1]});
  }
  return parts;
}

template <typename T, typename Blocks>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& positions,
         const at::Tensor& starts, const at::Tensor& counts, const at::Tensor& sequences, const at::Tensor& references,
         const at::Tensor& shared, double scale, at::Tensor& out) {
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), stored = keys.size(1), groups = heads / kv_heads;
  const int64_t sequence_count = references.numel();
  const T* q = elements<T>(query);
  const T* k = elements<T>(keys);
  const T* v = elements<T>(values);
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t* start_of = starts.data_ptr<int64_t>();
  const int64_t* count_of = counts.data_ptr<int64_t>();
  const int64_t* sequence_rows = sequences.data_ptr<int64_t>();
  const int64_t* reference_of = references.data_ptr<int64_t>();
  const int64_t* shared_of = shared.data_ptr<int64_t>();
  T* o = elements<T>(out);
  const std::vector<Part> parts = split_rows(sequence_rows, sequence_count, count_of, at::get_num_threads());
  const int64_t part_count = static_cast<int64_t>(parts.size());
  // A task: one kv head of one part's rows (kv head first, so neighbouring tasks read apart). Each
  // thread takes the next task left rather than a fixed share, so a thread the OS deschedules (a
  // server's other work on these cores) holds the pass up by one task, not by half of it.
  const int64_t tasks = kv_heads * part_count;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    auto blocks = std::make_unique<Blocks>(dim, static_cast<float>(scale));
    std::vector<float> scaled, acc;
    std::vector<Vector> vectors;
    std::vector<Vector*> sharing;
    std::vector<int64_t> sizes;
    Vector* own[kMaxGroup];
    for (int64_t task = next_task++; task < tasks; task = next_task++) {
      const int64_t kv = task / part_count;
      const Part& part = parts[task % part_count];
      const int64_t first = part.first, count = part.end - part.first;
      const int64_t reference = reference_of[part.sequence];
      const T* keys_base = k + kv * stored * dim;
      const T* values_base = v + kv * stored * dim;
      if (Blocks::kScaledQueries) scaled.assign(count * groups * dim, 0.f);
      acc.assign(count * groups * dim, 0.f);
      vectors.resize(count * groups);
      int64_t longest = 0;
      for (int64_t r = 0; r < count; ++r) {
        const T* row_query = q + ((first + r) * heads + kv * groups) * dim;
        if (Blocks::kScaledQueries)
          for (int64_t i = 0; i < groups * dim; ++i)
            scaled[r * groups * dim + i] = to_float(row_query[i]) * static_cast<float>(scale);
        for (int64_t h = 0; h < groups; ++h) {
          const int64_t index = r * groups + h;
          vectors[index] = Vector{scaled.data() + index * dim, row_query + h * dim,
                                  -std::numeric_limits<float>::infinity(), 0.f, acc.data() + index * dim};
        }
        longest = std::max(longest, count_of[first + r]);
      }
      const int64_t reference_columns = count_of[reference];
      for (int64_t start = 0; start < longest; start += kBlock) {
        // The vectors of rows whose columns here are the reference row's: all kBlock of them, or a
        // prompt row's last block, the reference's cut short (its columns past its size are scored
        // but weighed 0, so a row gets the bits of a block loaded for it alone).
        sharing.clear();
        sizes.clear();
        for (int64_t r = 0; r < count; ++r) {
          const int64_t row = first + r, size = std::min(kBlock, count_of[row] - start);
          if (size > 0 && start + size <= shared_of[row])
            for (int64_t h = 0; h < groups; ++h) {
              sharing.push_back(&vectors[r * groups + h]);
              sizes.push_back(size);
            }
        }
        if (!sharing.empty()) {
          if (start + kBlock < reference_columns)
            prefetch_block(keys_base, values_base, position + start_of[reference] + start + kBlock,
                           std::min(kBlock, reference_columns - start - kBlock), dim);
          blocks->load(keys_base, values_base, position + start_of[reference] + start,
                       std::min(kBlock, reference_columns - start));
          blocks->step(sharing.data(), sharing.size(), sizes.data());
        }
        for (int64_t r = 0; r < count; ++r) {  // blocks of a row's own (a tree node off the reference's branch)
          const int64_t row = first + r, size = std::min(kBlock, count_of[row] - start);
          if (size <= 0 || start + size <= shared_of[row]) continue;
          int64_t own_sizes[kMaxGroup];
          for (int64_t h = 0; h < groups; ++h) {
            own[h] = &vectors[r * groups + h];
            own_sizes[h] = size;
          }
          blocks->load(keys_base, values_base, position + start_of[row] + start, size);
          blocks->step(own, groups, own_sizes);
        }
      }
      for (int64_t r = 0; r < count; ++r) {
        T* row_out = o + ((first + r) * heads + kv * groups) * dim;
        for (int64_t h = 0; h < groups; ++h) {
          const Vector& vector = vectors[r * groups + h];
          for (int64_t i = 0; i < dim; ++i) put(row_out + h * dim + i, vector.acc[i] / vector.total);
        }
      }
    }
  });
}

// query [rows, heads, dim]; keys, values [kv_heads, stored, dim] (one layer of the cache). Row r attends
// positions[starts[r] : starts[r] + counts[r]], storage positions in position order (each in [0,
// stored): the caller checks once a pass, not every layer; rows may share a list). sequences [S + 1]:
// rows [sequences[s], sequences[s + 1]) are one sequence's; references [S]: the row whose list gives
// the blocks they share; shared [rows]: how many leading positions of a row's list are the
// reference's. Returns [rows, heads, dim] in the query's dtype.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& positions, const at::Tensor& starts, const at::Tensor& counts,
                           const at::Tensor& sequences, const at::Tensor& references, const at::Tensor& shared,
                           double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "query [rows, heads, d], keys/values [kv_heads, stored, d]");
  TORCH_CHECK(query.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(), "one dtype");
  for (const at::Tensor* index : {&positions, &starts, &counts, &sequences, &references, &shared})
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous(), "int64 contiguous index tensors");
  const int64_t rows = query.size(0);
  TORCH_CHECK(starts.numel() == rows && counts.numel() == rows && shared.numel() == rows, "one start, count and shared a row");
  TORCH_CHECK(sequences.numel() == references.numel() + 1 && sequences[0].item<int64_t>() == 0 &&
              sequences[-1].item<int64_t>() == rows, "sequences must split the rows");
  const int64_t dim = query.size(2);
  TORCH_CHECK(dim <= kMaxDim && keys.size(2) == dim, "head dimension at most 256");
  TORCH_CHECK(query.size(1) % keys.size(0) == 0 && query.size(1) / keys.size(0) <= kMaxGroup, "query heads per kv head");
  at::Tensor out = at::empty_like(query);
  with_element_type(query.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
#ifdef SPECSERVE_AMX
    if constexpr (std::is_same_v<T, uint16_t>)
      if (dim % 32 == 0 && amx_ready())
        return run<T, AmxBlocks>(query, keys, values, positions, starts, counts, sequences, references, shared,
                                 scale, out);
#endif
    run<T, FloatBlocks<T>>(query, keys, values, positions, starts, counts, sequences, references, shared, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("paged_attention(Tensor query, Tensor keys, Tensor values, Tensor positions, Tensor starts, Tensor counts, "
        "Tensor sequences, Tensor references, Tensor shared, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
