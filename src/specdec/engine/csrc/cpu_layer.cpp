// The pointwise work and the attention of a Llama-family layer on the CPU, float32 (kernels.py's `cpu()`,
// llama_forward.py): each one call over all of a forward's rows.
//
// Why: a decode step of the default pair's target ran 30 layers of a dozen small torch operations each
// (an RMSNorm alone is eight), and on a CPU each costs its dispatch, its allocation and a pass through
// memory whatever the size: over half of the step was that, not the matrix products
// (docs/results/2026-11-30-cpu-layer-kernels.md). The attention reads the
// paged KV pool in place (no window gathered per layer) and sees what `llama_forward.attention_mask`
// says: the keys before `visible`, and a tree's ancestors right after them.
//
// The math is the eager kernels' (kernels.py), summed in a fixed order: a row's result does not depend on
// the other rows of its forward or on the thread that computed it.
#include "kernels.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // splat's broadcasts
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace cpu_layer {

// One vector register of the widest the compiler may use (as csrc/panel_linear.cpp: wider generic vectors
// than the registers spill on an AVX2 CPU): 16 floats with AVX-512, 8 with AVX, 4 otherwise.
#if defined(__AVX512F__)
constexpr int LANES = 16;
#elif defined(__AVX__)
constexpr int LANES = 8;
#else
constexpr int LANES = 4;
#endif

typedef float lanes __attribute__((vector_size(LANES * 4)));
typedef float lanes_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));

inline lanes load(const float* p) { return *reinterpret_cast<const lanes_unaligned*>(p); }

typedef int32_t int_lanes __attribute__((vector_size(LANES * 4)));

// the lanes summed pairwise (halves, then quarters, ...): a fixed order
inline float sum_lanes(lanes v) {
#if defined(__AVX512F__)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#elif defined(__AVX__)
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
#else
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
#endif
  return v[0] + v[1];
}

// sum of a[i] * b[i]: LANES running sums, summed pairwise, then the tail
inline float dot(const float* a, const float* b, int64_t n) {
  lanes acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load(a + i) * load(b + i);
  float s = sum_lanes(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x in every lane; one broadcast where the ISA has it (GCC built the generic form lane by lane on AVX2:
// eight vinsertps, as csrc/panel_linear.cpp's splat)
inline lanes splat(float x) {
#if defined(__AVX512F__)
  return (lanes)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (lanes)_mm256_set1_ps(x);
#else
  lanes v;
  for (int i = 0; i < LANES; ++i) v[i] = x;
  return v;
#endif
}

// the N products summed pairwise: ((0 + 1) + (2 + 3)) + ...
template <int N>
inline lanes pairwise(const lanes* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return pairwise<N / 2>(v) + pairwise<N / 2>(v + N / 2);
  }
}

// exp of LANES values at once (x <= 0 here: scores less their maximum), within 2 ulp of expf: exp(x) =
// 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in two parts, exp(r) by Cephes' degree-6 polynomial.
// A scalar expf per key was most of a verify's attention (the results page above).
inline lanes exp_lanes(lanes x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;  // exp(-87) ~ 1.6e-38: 2^n stays a normal float
  const lanes round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const lanes n = (x * splat(1.44269504088896341f) + round) - round;
  const lanes r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  lanes p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const int_lanes bits = (__builtin_convertvector(n, int_lanes) + 127) << 23;
  lanes scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// w * (x * rsqrt(mean(x^2) + eps)), as kernels.rms_norm (its float32 case)
inline void norm_row(const float* x, const float* w, float* out, int64_t h, float eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * inv);
}

void check(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(),
              "cpu_layer: ", what, " must be a contiguous ", dim, "-d float32 CPU tensor");
}

void check_index(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.is_contiguous(),
              "cpu_layer: ", what, " must be a contiguous 2-d int64 CPU tensor");
}

}  // namespace cpu_layer

// x (N, H), weight (H,) -> (N, H)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  cpu_layer::check(x, 2, "x");
  cpu_layer::check(weight, 1, "weight");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.size(0) == h, "cpu_layer: weight must have ", h, " elements");
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) cpu_layer::norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
  return out;
}

