// The lean decoder's decode step outside its matrix products, as four native kernels; the
// update's log-prob head (a row logsumexp and its backward), two more; the update's RMSNorm
// backward and SwiGLU forward and backward; the sampler's draw; and the re-test drift's KL and
// entropy.
//
// Around its matrix products a decode step runs some fifty small tensor operations per layer
// (norms, RoPE, cache writes, four tiny batched products and a softmax for the attention,
// SiLU), each paying its own dispatch for a few microseconds of work, which together cost a
// share of the step comparable to the products' (docs/measurements.md, "Figures moved from
// code comments"). These kernels do that work in three calls per layer; the products stay in
// torch (oneDNN, prepacked). See docs/design.md §15, "The CPU accelerator's decode step and
// log-prob head".
//
// Numbers: every kernel reproduces the rounding the torch path applies where it keeps a tensor
// in the model's dtype (bfloat16: a score, a probability, each attention part and their sum,
// each RoPE product), and accumulates in float32. Every sum runs in an order fixed by this
// source (a running sum, or sixteen partial sums combined in a fixed tree; the compiler never
// reassociates float sums without -ffast-math), so a row's result depends on nothing but that
// row: not on the other rows of the batch, nor on their count. Whether a multiply and an add
// fuse is the compiler's choice for the CPU it builds on, which is part of the build's key.
//
// Built by grpogate.engines.cpu.native_build with the system C++ compiler, -O3 -march=native
// -fno-trapping-math -fopenmp. -fno-trapping-math lets GCC turn exp_f32's range selects into
// blends, so the exponent loops (softmax, SiLU, the log-prob head) vectorize; it reorders no
// sum and changes no value. OpenMP is the runtime torch itself loaded (same soname), so
// torch.set_num_threads governs it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct BF16 {
  using T = uint16_t;
  static float load(T x) { return from_bf16(x); }
  static T store(float f) { return to_bf16(f); }
  static float round(float f) { return from_bf16(to_bf16(f)); }
};

struct F32 {
  using T = float;
  static float load(T x) { return x; }
  static T store(float f) { return f; }
  static float round(float f) { return f; }
};

constexpr int LANES = 16;

// The largest of x[0..n).
inline float max_of(const float* x, long n) {
  float top[LANES];
  for (int k = 0; k < LANES; ++k) top[k] = -INFINITY;
  long i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int k = 0; k < LANES; ++k) top[k] = x[i + k] > top[k] ? x[i + k] : top[k];
  for (int k = 0; i < n; ++i, ++k) top[k] = x[i] > top[k] ? x[i] : top[k];
  for (int k = 1; k < LANES; ++k) top[0] = top[k] > top[0] ? top[k] : top[0];
  return top[0];
}

// The sum of term(i) over i < n in sixteen partial sums combined in a fixed tree: one order
// for every vector width the compiler picks.
template <class Term>
inline float lane_sum(long n, Term term) {
  float acc[LANES] = {0.f};
  long i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int k = 0; k < LANES; ++k) acc[k] += term(i + k);
  for (int k = 0; i < n; ++i, ++k) acc[k] += term(i);
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  return acc[0];
}

inline float sum_of(const float* x, long n) {
  return lane_sum(n, [x](long i) { return x[i]; });
}

