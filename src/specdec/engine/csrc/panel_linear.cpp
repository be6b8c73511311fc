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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the widening loads below; other CPUs take the portable loop
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

constexpr int PANEL = 64;                  // output columns per panel: 4 vectors of 16 floats
constexpr int VECTORS = PANEL / 16;
constexpr int ROW_BLOCK = 6;               // 6 rows x 4 vectors = 24 accumulators in registers
constexpr int PREFETCH_BYTES = 16384;      // how far ahead in the panel's stream (measured: 8-16 KiB best)

typedef float vec __attribute__((vector_size(64)));
typedef float vec_unaligned __attribute__((vector_size(64), aligned(4)));

inline vec splat(float x) { return vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

typedef int32_t ivec __attribute__((vector_size(64)));

// 16 codes widened to 16 int32 lanes. GCC scalarizes __builtin_convertvector from bytes (one load and
// insert per lane: the 4-bit kernel ran no faster than float32); the widening loads are spelled out.
#if defined(__AVX512F__)
inline ivec widen_u8(const void* p) { return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_s8(const void* p) { return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_u16(const void* p) { return (ivec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
inline ivec join(__m256i low, __m256i high) {
  ivec r;
  std::memcpy(&r, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &high, 32);
  return r;
}
inline ivec widen_u8(const void* p) {
  const char* c = static_cast<const char*>(p);
  return join(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)c)),
              _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8))));
}
inline ivec widen_s8(const void* p) {
  const char* c = static_cast<const char*>(p);
  return join(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)c)),
              _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8))));
}
inline ivec widen_u16(const void* p) {
  const char* c = static_cast<const char*>(p);
  return join(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)c)),
              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(c + 16))));
}
#else
template <class T>
inline ivec widen(const void* p) {
  T values[16];
  std::memcpy(values, p, sizeof(values));
  ivec r;
  for (int i = 0; i < 16; ++i) r[i] = values[i];
  return r;
}
inline ivec widen_u8(const void* p) { return widen<uint8_t>(p); }
inline ivec widen_s8(const void* p) { return widen<int8_t>(p); }
inline ivec widen_u16(const void* p) { return widen<uint16_t>(p); }
#endif

// A decoder gives vectors FIRST .. FIRST + VECS - 1 of input k of one panel (16 columns each); `stream`
// is what the prefetch runs ahead on (bytes per k: STRIDE). DECODES: decoding costs more than the
// multiply-adds of a few rows, so past ROW_BLOCK rows the kernel takes half panels for up to
// HALF_ROW_BLOCK rows at a time and decodes each weight once (float32 has nothing to decode).
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
    if constexpr (VECS == VECTORS) {  // each byte widened once for both its nibbles
      const ivec low = widen_u8(c), high = widen_u8(c + 16);
      const ivec q[VECTORS] = {low & 15, high & 15, low >> 4, high >> 4};
      for (int v = 0; v < VECTORS; ++v) w[v] = __builtin_convertvector(q[v], vec) * d[v] + m[v];
    } else {
      for (int i = 0; i < VECS; ++i) {
        const int v = FIRST + i;  // bytes 0-15 or 16-31, low or high nibbles
        const ivec q = (widen_u8(c + (v & 1) * 16) >> ((v >> 1) * 4)) & 15;
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
      w[i] = __builtin_convertvector(widen_s8(codes + k * PANEL + (FIRST + i) * 16), vec) * d[FIRST + i];
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
      const ivec bits = widen_u16(panel + k * PANEL + (FIRST + i) * 16) << 16;
      w[i] = __builtin_bit_cast(vec, bits);
    }
  }
};

constexpr int HALF_ROW_BLOCK = 12;  // 12 rows x 2 vectors = 24 accumulators

