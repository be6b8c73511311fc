// y = x @ W^T on the CPU, float32, with W packed once into column panels (panel_linear.py).
//
// Why: a decode step or a verify of a few rows streams every weight once and does almost no arithmetic
// per byte; the BLAS kernels this project gets from torch (MKL) and oneDNN lose a third or more of the
// memory bandwidth at 2-9 rows, which is what speculative decoding's verify runs. Here each panel of
// PANEL output columns is one contiguous stream (panels[p][k][c] = W[p * PANEL + c][k]), read once per
// block of up to ROW_BLOCK rows, with the rows' partial sums held in registers and the panel prefetched
// ahead into L2: 1-6 rows cost about what 1 row costs, 9 rows 1.3x (docs/results/2026-11-29-panel-linear.md).
//
// The weights may be held encoded, each decoded to exactly the float32 it stands for before its
// multiply-add (panel_linear.py finds the encoding at load and checks that every weight decodes to
// itself): 4-bit codes with a float32 scale and offset per 32 inputs of a column (w = q * d + m, GGUF's
// Q4_1 blocks, which is what the default pair's weights are), 8-bit codes with a scale (w = q * d, Q8_0),
// or bfloat16 (the top half of the float32). In Q4_1, q * d is exact in float32 (a 4-bit integer times a
// half-precision scale), so fused or not, q * d + m rounds once, as the loader's check computed it; Q8_0's
// q * d is one multiplication: the products are the float32 kernel's bit for bit, for a fifth to a half of
// the bytes streamed.
//
// Every output element is summed in the same order (k = 0, 1, ..., K-1, one fused multiply-add each)
// whatever the row count, the row's place in the batch and the thread split: a row's product does not
// depend on what else is in the forward (through this layer, a verify's rows equal the steps one at a
// time bit for bit; the attention's kernels for several queries and for one still round differently).
#include "kernels.h"
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the widening loads below; other CPUs take the portable loop
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// A vector is one register of the widest the compiler may use: 16 floats with AVX-512, 8 with AVX (AVX2 and
// FMA on AMD's Zen 1-3 and Intel's client CPUs), 4 elsewhere (SSE, NEON). Wider than the registers, GCC's
// generic vectors spill: with 16-float vectors on an AVX2 CPU (Zen 3) every accumulator went through the
// stack and general registers, and the kernel ran 3-10x slower than its stream
// (docs/results/2026-11-30-avx2-panels.md).
#if defined(__AVX512F__)
constexpr int LANES = 16;
constexpr int REGISTERS = 32;
#elif defined(__AVX__)
constexpr int LANES = 8;
constexpr int REGISTERS = 16;
#else
constexpr int LANES = 4;
constexpr int REGISTERS = 16;  // SSE's xmm0-15; NEON has 32, counted as 16 to stay safe
#endif

constexpr int PANEL = 64;                  // output columns per panel
constexpr int VECTORS = PANEL / LANES;
constexpr int PREFETCH_BYTES = 16384;      // how far ahead in the panel's stream (measured: 8-16 KiB best)

// A block of rows x (vectors of a panel) keeps its sums in registers. The rows of a block share one pass over
// the panel's weights (each decoded once); a panel wider than a block's vectors is passed over again from L2
// (only the first pass streams it from memory, prefetching the whole panel). Measured per ISA
// (docs/results/2026-11-29-panel-linear.md, docs/results/2026-11-30-avx2-panels.md): with AVX-512, the whole
// panel (4 vectors) for 6 rows, and decoded weights past 6 rows in half panels for 12 (the MANY shape: fewer
// registers hold sums, more hold decoded weights); with 16 registers, the whole panel for 2 rows.
//
// With 16 registers, past 2 rows a panel is run in tiles (SPECDEC_TILED): TILE_K inputs of it decoded once
// into a float32 tile that stays in L1, every row block over that tile, the blocks' sums kept in memory
// between tiles (each output still one chain of multiply-adds over k = 0 ... K-1). The multiply-adds of
// several rows then read their weights from L1 instead of passing over the panel once per 2 rows from L2
// (docs/results/2026-11-30-avx2-tiles.md).
#if defined(__AVX512F__)
#define SPECDEC_TILED 0
constexpr int ROW_BLOCK = 6, BLOCK_VECTORS = VECTORS;
constexpr int MANY_ROW_BLOCK = 12, MANY_VECTORS = VECTORS / 2;
static_assert(VECTORS % MANY_VECTORS == 0 && MANY_ROW_BLOCK * MANY_VECTORS <= REGISTERS,
              "passes must tile a panel, a block's sums fit the registers");