// e^x for x <= 88.3; 0 below -87.3 (a masked score, -1e30, gives exactly 0 as in torch).
// Cephes' expf polynomial on x - n ln 2, |error| about 1 ulp; branch-free, so it vectorizes.
inline float exp_f32(float x) {
  const bool underflow = x < -87.3f;
  x = x > 88.3f ? 88.3f : (underflow ? -87.3f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return underflow ? 0.0f : p * scale;
}

// As transformers' RMSNorm: normalize in float32, round to the dtype, scale in the dtype.
template <class E>
inline void norm_row(const typename E::T* x, const typename E::T* weight, typename E::T* out,
                     long dim, float eps) {
  const float squares = lane_sum(dim, [x](long i) {
    const float v = E::load(x[i]);
    return v * v;
  });
  const float inverse = 1.0f / std::sqrt(squares / float(dim) + eps);
  for (long i = 0; i < dim; ++i)
    out[i] = E::store(E::load(weight[i]) * E::round(E::load(x[i]) * inverse));
}

template <class E>
void rms_norm(const typename E::T* x, const typename E::T* weight, typename E::T* out,
              long rows, long dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 16384)
  for (long r = 0; r < rows; ++r) norm_row<E>(x + r * dim, weight, out + r * dim, dim, eps);
}

// hidden += delta (rounded to the dtype, as torch's add), then out = rms_norm(hidden).
template <class E>
void add_rms_norm(typename E::T* hidden, const typename E::T* delta,
                  const typename E::T* weight, typename E::T* out, long rows, long dim,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 16384)
  for (long r = 0; r < rows; ++r) {
    typename E::T* h = hidden + r * dim;
    const typename E::T* d = delta + r * dim;
    for (long i = 0; i < dim; ++i) h[i] = E::store(E::load(h[i]) + E::load(d[i]));
    norm_row<E>(h, weight, out + r * dim, dim, eps);
  }
}

// gate_up [rows, 2 I] -> out [rows, I] = silu(gate) * up, each rounded to the dtype.
template <class E>
void silu_mul(const typename E::T* gate_up, typename E::T* out, long rows, long inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= 16384)
  for (long r = 0; r < rows; ++r) {
    const typename E::T* gate = gate_up + r * 2 * inter;
    const typename E::T* up = gate + inter;
    typename E::T* o = out + r * inter;
    for (long i = 0; i < inter; ++i) {
      const float g = E::load(gate[i]);
      const float silu = E::round(g / (1.0f + exp_f32(-g)));
      o[i] = E::store(silu * E::load(up[i]));
    }
  }
}

// The update's RMSNorm backward (the norm's weight frozen): y = w * round(x r), r =
// 1 / sqrt(mean(x^2) + eps). With gh = round(grad * w), the product autograd rounds to the
// dtype, dx = r gh - x r^3 sum(gh x) / dim in float32, rounded once per element.
template <class E>
void rms_norm_backward(const typename E::T* x, const typename E::T* weight,
                       const typename E::T* grad, typename E::T* out, long rows, long dim,
                       float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 16384)
  for (long r = 0; r < rows; ++r) {
    const typename E::T* xr = x + r * dim;
    const typename E::T* gr = grad + r * dim;
    const float squares = lane_sum(dim, [xr](long i) {
      const float v = E::load(xr[i]);
      return v * v;
    });
    const float inverse = 1.0f / std::sqrt(squares / float(dim) + eps);
    const float dot = lane_sum(dim, [&](long i) {
      return E::round(E::load(gr[i]) * E::load(weight[i])) * E::load(xr[i]);
    });
    const float shift = inverse * inverse * inverse * dot / float(dim);
    for (long i = 0; i < dim; ++i) {
      const float gh = E::round(E::load(gr[i]) * E::load(weight[i]));
      out[r * dim + i] = E::store(inverse * gh - E::load(xr[i]) * shift);
    }
  }
}

// The update's SwiGLU on transformers' two projections: out = round(silu(gate)) * up, rounded
// (silu_mul's numbers); and its backward for grad: d_up = round(grad silu(gate)) with silu
// rounded as in the forward, d_gate = round(round(grad up) silu'(gate)), silu'(g) = s (1 + g
// (1 - s)), s the logistic of g: the roundings autograd makes on the same operations.
template <class E>
void swiglu(const typename E::T* gate, const typename E::T* up, typename E::T* out,
            long count) {
#pragma omp parallel for schedule(static) if (count >= 16384)
  for (long i = 0; i < count; ++i) {
    const float g = E::load(gate[i]);
    out[i] = E::store(E::round(g / (1.0f + exp_f32(-g))) * E::load(up[i]));
  }
}

