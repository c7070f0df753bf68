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
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for float32 (fast_exp; fast_exp_nonpositive where x <= 0), branch-free so that loops over it vectorise
// (given -fno-trapping-math: cpu_native.FLAGS): x, clamped to [-87, 88], = n ln2 + f ln2 with n = round(x log2 e)
// and |f| <= 1/2, then 2^f by its Taylor series to the 7th power (relative error below 2e-7) and 2^n in the exponent
// bits. Inputs below -87 (-inf too) give about 1e-38, not 0. n is rounded to nearest by adding and subtracting
// 1.5 * 2^23 (exact for |t| < 2^22): plain arithmetic, whatever the rounding mode.
inline float exp_in_range(float x) {  // x in [-87, 88] (the two below clamp it)
  const float t = x * 1.4426950408889634f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (t + kRound) - kRound;
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

inline float fast_exp(float x) { return exp_in_range(std::min(std::max(x, -87.0f), 88.0f)); }

// fast_exp for x <= 0 (x - max in a softmax): without the upper clamp GCC's vectorised loop is a quarter shorter.
inline float fast_exp_nonpositive(float x) { return exp_in_range(std::max(x, -87.0f)); }

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
      // two passes: exp(-gate) into the output, then gate * up / (1 + it). GCC's vectorised one-pass loop (the
      // division by 1 + fast_exp) ran 4-6x slower than this on this project's Xeon (raising the underflow flag;
      // the cause was not pinned down); two passes vectorise cleanly
#pragma omp simd
      for (int64_t d = 0; d < inter; ++d) oi[d] = fast_exp(-gi[d]);
#pragma omp simd
      for (int64_t d = 0; d < inter; ++d) oi[d] = gi[d] * ui[d] / (1.0f + oi[d]);
    }
  });
  return out;
}

// key_cache[slot_mapping[t]] = key[t] and value_cache[slot_mapping[t]] = value[t] for every new token t (vLLM's
// reshape_and_cache, for a cache of [slots, KVH, D]): one copy of each token's row, where index_copy_ made two
// dispatches and their checks per layer. key and value [T, KVH, D] may be views into the fused qkv output (any token
// stride, each token's row contiguous); slot_mapping int64 [T], every slot inside the cache (checked first, so a bad
// slot writes nothing).
void write_kv(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && key_cache.device().is_cpu(),
              "key_cache and value_cache must be contiguous float32 CPU tensors [slots, KVH, D] of one shape");
  const int64_t slots = key_cache.size(0), row = key_cache.size(1) * key_cache.size(2);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(1) == key_cache.size(1) &&
                    t->size(2) == key_cache.size(2) && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "key and value must be float32 [tokens, ", key_cache.size(1), ", ", key_cache.size(2),
                "] with each token's row contiguous");
  }
  const int64_t T = key.size(0);
  TORCH_CHECK(value.size(0) == T, "key and value must hold the same number of tokens");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "slot_mapping must be a contiguous int64 tensor of one slot per token");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot_mapping[", t, "] = ", slot[t], " is outside the cache's ",
                slots, " slots");
  }
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slot[t] * row, k + t * ks, sizeof(float) * row);
    std::memcpy(vc + slot[t] * row, v + t * vs, sizeof(float) * row);
  }
}

// Decode attention over a paged cache, read in place. query [B, H, D] (any row and head strides); key_cache and
// value_cache [slots, KVH, D] contiguous; block_tables [S, W] int32 or int64: key j of sequence s is in slot
// block_tables[s, j / block_size] * block_size + j % block_size (block_size 1: a table of one slot per key, any KV
// manager's context_slots). Row b reads sequence row_seq[b] (b itself when row_seq is not given: decodes) and sees
// its first context_lens[b] keys (a prefill chunk's rows: one more key each, the causal mask). Query head h reads
// KV head h / (H / KVH). Returns [B, H, D].
//
// How: one pass over the keys, kChunk at a time, with the softmax kept online (running maximum m, sum l and
// unnormalised output acc per head, rescaled when the maximum grows): each key's row of all KV heads (KVH * D
// contiguous floats) is read once, for every query head. The threads split the keys of the whole batch evenly (not
// its rows: contexts differ in length); a row cut between two threads is finished from both parts after.
constexpr int64_t kChunk = 16;  // keys scored before their values are added (one cache block at block_size 16)

