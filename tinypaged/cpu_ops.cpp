// tinypaged's CPU operators: the element-wise work and the decode attention of a float32 step, in C++.
//
// Why: a SmolLM2 decode step on a CPU is some 1,100 small torch operators, and at a few microseconds of dispatch
// each they cost a third of the step beside the products (docs/RESULTS.md). vLLM's CPU backend runs the same
// work as compiled C++ (fused add + RMSNorm, RoPE, SiLU-and-multiply, paged attention reading the cache in
// place). These are tinypaged's own versions of those four operators; tinypaged/cpu_native.py builds this file
// once per machine and falls back to the torch code where it cannot. Every operator is checked against the torch
// code it replaces (tests/test_cpu_native.py).
//
// Conventions: float32 only, CPU only; the last dimension of every tensor is contiguous (checked); work is split
// over torch's own OpenMP threads (at::parallel_for), so it never adds threads beside torch's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for float32, branch-free so that loops over it vectorise (given -fno-trapping-math: cpu_native.FLAGS):
// x = n ln2 + f ln2 with n = round(x log2 e) and |f| <= 1/2, then 2^f by its Taylor series to the 7th power
// (relative error below 2e-7) and 2^n in the exponent bits. Inputs below -87 give about 1e-38 (not 0): callers
// never feed -inf.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5252733804059840e-5f;
  p = p * f + 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, dim] with a contiguous last dimension");
}

// Rows are few (a decode batch): one thread unless the work is worth waking the other.
constexpr int64_t kGrainElements = 32768;

int64_t grain_for(int64_t rows, int64_t per_row) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_row));
}

// out = RMSNorm(x) * weight; when a residual is given, x += residual first (in place), as vLLM's fused_add_rms_norm.
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == dim && weight.scalar_type() == at::kFloat,
              "weight must be a contiguous float32 tensor of ", dim, " values");
  const float* r = nullptr;
  int64_t r_stride = 0;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == dim, "residual must be shaped like x");
    r = residual->data_ptr<float>();
    r_stride = residual->stride(0);
  }
  at::Tensor out = at::empty({rows, dim}, x.options());
  float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_for(rows, dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = xp + i * x_stride;
      if (r != nullptr) {
        const float* ri = r + i * r_stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) xi[d] += ri[d];
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) sum += xi[d] * xi[d];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + feps);
      float* oi = o + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) oi[d] = w[d] * (xi[d] * inv);
    }
  });
  return out;
}

// RoPE in place on the first `heads` heads of x [tokens, all heads, head_dim] (the q and k of a fused qkv), with
// cos and the sign-folded sin [tokens, head_dim] of tinypaged.model.fused.rope_tables:
// x[i] = x[i] * cos[i] + x[(i + half) % head_dim] * signed_sin[i].
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be a float32 CPU tensor [tokens, heads, head_dim] with a contiguous last dimension");
  const int64_t tokens = x.size(0), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK(heads >= 0 && heads <= x.size(1), "heads must be within x's ", x.size(1), " heads");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 1024, "head_dim must be even and at most 1024");
  check_rows(cos, "cos");
  check_rows(signed_sin, "signed_sin");
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == head_dim && signed_sin.sizes() == cos.sizes(),
              "cos and signed_sin must be [tokens, head_dim]");
  float* xp = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), cs = cos.stride(0), ss = signed_sin.stride(0);
  at::parallel_for(0, tokens, grain_for(tokens, heads * head_dim), [&](int64_t begin, int64_t end) {
    float lo[512];
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * cs;
      const float* st = s + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * s0 + h * s1;
        std::memcpy(lo, v, half * sizeof(float));
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) v[d] = v[d] * ct[d] + v[d + half] * st[d];
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) v[d + half] = v[d + half] * ct[d + half] + lo[d] * st[d + half];
      }
    }
  });
}

// [rows, 2 * inter] (gate; up) -> [rows, inter]: silu(gate) * up, as vLLM's silu_and_mul.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's last dimension must be even");
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, grain_for(rows, inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gi = g + i * stride;
      const float* ui = gi + inter;
      float* oi = o + i * inter;
#pragma omp simd
      for (int64_t d = 0; d < inter; ++d) oi[d] = gi[d] / (1.0f + fast_exp(-gi[d])) * ui[d];
    }
  });
  return out;
}