// residual, update (N, H) -> (residual + update, its RMSNorm)
std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& update,
                                        const at::Tensor& weight, double eps) {
  cpu_layer::check(residual, 2, "residual");
  cpu_layer::check(update, 2, "update");
  cpu_layer::check(weight, 1, "weight");
  TORCH_CHECK(residual.sizes() == update.sizes() && weight.size(0) == residual.size(1),
              "cpu_layer: residual and update must be (N, H) alike, weight (H,)");
  const int64_t n = residual.size(0), h = residual.size(1);
  auto sum = at::empty_like(residual);
  auto out = at::empty_like(residual);
  const float *rp = residual.data_ptr<float>(), *up = update.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t i = 0; i < n * h; ++i) sp[i] = rp[i] + up[i];
  for (int64_t r = 0; r < n; ++r) cpu_layer::norm_row(sp + r * h, wp, op + r * h, h, static_cast<float>(eps));
  return {sum, out};
}

// qkv (N, (heads + 2 kv_heads) D), cos / sin (N, D) -> queries (N, heads, D), keys (N, kv_heads, D) with the
// rotary embedding applied: x * cos + rotate_half(x) * sin
std::vector<at::Tensor> rotate_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                     int64_t heads, int64_t kv_heads) {
  cpu_layer::check(qkv, 2, "qkv");
  cpu_layer::check(cos, 2, "cos");
  cpu_layer::check(sin, 2, "sin");
  const int64_t n = qkv.size(0), d = cos.size(1), half = d / 2, width = qkv.size(1);
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == n && sin.sizes() == cos.sizes() && width >= (heads + 2 * kv_heads) * d,
              "cpu_layer: rotate_qk's shapes do not fit");
  auto q = at::empty({n, heads, d}, qkv.options());
  auto k = at::empty({n, kv_heads, d}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float *c = cp + r * d, *s = sp + r * d;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      const float* x = xp + r * width + head * d;
      float* o = head < heads ? qp + (r * heads + head) * d : kp + (r * kv_heads + head - heads) * d;
      for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] + -x[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
    }
  }
  return {q, k};
}

// keys[block[i], offset[i]] = k[i] and values[...] = qkv[i, v_column:] for each of a forward's rows i: the
// rows' new keys and values written into one layer's pool (two advanced-index assignments, torch's
// index_put, cost ~15 us a layer on the 2-core EPYC). keys / values (blocks, block_size, kv_heads, D), k
// (N, kv_heads, D), qkv (N, width), block / offset (B, T) with B T = N.
void store_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k, const at::Tensor& qkv,
              int64_t v_column, const at::Tensor& block, const at::Tensor& offset) {
  cpu_layer::check(keys, 4, "keys");
  cpu_layer::check(values, 4, "values");
  cpu_layer::check(k, 3, "k");
  cpu_layer::check(qkv, 2, "qkv");
  cpu_layer::check_index(block, "block");
  cpu_layer::check_index(offset, "offset");
  const int64_t n = k.size(0), row = k.size(1) * k.size(2), blocks = keys.size(0), block_size = keys.size(1);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(2) * keys.size(3) == row && qkv.size(0) == n &&
                  v_column >= 0 && v_column + row <= qkv.size(1) && block.numel() == n && offset.sizes() == block.sizes(),
              "cpu_layer: store_kv's shapes do not fit");
  const int64_t *bp = block.data_ptr<int64_t>(), *op = offset.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *xp = qkv.data_ptr<float>();
  float *keys_p = keys.data_ptr<float>(), *values_p = values.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(bp[i] >= 0 && bp[i] < blocks && op[i] >= 0 && op[i] < block_size,
                "cpu_layer: a key's place outside the pool");
    const int64_t at = (bp[i] * block_size + op[i]) * row;
    std::copy(kp + i * row, kp + (i + 1) * row, keys_p + at);
    std::copy(xp + i * qkv.size(1) + v_column, xp + i * qkv.size(1) + v_column + row, values_p + at);
  }
}