// A row's (or a part of a row's) running softmax state: m[H], l[H], acc[H * D].
struct Softmax {
  std::vector<float> m, l, acc;
  void reset(int64_t H, int64_t D) {
    m.assign(H, -INFINITY);
    l.assign(H, 0.0f);
    acc.assign(H * D, 0.0f);
  }
};

// q . k over D values. Where D is a known multiple of 16: 16 running sums, added pairwise at the end (vector adds
// of halves; a reduction clause leaves GCC adding the lanes one by one, in order).
template <int64_t kD>
inline float dot(const float* q, const float* k, int64_t D) {
  if constexpr (kD > 0 && kD % 16 == 0) {
    float part[16] = {};
    for (int64_t d = 0; d < kD; d += 16) {
#pragma omp simd
      for (int64_t l = 0; l < 16; ++l) part[l] += q[d + l] * k[d + l];
    }
    for (int64_t l = 0; l < 8; ++l) part[l] += part[l + 8];
    for (int64_t l = 0; l < 4; ++l) part[l] += part[l + 4];
    return (part[0] + part[2]) + (part[1] + part[3]);
  } else {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < D; ++d) sum += q[d] * k[d];
    return sum;
  }
}

// Keys [j0, j1) of one row into `st`. qs: the row's query heads, scaled, [H, D] contiguous; slot_of(j): key j's slot;
// scores: room for [H, kChunk].
template <int64_t kD, typename SlotOf>
void attend_keys(const float* qs, const float* kc, const float* vc, int64_t H, int64_t KVH, int64_t D, int64_t j0,
                 int64_t j1, SlotOf slot_of, float* scores, Softmax& st) {
  const int64_t G = H / KVH, row = KVH * D;
  if (kD > 0) D = kD;
  int64_t slot[2][kChunk];  // this chunk's slots and the next one's (being fetched)
  auto fetch = [&](int64_t c0, int64_t* into) {  // the next chunk's slots, its rows asked of memory ahead of use
    const int64_t n = std::min(kChunk, j1 - c0);
    for (int64_t c = 0; c < n; ++c) {
      into[c] = slot_of(c0 + c);
      const char* k = reinterpret_cast<const char*>(kc + into[c] * row);
      const char* v = reinterpret_cast<const char*>(vc + into[c] * row);
      for (int64_t off = 0; off < row * int64_t(sizeof(float)); off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        __builtin_prefetch(v + off, 0, 3);
      }
    }
  };
  const float* krow[kChunk];
  const float* vrow[kChunk];
  fetch(j0, slot[0]);
  for (int64_t c0 = j0, i = 0; c0 < j1; c0 += kChunk, i ^= 1) {
    const int64_t n = std::min(kChunk, j1 - c0);
    if (c0 + kChunk < j1) fetch(c0 + kChunk, slot[i ^ 1]);
    for (int64_t c = 0; c < n; ++c) {
      krow[c] = kc + slot[i][c] * row;
      vrow[c] = vc + slot[i][c] * row;
    }
    // scores[h, c] = qs[h] . k[c] (the G query heads of a KV head read its key once)
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t g = 0; g < KVH; ++g) {
        const float* k = krow[c] + g * D;
        for (int64_t gi = 0; gi < G; ++gi) {
          const int64_t h = g * G + gi;
          scores[h * kChunk + c] = dot<kD>(qs + h * D, k, D);
        }
      }
    }
    // the running maxima, sums and outputs: rescaled where a maximum grew, then the chunk's weights
    for (int64_t h = 0; h < H; ++h) {
      float* sh = scores + h * kChunk;
      float cm = sh[0];
      for (int64_t c = 1; c < n; ++c) cm = std::max(cm, sh[c]);
      if (cm > st.m[h]) {
        if (st.l[h] > 0.0f) {  // not the first chunk
          const float alpha = fast_exp(st.m[h] - cm);
          st.l[h] *= alpha;
          float* a = st.acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        }
        st.m[h] = cm;
      }
      const float m = st.m[h];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < n; ++c) {
        const float e = fast_exp(sh[c] - m);
        sh[c] = e;
        sum += e;
      }
      st.l[h] += sum;
    }
    // acc[h] += p[h, c] * v[c]
    for (int64_t g = 0; g < KVH; ++g) {
      for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = g * G + gi;
        const float* p = scores + h * kChunk;
        float* a = st.acc.data() + h * D;
        for (int64_t c = 0; c < n; ++c) {
          const float* v = vrow[c] + g * D;
          const float pc = p[c];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += pc * v[d];
        }
      }
    }
  }
}