template <class E>
void swiglu_backward(const typename E::T* gate, const typename E::T* up,
                     const typename E::T* grad, typename E::T* d_gate, typename E::T* d_up,
                     long count) {
#pragma omp parallel for schedule(static) if (count >= 16384)
  for (long i = 0; i < count; ++i) {
    const float g = E::load(gate[i]), dy = E::load(grad[i]);
    const float denominator = 1.0f + exp_f32(-g), logistic = 1.0f / denominator;
    d_up[i] = E::store(dy * E::round(g / denominator));
    const float slope = logistic * (1.0f + g * (1.0f - logistic));
    d_gate[i] = E::store(E::round(dy * E::load(up[i])) * slope);
  }
}

// RoPE in transformers' layout (halves): x cos + rotate_half(x) sin, each product rounded.
template <class E>
inline void rotate(const typename E::T* x, const typename E::T* cos, const typename E::T* sin,
                   float* out, long d) {
  const long half = d / 2;
  for (long i = 0; i < d; ++i) {
    const float turned = i < half ? -E::load(x[i + half]) : E::load(x[i - half]);
    out[i] = E::round(E::round(E::load(x[i]) * E::load(cos[i])) +
                      E::round(turned * E::load(sin[i])));
  }
}

// scores[j][c] = sum over i of q[j][i] * keys_t[i][c] for c < columns (a multiple of 16), keys
// stored transposed [d, stride]: 16 columns x G accumulators at a time, each a running sum
// over d in order.
template <class E, int G>
inline void score_columns(const float* q, const typename E::T* keys_t, long d, long stride,
                          long columns, float* scores, long scores_stride) {
  for (long c0 = 0; c0 < columns; c0 += 16) {
    float acc[G][16] = {};
    for (long i = 0; i < d; ++i) {
      float k[16];
      for (int c = 0; c < 16; ++c) k[c] = E::load(keys_t[i * stride + c0 + c]);
      for (int j = 0; j < G; ++j) {
        const float qi = q[j * d + i];
        for (int c = 0; c < 16; ++c) acc[j][c] += qi * k[c];
      }
    }
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < 16; ++c) scores[j * scores_stride + c0 + c] = acc[j][c];
  }
}

// out[j] = round(sum_c p[j][c] v[c]) over the prompt's columns + round(the same over the own
// columns), W lanes of d at a time with G x W accumulators (d a multiple of W).
template <class E, int G, int W>
inline void weigh_values(const float* probs, long stride, long span, long own,
                         const typename E::T* prompt_v, const typename E::T* own_v, long d,
                         typename E::T* out) {
  for (long i0 = 0; i0 < d; i0 += W) {
    float acc[G][W] = {}, part[G][W];
    for (long c = 0; c < span; ++c) {
      float v[W];
      for (int i = 0; i < W; ++i) v[i] = E::load(prompt_v[c * d + i0 + i]);
      for (int j = 0; j < G; ++j) {
        const float p = probs[j * stride + c];
        for (int i = 0; i < W; ++i) acc[j][i] += p * v[i];
      }
    }
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < W; ++i) {
        part[j][i] = E::round(acc[j][i]);
        acc[j][i] = 0.f;
      }
    for (long t = 0; t < own; ++t) {
      float v[W];
      for (int i = 0; i < W; ++i) v[i] = E::load(own_v[t * d + i0 + i]);
      for (int j = 0; j < G; ++j) {
        const float p = probs[j * stride + span + t];
        for (int i = 0; i < W; ++i) acc[j][i] += p * v[i];
      }
    }
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < W; ++i)
        out[j * d + i0 + i] = E::store(part[j][i] + E::round(acc[j][i]));
  }
}