#else
#define SPECDEC_TILED 1
constexpr int ROW_BLOCK = 2, BLOCK_VECTORS = VECTORS < 8 ? VECTORS : 8;
constexpr int TILE_K = 64;     // inputs per tile: 64 x 64 float32 = 16 KiB of L1 (32 KiB) beside x and the sums
                               // (measured: 32 and 128 no better)
constexpr int TILE_ROWS = 6;   // a tile block's rows: 6 x 2 vectors = 12 sums, 2 weights, 1 broadcast
// a tile block's vectors for its rows: its sums, its weights (held in registers) and the broadcast must fit
constexpr int tile_vectors(int rows) { return std::min(VECTORS, rows <= 2 ? 4 : 2); }
static_assert(TILE_ROWS * tile_vectors(TILE_ROWS) + tile_vectors(TILE_ROWS) + 1 <= REGISTERS &&
              2 * tile_vectors(2) + tile_vectors(2) + 1 <= REGISTERS, "a tile block must fit the registers");
#endif
static_assert(VECTORS % BLOCK_VECTORS == 0, "passes must tile a panel");
static_assert(ROW_BLOCK * BLOCK_VECTORS <= REGISTERS, "a block's sums must fit the registers");

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef float vec_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4)));

// x in every lane. Spelled out where the ISA has a broadcast: GCC built the generic form lane by lane
// (eight vinsertps a splat on AVX2), more instructions than the block's multiply-adds.
inline vec splat(float x) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(x);
#else
  vec v;
  for (int i = 0; i < LANES; ++i) v[i] = x;
  return v;
#endif
}