template <typename Index>
at::Tensor decode_attention_impl(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const int64_t* lens, int64_t block_size,
                                 double scale, const std::vector<int64_t>& seq_of) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t slots = key_cache.size(0), KVH = key_cache.size(1), W = block_tables.size(1);
  const Index* table = block_tables.data_ptr<Index>();
  // every table entry a row reads, once (not every key): a block of the cache, or its first keys in a row's last
  for (int64_t b = 0; b < B; ++b) {
    const Index* tb = table + seq_of[b] * W;
    for (int64_t i = 0; i * block_size < lens[b]; ++i) {
      const int64_t used = std::min(block_size, lens[b] - i * block_size);
      const int64_t e = tb[i];
      TORCH_CHECK(e >= 0 && slots >= used && e <= (slots - used) / block_size, "block_tables[", seq_of[b], ", ", i,
                  "] = ", e, " is outside the cache's ", slots, " slots (block_size ", block_size, ")");
    }
  }
  at::Tensor out = at::empty({B, H, D}, query.options());
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t q0 = query.stride(0), q1 = query.stride(1);
  const float fscale = static_cast<float>(scale);
  // keys of the whole batch end to end: row b's are [first[b], first[b + 1])
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + lens[b];
  const int64_t total = first[B];
  // one thread unless the work is worth waking the others; each thread takes an equal share of the keys
  const int64_t parts = total * H * D >= 2 * kGrainElements ? std::max<int64_t>(1, at::get_num_threads()) : 1;
  // rows a thread only began or only finished: its first and last row's state, merged below
  std::vector<int64_t> cut_row(2 * parts, -1);
  std::vector<Softmax> cut(2 * parts);
  auto run = [&](auto kd) {
    constexpr int64_t kD = decltype(kd)::value;
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> qs(H * D), scores(H * kChunk);
      Softmax st;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t begin = total * p / parts, end = total * (p + 1) / parts;
        if (begin == end) continue;
        const int64_t b_first = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
        for (int64_t b = b_first; b < B && first[b] < end; ++b) {
          const int64_t j0 = std::max<int64_t>(0, begin - first[b]), j1 = std::min(lens[b], end - first[b]);
          for (int64_t h = 0; h < H; ++h) {
            const float* qh = q + b * q0 + h * q1;
            float* qd = qs.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) qd[d] = qh[d] * fscale;
          }
          const bool whole = j0 == 0 && j1 == lens[b];
          Softmax& s = whole ? st : cut[2 * p + (j0 > 0 ? 1 : 0)];
          s.reset(H, D);
          const Index* tb = table + seq_of[b] * W;
          if (block_size == 1) {
            attend_keys<kD>(qs.data(), kc, vc, H, KVH, D, j0, j1, [tb](int64_t j) { return int64_t(tb[j]); },
                            scores.data(), s);
          } else {
            attend_keys<kD>(qs.data(), kc, vc, H, KVH, D, j0, j1, [tb, block_size](int64_t j) {
              return int64_t(tb[j / block_size]) * block_size + j % block_size;
            }, scores.data(), s);
          }
          if (!whole) {
            cut_row[2 * p + (j0 > 0 ? 1 : 0)] = b;
            continue;
          }
          for (int64_t h = 0; h < H; ++h) {
            const float inv = 1.0f / s.l[h];
            const float* a = s.acc.data() + h * D;
            float* oh = o + (b * H + h) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] = a[d] * inv;
          }
        }
      }
    });
  };
  if (D == 64) {
    run(std::integral_constant<int64_t, 64>());
  } else if (D == 128) {
    run(std::integral_constant<int64_t, 128>());
  } else {
    run(std::integral_constant<int64_t, 0>());
  }
  // the rows cut between threads: out = sum_i acc_i e^(m_i - M) / sum_i l_i e^(m_i - M), M the parts' maximum
  for (int64_t i = 0; i < 2 * parts; ++i) {
    const int64_t b = cut_row[i];
    if (b == -1 || std::find(cut_row.begin(), cut_row.begin() + i, b) != cut_row.begin() + i) continue;  // merged
    for (int64_t h = 0; h < H; ++h) {
      float M = -INFINITY, L = 0.0f;
      for (int64_t t = i; t < 2 * parts; ++t)
        if (cut_row[t] == b) M = std::max(M, cut[t].m[h]);
      float* oh = o + (b * H + h) * D;
      std::fill(oh, oh + D, 0.0f);
      for (int64_t t = i; t < 2 * parts; ++t) {
        if (cut_row[t] != b) continue;
        const float w = fast_exp(cut[t].m[h] - M);
        L += cut[t].l[h] * w;
        const float* a = cut[t].acc.data() + h * D;
        for (int64_t d = 0; d < D; ++d) oh[d] += a[d] * w;
      }
      for (int64_t d = 0; d < D; ++d) oh[d] /= L;
    }
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale, const c10::optional<at::Tensor>& row_seq) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 &&
                  query.stride(2) == 1,
              "query must be a float32 CPU tensor [B, H, D] with a contiguous last dimension");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "key_cache and value_cache must be contiguous float32 [slots, KVH, D] tensors of one shape");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  (block_tables.scalar_type() == at::kLong || block_tables.scalar_type() == at::kInt),
              "block_tables must be a contiguous int32 or int64 [S, W] tensor");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong && context_lens.dim() == 1,
              "context_lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(1), S = block_tables.size(0), W = block_tables.size(1);
  TORCH_CHECK(key_cache.size(2) == D && KVH > 0 && H % KVH == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(context_lens.size(0) == B, "one context length per query row");
  std::vector<int64_t> seq_of(B);
  if (row_seq.has_value()) {
    TORCH_CHECK(row_seq->is_contiguous() && row_seq->scalar_type() == at::kLong && row_seq->numel() == B,
                "row_seq must be a contiguous int64 tensor of one sequence per query row");
    const int64_t* rs = row_seq->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rs[b] >= 0 && rs[b] < S, "row_seq[", b, "] = ", rs[b], " is outside the ", S,
                  " rows of block_tables");
      seq_of[b] = rs[b];
    }
  } else {
    TORCH_CHECK(S == B, "one row of block_tables per query (or a row_seq saying which)");
    for (int64_t b = 0; b < B; ++b) seq_of[b] = b;
  }
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "context_lens[", b, "] = ", lens[b], " is outside 1..",
                W * block_size, " (", W, " table entries, block_size ", block_size, ")");
  }
  if (block_tables.scalar_type() == at::kInt) {
    return decode_attention_impl<int32_t>(query, key_cache, value_cache, block_tables, lens, block_size, scale,
                                          seq_of);
  }
  return decode_attention_impl<int64_t>(query, key_cache, value_cache, block_tables, lens, block_size, scale, seq_of);
}