struct StepShape {
  long rows, heads, kv_heads, head_dim, span, own_capacity, column;
  float scale;
};

constexpr int MAX_GROUP = 8;  // query heads per KV head that the kernel is built for

// One row's one KV head, its G query heads at once: rotate the queries and the key, write key
// and value into the row's own cache at `column`, attend the queries to the prompt's `span`
// columns and the row's own columns 0..column under one softmax, write the G heads' outputs.
// The loops are blocked so that each key or value the kernel loads serves all G queries from
// registers: 16 score columns x G accumulators, 16 output lanes x 2 G accumulators.
template <class E, int G>
void attend_one(const StepShape& s, const typename E::T* qkv, const typename E::T* cos,
                const typename E::T* sin, const float* prompt_mask,
                const typename E::T* prompt_keys, const typename E::T* prompt_values,
                typename E::T* own_keys, typename E::T* own_values, typename E::T* out,
                long kv_head, std::vector<float>& scratch) {
  using T = typename E::T;
  const long d = s.head_dim, span = s.span, own = s.column + 1, width = span + own;
  const long stride = span + (own + 15) / 16 * 16;  // a row of scores: own part in 16s
  scratch.resize(size_t(G * d + G * stride + d));
  float* q = scratch.data();            // [G, d]
  float* scores = q + G * d;            // [G, stride], columns past `width` ignored
  float* key = scores + G * stride;     // [d]: the rotated key

  rotate<E>(qkv + (s.heads + kv_head) * d, cos, sin, key, d);
  T* key_column = own_keys + kv_head * d * s.own_capacity + s.column;  // stride own_capacity
  T* value_slot = own_values + (kv_head * s.own_capacity + s.column) * d;
  const T* value = qkv + (s.heads + s.kv_heads + kv_head) * d;
  for (long i = 0; i < d; ++i) {
    key_column[i * s.own_capacity] = E::store(key[i]);
    value_slot[i] = value[i];
  }
  for (int j = 0; j < G; ++j) rotate<E>(qkv + (kv_head * G + j) * d, cos, sin, q + j * d, d);

  // Both parts' keys are stored transposed: the prompt's [d, span], the row's own [d,
  // own_capacity] (both multiples of 16; own columns past `column` are scored and ignored).
  score_columns<E, G>(q, prompt_keys + kv_head * d * span, d, span, span, scores, stride);
  score_columns<E, G>(q, own_keys + kv_head * d * s.own_capacity, d, s.own_capacity,
                      stride - span, scores + span, stride);

  for (int j = 0; j < G; ++j) {
    float* row = scores + j * stride;
    for (long c = 0; c < width; ++c) {
      const float mask = c < span ? prompt_mask[c] : 0.0f;
      row[c] = E::round(row[c]) * s.scale + mask;  // the product's result is in the dtype
    }
    const float top = max_of(row, width);
    for (long c = 0; c < width; ++c) row[c] = exp_f32(row[c] - top);
    const float inverse = 1.0f / sum_of(row, width);
    for (long c = 0; c < width; ++c) row[c] = E::round(row[c] * inverse);
  }

  // Outputs, W lanes of d at a time: each part a running sum over its columns in order,
  // rounded to the dtype, then the two parts added (the torch path's two products and sum).
  const T* prompt_v = prompt_values + kv_head * span * d;
  const T* own_v = own_values + kv_head * s.own_capacity * d;
  if (d % 32 == 0)
    weigh_values<E, G, 32>(scores, stride, span, own, prompt_v, own_v, d, out + kv_head * G * d);
  else
    weigh_values<E, G, 16>(scores, stride, span, own, prompt_v, own_v, d, out + kv_head * G * d);
}