// LANES codes widened to int32 lanes. GCC scalarizes __builtin_convertvector from bytes (one load and
// insert per lane: the 4-bit kernel ran no faster than float32); the widening loads are spelled out.
#if defined(__AVX512F__)
inline ivec widen_u8(const void* p) { return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_s8(const void* p) { return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_u16(const void* p) { return (ivec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
inline ivec widen_u8(const void* p) { return (ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec widen_s8(const void* p) { return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec widen_u16(const void* p) { return (ivec)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
#else
template <class T>
inline ivec widen(const void* p) {
  T values[LANES];
  std::memcpy(values, p, sizeof(values));
  ivec r;
  for (int i = 0; i < LANES; ++i) r[i] = values[i];
  return r;
}
inline ivec widen_u8(const void* p) { return widen<uint8_t>(p); }
inline ivec widen_s8(const void* p) { return widen<int8_t>(p); }
inline ivec widen_u16(const void* p) { return widen<uint16_t>(p); }
#endif

// A decoder gives vectors FIRST .. FIRST + VECS - 1 of input k of one panel (LANES columns each); `stream`
// is what the prefetch runs ahead on (bytes per k: STRIDE). DECODES: decoding costs more than the
// multiply-adds of a few rows, so past ROW_BLOCK rows each weight is decoded once for all rows (in the MANY
// blocks with AVX-512, into a tile otherwise); float32 has nothing to decode.
struct Float32 {
  const float* panel;
  static constexpr int STRIDE = PANEL * 4;
  static constexpr bool DECODES = false;
  const void* stream(int64_t k) const { return panel + k * PANEL; }
  template <int FIRST, int VECS>
  void decode(int64_t k, vec* w) const {
    for (int v = 0; v < VECS; ++v) w[v] = reinterpret_cast<const vec*>(panel + k * PANEL)[FIRST + v];
  }
};

// codes[k][j]: column j in the low nibble, column j + 32 in the high one; scale/offset[k / 32][column].
struct Q4 {
  const uint8_t* codes;
  const float* scale;
  const float* offset;
  static constexpr int STRIDE = PANEL / 2;
  static constexpr bool DECODES = true;
  const void* stream(int64_t k) const { return codes + k * (PANEL / 2); }
  template <int FIRST, int VECS>
  void decode(int64_t k, vec* w) const {
    const uint8_t* c = codes + k * (PANEL / 2);
    const vec* d = reinterpret_cast<const vec*>(scale + (k / 32) * PANEL);
    const vec* m = reinterpret_cast<const vec*>(offset + (k / 32) * PANEL);
    constexpr int GROUPS = 32 / LANES;  // vectors of columns 0-31 (low nibbles); the rest, high nibbles
    if constexpr (VECS == VECTORS) {  // each byte widened once for both its nibbles
      ivec wide[GROUPS];
      for (int g = 0; g < GROUPS; ++g) wide[g] = widen_u8(c + g * LANES);
      for (int v = 0; v < VECTORS; ++v) {
        const ivec q = v < GROUPS ? wide[v] & 15 : wide[v - GROUPS] >> 4;
        w[v] = __builtin_convertvector(q, vec) * d[v] + m[v];
      }
    } else {
      for (int i = 0; i < VECS; ++i) {
        const int v = FIRST + i;  // its bytes, low or high nibbles
        const ivec q = (widen_u8(c + (v % GROUPS) * LANES) >> ((v / GROUPS) * 4)) & 15;
        w[i] = __builtin_convertvector(q, vec) * d[v] + m[v];
      }
    }
  }
};

struct Q8 {
  const int8_t* codes;
  const float* scale;
  static constexpr int STRIDE = PANEL;
  static constexpr bool DECODES = true;
  const void* stream(int64_t k) const { return codes + k * PANEL; }
  template <int FIRST, int VECS>
  void decode(int64_t k, vec* w) const {
    const vec* d = reinterpret_cast<const vec*>(scale + (k / 32) * PANEL);
    for (int i = 0; i < VECS; ++i) {
      w[i] = __builtin_convertvector(widen_s8(codes + k * PANEL + (FIRST + i) * LANES), vec) * d[FIRST + i];
    }
  }
};

struct BFloat16 {
  const uint16_t* panel;
  static constexpr int STRIDE = PANEL * 2;
  static constexpr bool DECODES = true;
  const void* stream(int64_t k) const { return panel + k * PANEL; }
  template <int FIRST, int VECS>
  void decode(int64_t k, vec* w) const {
    for (int i = 0; i < VECS; ++i) {
      const ivec bits = widen_u16(panel + k * PANEL + (FIRST + i) * LANES) << 16;
      w[i] = __builtin_bit_cast(vec, bits);
    }
  }
};

// rows x (VECS x LANES) outputs of one panel, from its vector FIRST; x: rows x K (row stride K); y: rows x
// columns (row stride ldy), columns <= VECS x LANES.
template <int ROWS, int FIRST, int VECS, class Weights>
void panel_block(const float* x, int64_t K, const Weights& weights, float* y, int64_t ldy,
                 int64_t columns, bool prefetch) {
  vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = vec{};
  constexpr int64_t AHEAD = PREFETCH_BYTES / (PANEL * 4);  // in k: as far ahead as the float32 stream's
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch) {  // only the first row block streams from memory; later ones find the panel in L2
      const char* ahead = static_cast<const char*>(weights.stream(k + AHEAD));
#pragma GCC unroll 4
      for (int line = 0; line < (Weights::STRIDE + 63) / 64; ++line) __builtin_prefetch(ahead + line * 64, 0, 2);
    }
    vec w[VECS];
    weights.template decode<FIRST, VECS>(k, w);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const vec b = splat(x[r * K + k]);
#pragma GCC unroll 8
      for (int v = 0; v < VECS; ++v) acc[r][v] += b * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    if (columns == VECS * LANES) {
      for (int v = 0; v < VECS; ++v) *reinterpret_cast<vec_unaligned*>(y + r * ldy + v * LANES) = acc[r][v];
    } else {  // the last panel of a layer whose width is not a multiple of PANEL
      float tail[VECS * LANES];
      for (int v = 0; v < VECS; ++v) *reinterpret_cast<vec_unaligned*>(tail + v * LANES) = acc[r][v];
      std::copy(tail, tail + columns, y + r * ldy);
    }
  }
}

template <int ROWS, int FIRST, int VECS, class Weights>
void dispatch(int rows, const float* x, int64_t K, const Weights& weights, float* y, int64_t ldy,
              int64_t columns, bool prefetch) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return dispatch<ROWS - 1, FIRST, VECS>(rows, x, K, weights, y, ldy, columns, prefetch);
  }
  panel_block<ROWS, FIRST, VECS>(x, K, weights, y, ldy, columns, prefetch);
}

// A block of rows over the panel's vectors FIRST onwards, PASS_VECTORS at a time (the first pass streams
// and prefetches; the later ones read the panel from L2); y: the panel's first column of the block's first row.
template <int ROWS, int PASS_VECTORS, int FIRST = 0, class Weights>
void passes(int rows, const float* x, int64_t K, const Weights& weights, float* y, int64_t ldy, int64_t columns,
            bool prefetch) {
  if constexpr (FIRST < VECTORS) {
    if (columns <= FIRST * LANES) return;
    dispatch<ROWS, FIRST, PASS_VECTORS>(rows, x, K, weights, y + FIRST * LANES, ldy,
                                        std::min<int64_t>(PASS_VECTORS * LANES, columns - FIRST * LANES),
                                        prefetch && FIRST == 0);
    passes<ROWS, PASS_VECTORS, FIRST + PASS_VECTORS>(rows, x, K, weights, y, ldy, columns, prefetch);
  }
}

#if SPECDEC_TILED
// ROWS x VECS sums of a tile block (vectors FIRST onwards of the panel), over kc inputs of the tile; x: the
// block's first row at the tile's first input (row stride K); sums: the block's first row (row stride VECTORS).
template <int ROWS, int VECS>
void tile_block(const float* x, int64_t K, const vec* tile, int kc, vec* sums, int first) {
  vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = sums[r * VECTORS + first + v];
  for (int k = 0; k < kc; ++k) {
    vec w[VECS];
    for (int v = 0; v < VECS; ++v) {
      w[v] = tile[k * VECTORS + first + v];
#if defined(__x86_64__)
      // in a register: GCC would otherwise read it from L1 once per row (a 4-row block then made 12 loads for
      // its 8 multiply-adds and ran at the loads' pace)
      asm("" : "+x"(w[v]));
#endif
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const vec b = splat(x[r * K + k]);
#pragma GCC unroll 8
      for (int v = 0; v < VECS; ++v) acc[r][v] += b * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) sums[r * VECTORS + first + v] = acc[r][v];
}

template <int ROWS>
void tile_rows(int rows, const float* x, int64_t K, const vec* tile, int kc, vec* sums) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return tile_rows<ROWS - 1>(rows, x, K, tile, kc, sums);
  }
  constexpr int VECS = tile_vectors(ROWS);
  for (int first = 0; first < VECTORS; first += VECS) tile_block<ROWS, VECS>(x, K, tile, kc, sums, first);
}

// One panel's M x columns outputs in tiles of TILE_K inputs (see SPECDEC_TILED); y: the panel's first column
// of row 0 (row stride ldy).
template <class Weights>
void tiled_panel(const Weights& weights, const float* x, int64_t M, int64_t K, float* y, int64_t ldy,
                 int64_t columns) {
  thread_local std::vector<vec> sums;
  sums.assign(M * VECTORS, vec{});
  alignas(64) vec tile[TILE_K * VECTORS];
  const int64_t blocks = (M + TILE_ROWS - 1) / TILE_ROWS, block_rows = (M + blocks - 1) / blocks;  // even blocks
  constexpr int64_t AHEAD = PREFETCH_BYTES / (PANEL * 4);  // in k: as far ahead as the float32 stream's
  for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
    const int kc = static_cast<int>(std::min<int64_t>(TILE_K, K - k0));
    // decoded (float32 weights: copied) in one sequential pass, which the prefetch runs ahead of: the blocks'
    // reads, a cache line every 256 bytes, then hit L1
    for (int k = 0; k < kc; ++k) {
      const char* ahead = static_cast<const char*>(weights.stream(k0 + k + AHEAD));
#pragma GCC unroll 4
      for (int line = 0; line < (Weights::STRIDE + 63) / 64; ++line) __builtin_prefetch(ahead + line * 64, 0, 2);
      weights.template decode<0, VECTORS>(k0 + k, tile + k * VECTORS);
    }
    for (int64_t r0 = 0; r0 < M; r0 += block_rows) {
      tile_rows<TILE_ROWS>(static_cast<int>(std::min(block_rows, M - r0)), x + r0 * K + k0, K, tile, kc,
                           sums.data() + r0 * VECTORS);
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const float* row = reinterpret_cast<const float*>(sums.data() + r * VECTORS);
    std::copy(row, row + columns, y + r * ldy);
  }
}
#endif

// y (M, out_features) = x (M, K) through panels p = 0..P-1, `weights_of(p)` each panel's decoder.
template <class WeightsOf>
at::Tensor run(const at::Tensor& x, int64_t P, int64_t out_features, WeightsOf weights_of) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the panels (torch's own OpenMP pool and thread count): each streams its own weights.
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const auto weights = weights_of(p);
      const int64_t columns = std::min<int64_t>(PANEL, out_features - p * PANEL);
      float* yp_panel = yp + p * PANEL;
#if SPECDEC_TILED
      // float32 weights have nothing to decode: up to 8 rows, 2-row passes over the panel in L2 measured faster
      if (M > (std::decay_t<decltype(weights)>::DECODES ? ROW_BLOCK : 8)) {
        tiled_panel(weights, xp, M, K, yp_panel, out_features, columns);
        continue;
      }
#else
      if constexpr (std::decay_t<decltype(weights)>::DECODES) {
        if (M > ROW_BLOCK) {
          for (int64_t r0 = 0; r0 < M; r0 += MANY_ROW_BLOCK) {
            const int rows = static_cast<int>(std::min<int64_t>(MANY_ROW_BLOCK, M - r0));
            passes<MANY_ROW_BLOCK, MANY_VECTORS>(rows, xp + r0 * K, K, weights, yp_panel + r0 * out_features,
                                                 out_features, columns, r0 == 0);
          }
          continue;
        }
      }
#endif
      for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
        const int rows = static_cast<int>(std::min<int64_t>(ROW_BLOCK, M - r0));
        passes<ROW_BLOCK, BLOCK_VECTORS>(rows, xp + r0 * K, K, weights, yp_panel + r0 * out_features, out_features,
                                         columns, r0 == 0);
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "panel_linear: x must be a contiguous 2-d float32 CPU tensor");
}

void check_panels(const at::Tensor& t, at::ScalarType type, int64_t K, int64_t width, int64_t out_features,
                  const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 3 && t.is_contiguous() && t.size(1) == K &&
                  t.size(2) == width && t.size(0) * PANEL >= out_features && (t.size(0) - 1) * PANEL < out_features,
              "panel_linear: ", what, " must be (ceil(out_features / ", PANEL, "), ", K, ", ", width, ") of ", type);
}

}  // namespace

