// y = x @ W^T on the CPU, float32, with W packed once into column panels (panel_linear.py).
//
// Why: a decode step or a verify of a few rows streams every weight once and does almost no arithmetic
// per byte; the BLAS kernels this project gets from torch (MKL) and oneDNN lose a third or more of the
// memory bandwidth at 2-9 rows, which is what speculative decoding's verify runs. Here each panel of
// PANEL output columns is one contiguous stream (panels[p][k][c] = W[p * PANEL + c][k]), read once per
// block of up to ROW_BLOCK rows, with the rows' partial sums held in registers and the panel prefetched
// ahead into L2: 1-6 rows cost about what 1 row costs, 9 rows 1.3x (docs/results/2026-11-29-panel-linear.md).
//
// Every output element is summed in the same order (k = 0, 1, ..., K-1, one fused multiply-add each)
// whatever the row count, the row's place in the batch and the thread split: a row's product does not
// depend on what else is in the forward (through this layer, a verify's rows equal the steps one at a
// time bit for bit; the attention's kernels for several queries and for one still round differently).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int PANEL = 64;                  // output columns per panel: 4 vectors of 16 floats
constexpr int VECTORS = PANEL / 16;
constexpr int ROW_BLOCK = 6;               // 6 rows x 4 vectors = 24 accumulators in registers
constexpr int PREFETCH_BYTES = 16384;      // how far ahead in the panel's stream (measured: 8-16 KiB best)

typedef float vec __attribute__((vector_size(64)));
typedef float vec_unaligned __attribute__((vector_size(64), aligned(4)));

inline vec splat(float x) { return vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// rows x PANEL outputs of one panel; x: rows x K (row stride K); y: rows x columns (row stride ldy).
template <int ROWS>
void panel_block(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t columns,
                 bool prefetch) {
  vec acc[ROWS][VECTORS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * PANEL;
    if (prefetch) {  // only the first row block streams from memory; later ones find the panel in L2
#pragma GCC unroll 4
      for (int v = 0; v < VECTORS; ++v) __builtin_prefetch(wk + PREFETCH_BYTES / 4 + v * 16, 0, 2);
    }
    vec w[VECTORS];
#pragma GCC unroll 4
    for (int v = 0; v < VECTORS; ++v) w[v] = reinterpret_cast<const vec*>(wk)[v];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const vec b = splat(x[r * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < VECTORS; ++v) acc[r][v] += b * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    if (columns == PANEL) {
      for (int v = 0; v < VECTORS; ++v) *reinterpret_cast<vec_unaligned*>(y + r * ldy + v * 16) = acc[r][v];
    } else {  // the last panel of a layer whose width is not a multiple of PANEL
      float tail[PANEL];
      for (int v = 0; v < VECTORS; ++v) *reinterpret_cast<vec_unaligned*>(tail + v * 16) = acc[r][v];
      std::copy(tail, tail + columns, y + r * ldy);
    }
  }
}

template <int ROWS>
void dispatch(int rows, const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t columns,
              bool prefetch) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return dispatch<ROWS - 1>(rows, x, K, panel, y, ldy, columns, prefetch);
  }
  panel_block<ROWS>(x, K, panel, y, ldy, columns, prefetch);
}

}  // namespace

// x: (M, K) float32 contiguous; panels: (P, K, PANEL) float32 contiguous; returns (M, out_features).
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "panel_linear: x must be a contiguous 2-d float32 CPU tensor");
  TORCH_CHECK(panels.scalar_type() == torch::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(2) == PANEL && panels.size(1) == x.size(1) &&
                  panels.size(0) * PANEL >= out_features && (panels.size(0) - 1) * PANEL < out_features,
              "panel_linear: panels must be (ceil(out_features / ", PANEL, "), in_features, ", PANEL, ") float32");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = torch::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the panels (torch's own OpenMP pool and thread count): each streams its own weights.
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * PANEL;
      const int64_t columns = std::min<int64_t>(PANEL, out_features - p * PANEL);
      for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
        const int rows = static_cast<int>(std::min<int64_t>(ROW_BLOCK, M - r0));
        dispatch<ROW_BLOCK>(rows, xp + r0 * K, K, panel, yp + r0 * out_features + p * PANEL, out_features,
                            columns, r0 == 0);
      }
    }
  });
  return y;
}

int64_t panel_width() { return PANEL; }