// gate_up (N, 2I) -> silu(gate) * up (N, I): torch's own vectorized SiLU, then the product in place
at::Tensor silu_mul(const at::Tensor& gate_up) {
  cpu_layer::check(gate_up, 2, "gate_up");
  const int64_t width = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, width)).mul_(gate_up.narrow(1, width, width));
}

// q (B T, heads, D); keys / values one layer's pool (blocks, block_size, kv_heads, D); table (B, NB) each
// sequence's blocks; visible, ancestors (B, T) as llama_forward.Batch holds them -> (B T, heads D): each
// row's attention over the keys before visible[b, t] and, bit j of ancestors[b, t] set, the key at
// visible[b, t] + j. Scores, their softmax and the weighted values in float32, keys in order.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& table, const at::Tensor& visible, const at::Tensor& ancestors,
                              double scale) {
  cpu_layer::check(q, 3, "q");
  cpu_layer::check(keys, 4, "keys");
  cpu_layer::check(values, 4, "values");
  cpu_layer::check_index(table, "table");
  cpu_layer::check_index(visible, "visible");
  cpu_layer::check_index(ancestors, "ancestors");
  const int64_t batch = visible.size(0), rows = visible.size(1), heads = q.size(1), d = q.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2), blocks = table.size(0) ? table.size(1) : 0;
  TORCH_CHECK(q.size(0) == batch * rows && table.size(0) == batch && ancestors.sizes() == visible.sizes() &&
                  keys.sizes() == values.sizes() && keys.size(3) == d && kv_heads > 0 && heads % kv_heads == 0,
              "cpu_layer: paged_attention's shapes do not fit");
  const int64_t groups = heads / kv_heads, window = blocks * block_size, pool_blocks = keys.size(0);
  auto out = at::empty({batch * rows, heads * d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const int64_t *tp = table.data_ptr<int64_t>(), *visp = visible.data_ptr<int64_t>();
  const int64_t* ap = ancestors.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float scaling = static_cast<float>(scale);
  // One (sequence, head) a job, all the sequence's rows: the keys every row sees (the cache before the
  // least `visible`) are read a chunk at a time, each chunk from L1 for every row; the rest of a row's keys
  // (its own new rows', a tree's ancestors) after them. Each row's scores, softmax and weighted sum are
  // computed as for the row alone, key by key in the same order: a row's result does not depend on the
  // others. (A job per (row, head) read the head's keys and values from L2 once per row: a 5-row verify's
  // attention cost 3.3x a step's; docs/results/2026-11-30-avx2-tiles.md.)
  constexpr int64_t CHUNK = 32;  // keys per chunk: 8 KiB of keys (and of values) for a 64-wide head
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t stride = window + 16;                     // exp runs over whole vectors
    std::vector<float> scores(rows * stride);
    std::vector<int64_t> where(rows * window);              // each seen key's offset in the pool, less its head's
    std::vector<int64_t> count(rows);
    std::vector<float> top(rows), inverse(rows);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / heads, head = job % heads;
      auto block_of = [&](int64_t key) {
        const int64_t block = tp[b * blocks + key / block_size];
        TORCH_CHECK(block >= 0 && block < pool_blocks, "cpu_layer: a table entry outside the pool");
        return block * block_size * kv_heads * d;
      };
      int64_t shared = window;  // keys every row sees, first in each row's list
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = b * rows + r, seen_before = std::min(visp[row], window);
        const uint64_t tree = static_cast<uint64_t>(ap[row]);
        int64_t* w = where.data() + r * window;
        int64_t n = 0;
        for (int64_t start = 0; start < seen_before; start += block_size) {  // the cache, a block at a time
          const int64_t base = block_of(start), stop = std::min(start + block_size, seen_before);
          for (int64_t key = start; key < stop; ++key) w[n++] = base + (key - start) * kv_heads * d;
        }
        for (int64_t bit = 0; bit < 64 && (tree >> bit); ++bit) {
          if ((tree >> bit) & 1 && visp[row] + bit < window) {
            const int64_t key = visp[row] + bit;
            w[n++] = block_of(key) + (key % block_size) * kv_heads * d;
          }
        }
        count[r] = n;
        shared = std::min(shared, seen_before);
      }
      const int64_t offset = (head / groups) * d;
      // score of row r's keys [from, to) of its list, and their running maximum
      auto score = [&](int64_t r, int64_t from, int64_t to) {
        const float* query = qp + ((b * rows + r) * heads + head) * d;
        const int64_t* w = where.data() + r * window;
        float* sc = scores.data() + r * stride;
        float best = top[r];
        if (d == 64) {  // the common head size: the query in registers
          constexpr int Q = 64 / cpu_layer::LANES;
          cpu_layer::lanes qv[Q];
          for (int j = 0; j < Q; ++j) qv[j] = cpu_layer::load(query + j * cpu_layer::LANES);
          for (int64_t c = from; c < to; ++c) {
            const float* k = kp + w[c] + offset;
            cpu_layer::lanes products[Q];
            for (int j = 0; j < Q; ++j) products[j] = qv[j] * cpu_layer::load(k + j * cpu_layer::LANES);
            sc[c] = cpu_layer::sum_lanes(cpu_layer::pairwise<Q>(products)) * scaling;
            best = std::max(best, sc[c]);
          }
        } else {
          for (int64_t c = from; c < to; ++c) {
            sc[c] = cpu_layer::dot(query, kp + w[c] + offset, d) * scaling;
            best = std::max(best, sc[c]);
          }
        }
        top[r] = best;
      };
      // row r's output += its keys [from, to) of its list, weighted
      auto weigh = [&](int64_t r, int64_t from, int64_t to) {
        const int64_t* w = where.data() + r * window;
        const float* sc = scores.data() + r * stride;
        float* o = op + (b * rows + r) * heads * d + head * d;
        if (d == 64) {  // the sums in registers
          constexpr int Q = 64 / cpu_layer::LANES;
          cpu_layer::lanes ov[Q];
          for (int j = 0; j < Q; ++j) ov[j] = cpu_layer::load(o + j * cpu_layer::LANES);
          for (int64_t c = from; c < to; ++c) {
            const cpu_layer::lanes p = cpu_layer::splat(sc[c] * inverse[r]);
            const float* v = vp + w[c] + offset;
            for (int j = 0; j < Q; ++j) ov[j] += p * cpu_layer::load(v + j * cpu_layer::LANES);
          }
          __builtin_memcpy(o, ov, sizeof(ov));
        } else {
          for (int64_t c = from; c < to; ++c) {
            const float p = sc[c] * inverse[r];
            const float* v = vp + w[c] + offset;
            for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
          }
        }
      };
      const int64_t chunk = rows > 1 ? CHUNK : std::max<int64_t>(shared, 1);  // one row: one pass
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < shared; c += chunk)
        for (int64_t r = 0; r < rows; ++r) score(r, c, std::min(c + chunk, shared));
      for (int64_t r = 0; r < rows; ++r) {
        score(r, shared, count[r]);
        float* sc = scores.data() + r * stride;
        // exp over whole vectors of scores (the buffer has room past count), summed over the first count
        float total = 0.f;
        for (int64_t c = 0; c < count[r]; c += cpu_layer::LANES) {
          const auto e = cpu_layer::exp_lanes(cpu_layer::load(sc + c) - cpu_layer::splat(top[r]));
          __builtin_memcpy(sc + c, &e, sizeof(e));
        }
        for (int64_t c = 0; c < count[r]; ++c) total += sc[c];
        inverse[r] = 1.f / total;
        float* o = op + (b * rows + r) * heads * d + head * d;
        std::fill(o, o + d, 0.f);
      }
      for (int64_t c = 0; c < shared; c += chunk)
        for (int64_t r = 0; r < rows; ++r) weigh(r, c, std::min(c + chunk, shared));
      for (int64_t r = 0; r < rows; ++r) weigh(r, shared, count[r]);
    }
  });
  return out;
}