// x: (M, K) float32 contiguous; panels: (P, K, PANEL) float32 contiguous; returns (M, out_features).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  check_x(x);
  check_panels(panels, at::kFloat, x.size(1), PANEL, out_features, "panels");
  const float* wp = panels.data_ptr<float>();
  const int64_t K = x.size(1);
  return run(x, panels.size(0), out_features, [=](int64_t p) { return Float32{wp + p * K * PANEL}; });
}

// codes: (P, K, PANEL / 2) uint8; scale, offset: (P, K / 32, PANEL) float32.
at::Tensor panel_linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& offset, int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "panel_linear_q4: in_features must be a multiple of 32");
  check_panels(codes, at::kByte, K, PANEL / 2, out_features, "codes");
  check_panels(scale, at::kFloat, K / 32, PANEL, out_features, "scale");
  check_panels(offset, at::kFloat, K / 32, PANEL, out_features, "offset");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* d = scale.data_ptr<float>();
  const float* m = offset.data_ptr<float>();
  return run(x, codes.size(0), out_features, [=](int64_t p) {
    return Q4{c + p * K * (PANEL / 2), d + p * (K / 32) * PANEL, m + p * (K / 32) * PANEL};
  });
}

// codes: (P, K, PANEL) int8; scale: (P, K / 32, PANEL) float32.
at::Tensor panel_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "panel_linear_q8: in_features must be a multiple of 32");
  check_panels(codes, at::kChar, K, PANEL, out_features, "codes");
  check_panels(scale, at::kFloat, K / 32, PANEL, out_features, "scale");
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* d = scale.data_ptr<float>();
  return run(x, codes.size(0), out_features, [=](int64_t p) {
    return Q8{c + p * K * PANEL, d + p * (K / 32) * PANEL};
  });
}

// panels: (P, K, PANEL) bfloat16.
at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  check_panels(panels, at::kBFloat16, K, PANEL, out_features, "panels");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  return run(x, panels.size(0), out_features, [=](int64_t p) { return BFloat16{w + p * K * PANEL}; });
}

int64_t panel_width() { return PANEL; }