// Every row r of the batch: its prompt's cache is entry prompt_of_row[r], its own cache slot
// slot_of_row[r] of own_keys / own_values (the slots of rows that left stay where they are, so
// no cache is copied when rows leave the batch).
template <class E, int G>
void decode_attention(const StepShape& s, const typename E::T* qkv, const typename E::T* cos,
                      const typename E::T* sin, const int64_t* positions,
                      const int64_t* prompt_of_row, const int64_t* slot_of_row,
                      const float* prompt_mask, const typename E::T* prompt_keys,
                      const typename E::T* prompt_values, typename E::T* own_keys,
                      typename E::T* own_values, typename E::T* out) {
  const long d = s.head_dim, qkv_width = (s.heads + 2 * s.kv_heads) * d;
  const long tasks = s.rows * s.kv_heads;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (long task = 0; task < tasks; ++task) {
      const long r = task / s.kv_heads, kv_head = task % s.kv_heads;
      const long p = prompt_of_row[r], slot = slot_of_row[r];
      attend_one<E, G>(s, qkv + r * qkv_width, cos + positions[r] * d, sin + positions[r] * d,
                       prompt_mask + p * s.span,
                       prompt_keys + p * s.kv_heads * d * s.span,
                       prompt_values + p * s.kv_heads * s.span * d,
                       own_keys + slot * s.kv_heads * s.own_capacity * d,
                       own_values + slot * s.kv_heads * s.own_capacity * d,
                       out + r * s.heads * d, kv_head, scratch);
    }
  }
}

template <class E>
int decode_attention_any(const StepShape& s, const void* qkv, const void* cos, const void* sin,
                         const int64_t* positions, const int64_t* prompt_of_row,
                         const int64_t* slot_of_row, const float* prompt_mask,
                         const void* prompt_keys,
                         const void* prompt_values, void* own_keys, void* own_values,
                         void* out) {
  using T = typename E::T;
  auto run = [&](auto group) {
    decode_attention<E, decltype(group)::value>(
        s, (const T*)qkv, (const T*)cos, (const T*)sin, positions, prompt_of_row, slot_of_row,
        prompt_mask,
        (const T*)prompt_keys, (const T*)prompt_values, (T*)own_keys, (T*)own_values, (T*)out);
    return 0;
  };
  switch (s.heads / s.kv_heads) {
    case 1: return run(std::integral_constant<int, 1>());
    case 2: return run(std::integral_constant<int, 2>());
    case 3: return run(std::integral_constant<int, 3>());
    case 4: return run(std::integral_constant<int, 4>());
    case 5: return run(std::integral_constant<int, 5>());
    case 6: return run(std::integral_constant<int, 6>());
    case 7: return run(std::integral_constant<int, 7>());
    case 8: return run(std::integral_constant<int, 8>());
    default: return 1;  // not built for this grouping: the caller runs torch's operations
  }
}


// The update's log-prob head. logits [rows, vocab] -> per row lse = logsumexp(z / T) and, if
// wanted, the entropy lse - sum p z / T of p = softmax(z / T): two reads of the row (its max,
// then the sums; a row of SmolLM2's 49,152 bfloat16 logits is 96 KB and stays in cache), no
// float32 copy of the logits. All in float32; each sum in lane_sum's fixed order.
template <class E>
void row_logsumexp(const typename E::T* logits, long rows, long vocab, float temperature,
                   float* lse, float* entropy) {
#pragma omp parallel
  {
    std::vector<float> z(vocab), e(vocab);
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      const typename E::T* row = logits + r * vocab;
      for (long v = 0; v < vocab; ++v) z[v] = E::load(row[v]) / temperature;
      const float top = max_of(z.data(), vocab);
      for (long v = 0; v < vocab; ++v) e[v] = exp_f32(z[v] - top);
      const float total = sum_of(e.data(), vocab);
      lse[r] = top + std::log(total);
      if (entropy)
        entropy[r] = lse[r] - lane_sum(vocab, [&](long v) { return e[v] * z[v]; }) / total;
    }
  }
}