// rows x (VECS x 16) outputs of one panel, from its vector FIRST; x: rows x K (row stride K); y: rows x
// columns (row stride ldy), columns <= VECS x 16.
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
#pragma GCC unroll 4
      for (int v = 0; v < VECS; ++v) acc[r][v] += b * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    if (columns == VECS * 16) {
      for (int v = 0; v < VECS; ++v) *reinterpret_cast<vec_unaligned*>(y + r * ldy + v * 16) = acc[r][v];
    } else {  // the last panel of a layer whose width is not a multiple of PANEL
      float tail[VECS * 16];
      for (int v = 0; v < VECS; ++v) *reinterpret_cast<vec_unaligned*>(tail + v * 16) = acc[r][v];
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

// y (M, out_features) = x (M, K) through panels p = 0..P-1, `weights_of(p)` each panel's decoder.
template <class WeightsOf>
torch::Tensor run(const torch::Tensor& x, int64_t P, int64_t out_features, WeightsOf weights_of) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the panels (torch's own OpenMP pool and thread count): each streams its own weights.
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const auto weights = weights_of(p);
      const int64_t columns = std::min<int64_t>(PANEL, out_features - p * PANEL);
      float* yp_panel = yp + p * PANEL;
      if constexpr (std::decay_t<decltype(weights)>::DECODES) {
        if (M > ROW_BLOCK) {
          for (int64_t r0 = 0; r0 < M; r0 += HALF_ROW_BLOCK) {
            const int rows = static_cast<int>(std::min<int64_t>(HALF_ROW_BLOCK, M - r0));
            float* y0 = yp_panel + r0 * out_features;
            dispatch<HALF_ROW_BLOCK, 0, VECTORS / 2>(rows, xp + r0 * K, K, weights, y0, out_features,
                                                     std::min<int64_t>(PANEL / 2, columns), r0 == 0);
            if (columns > PANEL / 2) {
              dispatch<HALF_ROW_BLOCK, VECTORS / 2, VECTORS / 2>(rows, xp + r0 * K, K, weights, y0 + PANEL / 2,
                                                                 out_features, columns - PANEL / 2, false);
            }
          }
          continue;
        }
      }
      for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
        const int rows = static_cast<int>(std::min<int64_t>(ROW_BLOCK, M - r0));
        dispatch<ROW_BLOCK, 0, VECTORS>(rows, xp + r0 * K, K, weights, yp_panel + r0 * out_features,
                                        out_features, columns, r0 == 0);
      }
    }
  });
  return y;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "panel_linear: x must be a contiguous 2-d float32 CPU tensor");
}

void check_panels(const torch::Tensor& t, torch::ScalarType type, int64_t K, int64_t width, int64_t out_features,
                  const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 3 && t.is_contiguous() && t.size(1) == K &&
                  t.size(2) == width && t.size(0) * PANEL >= out_features && (t.size(0) - 1) * PANEL < out_features,
              "panel_linear: ", what, " must be (ceil(out_features / ", PANEL, "), ", K, ", ", width, ") of ", type);
}

}  // namespace

// x: (M, K) float32 contiguous; panels: (P, K, PANEL) float32 contiguous; returns (M, out_features).
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  check_x(x);
  check_panels(panels, torch::kFloat, x.size(1), PANEL, out_features, "panels");
  const float* wp = panels.data_ptr<float>();
  const int64_t K = x.size(1);
  return run(x, panels.size(0), out_features, [=](int64_t p) { return Float32{wp + p * K * PANEL}; });
}

// codes: (P, K, PANEL / 2) uint8; scale, offset: (P, K / 32, PANEL) float32.
torch::Tensor panel_linear_q4(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                              const torch::Tensor& offset, int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "panel_linear_q4: in_features must be a multiple of 32");
  check_panels(codes, torch::kByte, K, PANEL / 2, out_features, "codes");
  check_panels(scale, torch::kFloat, K / 32, PANEL, out_features, "scale");
  check_panels(offset, torch::kFloat, K / 32, PANEL, out_features, "offset");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* d = scale.data_ptr<float>();
  const float* m = offset.data_ptr<float>();
  return run(x, codes.size(0), out_features, [=](int64_t p) {
    return Q4{c + p * K * (PANEL / 2), d + p * (K / 32) * PANEL, m + p * (K / 32) * PANEL};
  });
}

// codes: (P, K, PANEL) int8; scale: (P, K / 32, PANEL) float32.
torch::Tensor panel_linear_q8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                              int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "panel_linear_q8: in_features must be a multiple of 32");
  check_panels(codes, torch::kChar, K, PANEL, out_features, "codes");
  check_panels(scale, torch::kFloat, K / 32, PANEL, out_features, "scale");
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* d = scale.data_ptr<float>();
  return run(x, codes.size(0), out_features, [=](int64_t p) {
    return Q8{c + p * K * PANEL, d + p * (K / 32) * PANEL};
  });
}

// panels: (P, K, PANEL) bfloat16.
torch::Tensor panel_linear_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  check_x(x);
  const int64_t K = x.size(1);
  check_panels(panels, torch::kBFloat16, K, PANEL, out_features, "panels");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  return run(x, panels.size(0), out_features, [=](int64_t p) { return BFloat16{w + p * K * PANEL}; });
}

int64_t panel_width() { return PANEL; }