// The sampler's pass over each row of logits [rows, vocab] (tinypaged.sampling.sampler.sample): lse[i] =
// log(sum_j exp(logits[i, j])), as torch.logsumexp, and argmax[i], the first index of the row's maximum, as
// torch.max's indices. What torch gives for unusual rows, so does this: a row holding a NaN has lse NaN (and argmax
// its first NaN, torch.max's answer); a row whose maximum is +inf has lse +inf; a row of -inf only has lse -inf (and
// argmax 0).
//
// How: one read of the row, kLseChunk values at a time (16 KiB, which stays in L1): the chunk's maximum and a
// NaN check (two vectorised loops), then, the chunk still in L1, the sum of exp(x - m) with m the running maximum;
// when a chunk raises the maximum the sum so far is rescaled by exp(old m - new m) (the online softmax of
// decode_attention) and the chunk is scanned for the first index holding it; a later chunk that only equals the
// maximum leaves the earlier index. Each chunk's terms are summed in float32 lanes and the chunks' sums in double;
// with fast_exp's relative error (below 2e-7) lse stays within a unit in its last place of torch's. Rows are split
// over the threads (a decode batch's rows are equally long); a batch of one row runs on one thread.
constexpr int64_t kLseChunk = 4096;

// The largest of n values, NaNs skipped: 32 running maxima (several vector registers, so that no max waits on the
// one before it), folded in halves at the end.
inline float chunk_max(const float* x, int64_t n) {
  constexpr int64_t kLanes = 32;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -INFINITY);
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], x[d + l]);
  }
  for (; d < n; ++d) lane[0] = std::max(lane[0], x[d]);
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lane[l] = std::max(lane[l], lane[l + w]);
  }
  return lane[0];
}