// The re-test's drift: own, base [rows, vocab] (two policies' logits at the same positions) ->
// per row the exact KL(p || q) = sum p (log p - log q) of p = softmax(own / T), q =
// softmax(base / T), and p's entropy -sum p log p. Each row's logits are read twice (the maxima,
// then the sums), the log-probs formed per element as the torch path forms them; float32, each
// sum in lane_sum's fixed order.
template <class E>
void row_kl(const typename E::T* own, const typename E::T* base, long rows, long vocab,
            float temperature, float* kl, float* entropy) {
#pragma omp parallel
  {
    std::vector<float> a(vocab), b(vocab), e(vocab);
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      for (long v = 0; v < vocab; ++v) a[v] = E::load(own[r * vocab + v]) / temperature;
      for (long v = 0; v < vocab; ++v) b[v] = E::load(base[r * vocab + v]) / temperature;
      const float top_a = max_of(a.data(), vocab), top_b = max_of(b.data(), vocab);
      for (long v = 0; v < vocab; ++v) e[v] = exp_f32(a[v] - top_a);
      const float lse_a = top_a + std::log(sum_of(e.data(), vocab));
      const float lse_b = top_b + std::log(lane_sum(vocab, [&](long v) {
        return exp_f32(b[v] - top_b); }));
      for (long v = 0; v < vocab; ++v) a[v] -= lse_a;  // log p
      kl[r] = lane_sum(vocab, [&](long v) { return exp_f32(a[v]) * (a[v] - (b[v] - lse_b)); });
      entropy[r] = -lane_sum(vocab, [&](long v) { return exp_f32(a[v]) * a[v]; });
    }
  }
}

// The gradient of values[m] = z[index[m], target[m]] / T - lse[index[m]] with respect to the
// logits, given d loss / d values[m] = grad[m]: for row u with tokens m (their indices into
// `grad` and `target` listed in order[offsets[u] .. offsets[u + 1])),
//   d[u, v] = (sum of grad[m] over its tokens m with target v - p[u, v] sum of grad[m]) / T,
// p = exp(z / T - lse), computed in float32 and rounded to the dtype once per element.
template <class E>
void logprob_backward(const typename E::T* logits, const float* lse, long rows, long vocab,
                      float temperature, const int64_t* offsets, const int64_t* order,
                      const int64_t* target, const float* grad, typename E::T* out) {
#pragma omp parallel for schedule(static)
  for (long r = 0; r < rows; ++r) {
    const typename E::T* row = logits + r * vocab;
    typename E::T* d = out + r * vocab;
    float mass = 0.f;
    for (int64_t j = offsets[r]; j < offsets[r + 1]; ++j) mass += grad[order[j]];
    const float shift = lse[r];
    auto element = [&](long v, float picked) {
      const float p = exp_f32(E::load(row[v]) / temperature - shift);
      return E::store((picked - p * mass) / temperature);
    };
    for (long v = 0; v < vocab; ++v) d[v] = element(v, 0.f);
    for (int64_t j = offsets[r]; j < offsets[r + 1]; ++j) {  // the chosen tokens' elements
      const int64_t v = target[order[j]];
      float picked = 0.f;
      for (int64_t k = offsets[r]; k < offsets[r + 1]; ++k)
        if (target[order[k]] == v) picked += grad[order[k]];
      d[v] = element(v, picked);
    }
  }
}