// Attention over a cache read in place, one query row at a time. query [B, H, D] (any row and head strides);
// key_cache and value_cache [slots, KVH, D] contiguous; context_slots [S, L] int64: the slot of key j of sequence
// s; row b reads sequence row_seq[b] (b itself when row_seq is not given: decodes) and sees its first
// context_lens[b] keys (a prefill chunk's rows: one more key each, the causal mask). Query head h reads KV head
// h / (H / KVH). One task per (row, KV head): its keys are read once for all the query heads that share them.
// Returns [B, H, D].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& context_slots, const at::Tensor& context_lens, double scale,
                            const c10::optional<at::Tensor>& row_seq) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 &&
                  query.stride(2) == 1,
              "query must be a float32 CPU tensor [B, H, D] with a contiguous last dimension");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "key_cache and value_cache must be contiguous float32 [slots, KVH, D] tensors of one shape");
  TORCH_CHECK(context_slots.is_contiguous() && context_slots.scalar_type() == at::kLong && context_slots.dim() == 2,
              "context_slots must be a contiguous int64 [B, L] tensor");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong && context_lens.dim() == 1,
              "context_lens must be a contiguous int64 [B] tensor");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t slots = key_cache.size(0), KVH = key_cache.size(1), L = context_slots.size(1);
  TORCH_CHECK(key_cache.size(2) == D && KVH > 0 && H % KVH == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(context_lens.size(0) == B, "one context length per query row");
  const int64_t S = context_slots.size(0);
  std::vector<int64_t> seq_of(B);
  if (row_seq.has_value()) {
    TORCH_CHECK(row_seq->is_contiguous() && row_seq->scalar_type() == at::kLong && row_seq->numel() == B,
                "row_seq must be a contiguous int64 tensor of one sequence per query row");
    const int64_t* rs = row_seq->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rs[b] >= 0 && rs[b] < S, "row_seq[", b, "] = ", rs[b], " is outside the ", S, " rows of context_slots");
      seq_of[b] = rs[b];
    }
  } else {
    TORCH_CHECK(S == B, "one row of context_slots per query (or a row_seq saying which)");
    for (int64_t b = 0; b < B; ++b) seq_of[b] = b;
  }
  const int64_t G = H / KVH;
  TORCH_CHECK(G <= 64 && G * D <= 4096, "at most 64 query heads per KV head, and heads per KV head times head_dim "
              "at most 4096");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* slot = context_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= L, "context_lens[", b, "] = ", lens[b], " is outside 1..", L);
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t s = slot[seq_of[b] * L + j];
      TORCH_CHECK(s >= 0 && s < slots, "context_slots[", seq_of[b], ", ", j, "] = ", s, " is outside the cache's ",
                  slots, " slots");
    }
  }
  at::Tensor out = at::empty({B, H, D}, query.options());
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t q0 = query.stride(0), q1 = query.stride(1);
  const float fscale = static_cast<float>(scale);
  int64_t work = 0;  // keys read in all, times the heads that read them
  for (int64_t b = 0; b < B; ++b) work += lens[b] * H * D;
  const int64_t grain = work >= 2 * kGrainElements ? 1 : B * KVH;
  at::parallel_for(0, B * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    float acc[4096];  // G * D floats (checked above)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, g = task % KVH, n = lens[b];
      scores.resize(static_cast<size_t>(G * n));
      const int64_t* sb = slot + seq_of[b] * L;
      // scores[gi, j] = q[gi] . k[j] * scale, and each head's maximum
      float maxima[64];
      for (int64_t gi = 0; gi < G; ++gi) maxima[gi] = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kc + (sb[j] * KVH + g) * D;
        for (int64_t gi = 0; gi < G; ++gi) {
          const float* qh = q + b * q0 + (g * G + gi) * q1;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
          dot *= fscale;
          scores[gi * n + j] = dot;
          maxima[gi] = std::max(maxima[gi], dot);
        }
      }
      // softmax weights, unnormalised, and their sums
      float sums[64];
      for (int64_t gi = 0; gi < G; ++gi) {
        float* sg = scores.data() + gi * n;
        const float m = maxima[gi];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          const float e = fast_exp(sg[j] - m);
          sg[j] = e;
          sum += e;
        }
        sums[gi] = sum;
      }
      // out[gi] = sum_j p[gi, j] v[j] / sum[gi]
      std::fill(acc, acc + G * D, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vc + (sb[j] * KVH + g) * D;
        for (int64_t gi = 0; gi < G; ++gi) {
          const float p = scores[gi * n + j];
          float* a = acc + gi * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t gi = 0; gi < G; ++gi) {
        const float inv = 1.0f / sums[gi];
        float* oh = o + (b * H + g * G + gi) * D;
        const float* a = acc + gi * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oh[d] = a[d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tinypaged_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin, int heads) -> ()", &rope_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor context_slots, "
        "Tensor context_lens, float scale, Tensor? row_seq=None) -> Tensor",
        &decode_attention);
}