// Whether any of n values is NaN: a loop of its own (GCC 12 left one loop doing this and the maximum scalar).
// simdlen(16): 16-float vectors where the CPU has them (GCC prefers 8 under -march=native).
inline bool any_nan(const float* x, int64_t n) {
  int bad = 0;
#pragma omp simd simdlen(16) reduction(| : bad)
  for (int64_t d = 0; d < n; ++d) bad |= x[d] != x[d];
  return bad != 0;
}

std::tuple<at::Tensor, at::Tensor> row_max_lse(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits must have at least one column (torch.max refuses an empty row too)");
  at::Tensor lse = at::empty({rows}, logits.options());
  at::Tensor argmax = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  float* lse_out = lse.data_ptr<float>();
  int64_t* arg_out = argmax.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, grain_for(rows, vocab), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * stride;
      float m = -INFINITY;  // the running maximum
      double sum = 0.0;     // sum of exp(x - m) over the chunks read
      int64_t arg = 0;
      bool nan = false;
      for (int64_t c0 = 0; c0 < vocab; c0 += kLseChunk) {
        const int64_t n = std::min(kLseChunk, vocab - c0);
        const float* xc = xi + c0;
        const float cm = chunk_max(xc, n);  // NaNs skipped: any_nan looks for them
        if (any_nan(xc, n)) {  // torch: lse NaN, and max's index the first NaN's (the chunks before held none)
          int64_t d = 0;
          while (xc[d] == xc[d]) ++d;
          arg = c0 + d;
          nan = true;
          break;
        }
        if (cm > m) {  // a new maximum: its first index in this chunk, and the sum so far rescaled to it
          int64_t d = 0;
          while (xc[d] != cm) ++d;
          arg = c0 + d;
          if (sum > 0.0) sum *= std::exp(static_cast<double>(m) - static_cast<double>(cm));  // 0 when cm is +inf
          m = cm;
        }
        // a +inf maximum makes lse +inf (torch's): only a NaN could change that, so the rest is only checked; a
        // chunk of -inf only adds exp(-inf) = 0
        if (m == INFINITY || cm == -INFINITY) continue;
        float part = 0.0f;
#pragma omp simd simdlen(16) reduction(+ : part)
        for (int64_t d = 0; d < n; ++d) part += fast_exp_nonpositive(xc[d] - m);  // below -87: ~1e-38
        sum += part;
      }
      if (nan) {
        lse_out[i] = NAN;
      } else if (m == INFINITY || m == -INFINITY) {
        lse_out[i] = m;
      } else {
        lse_out[i] = static_cast<float>(static_cast<double>(m) + std::log(sum));
      }
      arg_out[i] = arg;
    }
  });
  return std::make_tuple(lse, argmax);
}

}  // namespace

TORCH_LIBRARY(tinypaged_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin, int heads) -> ()", &rope_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()",
        &write_kv);
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, Tensor? row_seq=None) -> Tensor",
        &decode_attention);
  m.def("row_max_lse(Tensor logits) -> (Tensor lse, Tensor argmax)", &row_max_lse);
}