// The sampler's draw from the whole distribution softmax(z / T) (rollout._sample with no
// top_k, top_p or min_p), by its two-level inverse CDF, row by row: e = exp((z - max) * (1/T))
// in float32, one float32 mass per block of `block` entries, their cumulative sum in float64;
// the row's uniform u picks the block where u * total falls, then the entry inside it by the
// float64 cumulative sum of its e. Returns the token and its log-prob (z - max) / T - log(total).
// The row stays in cache (96 KB of bfloat16 logits): no float32 copy of the batch's logits.
template <class E>
void sample_rows(const typename E::T* logits, long rows, long vocab, float temperature,
                 float inverse, long block, const double* uniforms, int64_t* tokens,
                 float* logprobs) {
  const long blocks = (vocab + block - 1) / block;
#pragma omp parallel if (rows >= 4)
  {
    std::vector<float> e(vocab);
    std::vector<double> cdf(blocks);
#pragma omp for schedule(static)
    for (long r = 0; r < rows; ++r) {
      const typename E::T* row = logits + r * vocab;
      for (long v = 0; v < vocab; ++v) e[v] = E::load(row[v]);
      const float top = max_of(e.data(), vocab);
      for (long v = 0; v < vocab; ++v) e[v] = exp_f32((e[v] - top) * inverse);
      double running = 0.0;
      long last = 0;  // the last block with mass
      for (long b = 0; b < blocks; ++b) {
        const long start = b * block, size = std::min(block, vocab - start);
        const float mass = sum_of(e.data() + start, size);
        if (mass > 0.f) last = b;
        running += double(mass);
        cdf[b] = running;
      }
      const double draw = uniforms[r] * running;
      long chosen = 0;  // the first block whose cumulative mass exceeds the draw
      while (chosen < blocks && cdf[chosen] <= draw) ++chosen;
      chosen = std::min(chosen, last);
      const double rest = draw - (chosen > 0 ? cdf[chosen - 1] : 0.0);
      const long start = chosen * block, size = std::min(block, vocab - start);
      double inside = 0.0;
      long pick = -1, positive = 0;
      for (long j = 0; j < size; ++j) {
        if (e[start + j] > 0.f) positive = j;
        inside += double(e[start + j]);
        if (pick < 0 && inside > rest) pick = j;
      }
      const long token = start + (pick < 0 ? positive : std::min(pick, positive));
      tokens[r] = token;
      logprobs[r] = (E::load(row[token]) - top) / temperature - float(std::log(running));
    }
  }
}

}  // namespace

// The C interface grpogate.engines.cpu.native calls; `bf16` chooses the element type
// (1: bfloat16 as uint16, 0: float32).
extern "C" {

int grpogate_native_version() { return 2; }

void grpogate_rms_norm(int bf16, const void* x, const void* weight, void* out, long rows,
                       long dim, float eps) {
  if (bf16)
    rms_norm<BF16>((const uint16_t*)x, (const uint16_t*)weight, (uint16_t*)out, rows, dim, eps);
  else
    rms_norm<F32>((const float*)x, (const float*)weight, (float*)out, rows, dim, eps);
}

void grpogate_add_rms_norm(int bf16, void* hidden, const void* delta, const void* weight,
                           void* out, long rows, long dim, float eps) {
  if (bf16)
    add_rms_norm<BF16>((uint16_t*)hidden, (const uint16_t*)delta, (const uint16_t*)weight,
                       (uint16_t*)out, rows, dim, eps);
  else
    add_rms_norm<F32>((float*)hidden, (const float*)delta, (const float*)weight, (float*)out,
                      rows, dim, eps);
}

void grpogate_silu_mul(int bf16, const void* gate_up, void* out, long rows, long inter) {
  if (bf16)
    silu_mul<BF16>((const uint16_t*)gate_up, (uint16_t*)out, rows, inter);
  else
    silu_mul<F32>((const float*)gate_up, (float*)out, rows, inter);
}

// Returns 0, or 1 (nothing written) for a grouping or a span the kernel is not built for.
int grpogate_decode_attention(int bf16, long rows, long heads, long kv_heads, long head_dim,
                              long span, long own_capacity, long column, float scale,
                              const void* qkv, const void* cos, const void* sin,
                              const int64_t* positions, const int64_t* prompt_of_row,
                              const int64_t* slot_of_row, const float* prompt_mask,
                              const void* prompt_keys, const void* prompt_values,
                              void* own_keys, void* own_values, void* out) {
  if (span % 16 != 0 || own_capacity % 16 != 0 || head_dim % 16 != 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP) return 1;
  const StepShape s{rows, heads, kv_heads, head_dim, span, own_capacity, column, scale};
  if (bf16)
    return decode_attention_any<BF16>(s, qkv, cos, sin, positions, prompt_of_row, slot_of_row,
                                      prompt_mask, prompt_keys, prompt_values, own_keys,
                                      own_values, out);
  return decode_attention_any<F32>(s, qkv, cos, sin, positions, prompt_of_row, slot_of_row,
                                   prompt_mask, prompt_keys, prompt_values, own_keys, own_values,
                                   out);
}

void grpogate_row_logsumexp(int bf16, const void* logits, long rows, long vocab,
                            float temperature, float* lse, float* entropy) {
  if (bf16)
    row_logsumexp<BF16>((const uint16_t*)logits, rows, vocab, temperature, lse, entropy);
  else
    row_logsumexp<F32>((const float*)logits, rows, vocab, temperature, lse, entropy);
}

void grpogate_rms_norm_backward(int bf16, const void* x, const void* weight, const void* grad,
                                void* out, long rows, long dim, float eps) {
  if (bf16)
    rms_norm_backward<BF16>((const uint16_t*)x, (const uint16_t*)weight, (const uint16_t*)grad,
                            (uint16_t*)out, rows, dim, eps);
  else
    rms_norm_backward<F32>((const float*)x, (const float*)weight, (const float*)grad,
                           (float*)out, rows, dim, eps);
}

void grpogate_swiglu(int bf16, const void* gate, const void* up, void* out, long count) {
  if (bf16)
    swiglu<BF16>((const uint16_t*)gate, (const uint16_t*)up, (uint16_t*)out, count);
  else
    swiglu<F32>((const float*)gate, (const float*)up, (float*)out, count);
}

void grpogate_swiglu_backward(int bf16, const void* gate, const void* up, const void* grad,
                              void* d_gate, void* d_up, long count) {
  if (bf16)
    swiglu_backward<BF16>((const uint16_t*)gate, (const uint16_t*)up, (const uint16_t*)grad,
                          (uint16_t*)d_gate, (uint16_t*)d_up, count);
  else
    swiglu_backward<F32>((const float*)gate, (const float*)up, (const float*)grad,
                         (float*)d_gate, (float*)d_up, count);
}

void grpogate_row_kl(int bf16, const void* own, const void* base, long rows, long vocab,
                     float temperature, float* kl, float* entropy) {
  if (bf16)
    row_kl<BF16>((const uint16_t*)own, (const uint16_t*)base, rows, vocab, temperature, kl,
                 entropy);
  else
    row_kl<F32>((const float*)own, (const float*)base, rows, vocab, temperature, kl, entropy);
}

void grpogate_logprob_backward(int bf16, const void* logits, const float* lse, long rows,
                               long vocab, float temperature, const int64_t* offsets,
                               const int64_t* order, const int64_t* target, const float* grad,
                               void* out) {
  if (bf16)
    logprob_backward<BF16>((const uint16_t*)logits, lse, rows, vocab, temperature, offsets,
                           order, target, grad, (uint16_t*)out);
  else
    logprob_backward<F32>((const float*)logits, lse, rows, vocab, temperature, offsets, order,
                          target, grad, (float*)out);
}

void grpogate_sample_rows(int bf16, const void* logits, long rows, long vocab,
                          float temperature, float inverse, long block, const double* uniforms,
                          int64_t* tokens, float* logprobs) {
  if (bf16)
    sample_rows<BF16>((const uint16_t*)logits, rows, vocab, temperature, inverse, block,
                      uniforms, tokens, logprobs);
  else
    sample_rows<F32>((const float*)logits, rows, vocab, temperature, inverse, block, uniforms,
                     tokens, logprobs);
}

}  // extern "C"
