// Paged decode attention for CPU: one query token per sequence, K/V read straight through the
// block table, never gathered into a contiguous copy.
//
// Why it exists: on CPU the PyTorch reference has to copy every sequence's context out of the
// block pool into a contiguous tensor for SDPA, once per layer per step; that copy and the
// second pass SDPA makes over it were ~a quarter of an engine step. Here each (sequence, KV
// head) task reads its keys once (scores for all query heads of the group) and its values
// once (weighted sum), with a two-pass softmax (max first, no rescaling).
//
// Two element types, one algorithm: float32, and bfloat16 (what checkpoints ship in). Head sizes
// 64 and 128 (up to 8 query heads per KV head) take an AVX-512 path where the CPU has it (see
// there); other shapes the portable loops. In
// bfloat16 the query, keys and values are widened to float32 as they are read (a bfloat16 is
// the top half of a float32, so widening is a 16-bit shift the compiler vectorises), scores,
// softmax and the weighted sum are float32, and only the output is rounded to bfloat16: PyTorch's
// SDPA arithmetic on CPU for bfloat16 inputs up to summation order and rounding (tested against
// it), and half the memory traffic of float32, which is what decode attention is bound by.
//
// Layouts (all contiguous; T is float32 or bfloat16, the same for all four tensors):
//   query        [B, Hq, D]                T
//   key_cache    [num_blocks, bs, Hkv, D]  T (value_cache the same)
//   block_tables [B, max_blocks]           int32
//   seq_lens     [B]                       int32  (context length incl. the new token)
//   out          [B, Hq, D]                T
// The new token sits at position seq_len - 1 and sees keys [max(0, seq_len - window), seq_len).
// softcap > 0 caps each score as Gemma 2 does: s = softcap * tanh(s / softcap), after the scale and
// before the softmax; 0 means no cap (as sliding_window 0 means no window).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "cpu_vec_math.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// bfloat16 storage read as its raw 16 bits (at::BFloat16 is one uint16_t).
inline float dot(const float* __restrict a, const at::BFloat16* __restrict b, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(b);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * widen(bits[i]);
  return sum;
}

inline void axpy(float alpha, const at::BFloat16* __restrict x, float* __restrict y, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * widen(bits[i]);
}

#if defined(__AVX512F__)
// ---- AVX-512 path: the same two-pass algorithm, 16 lanes at a time ------------------------------
// Why: the portable loops above leave the compiler a horizontal sum per (key, query head), a scalar
// exp per score and a fresh widening of each key per query head; measured on the 100M bench model
// that made decode attention ~40% of a bf16 engine step (6.6 GFLOP/s). Here each key row is loaded
// and widened once for all query heads of its group, scores use FMAs, and the softmax's exp is a
// vectorised polynomial (Cephes' expf: range reduction by ln 2, degree-5 polynomial, scalef;
// ~1 ulp, what PyTorch's own vectorised exp does on CPU too).

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

using thaw_cpu::exp16;  // cpu_vec_math.h


constexpr int64_t kMaxGroup = 8;
// Rows prefetched ahead of use: a block's rows are 512+ bytes apart and blocks scattered, so the
// hardware prefetcher does not follow, and a row costs ~15 cycles of arithmetic against a DRAM
// latency of hundreds. 8 rows ahead read KV at 13.8 GB/s on the bench shape (30 sequences x ~210
// keys x 12 layers, bf16), 32 ahead (and the first rows of each pass before it starts) at 20.3 (16: 18.5, 48: 17.5).
constexpr int64_t kAhead = 32;

// Keeps the row's cache lines coming ahead of use: blocks are scattered and one head's rows of
// a block are 512+ bytes apart, which the hardware prefetcher does not follow. (Kept a free
// function taking plain values: with the address from a struct's member function, GCC 12 dropped
// the prefetch instructions altogether, and the kernel was ~1.5x slower.)
template <typename T>
inline void prefetch_row(const T* cache, const int32_t* table, int64_t pos, int64_t block_size, int64_t block_stride,
                         int64_t token_stride, int64_t kv_offset, int64_t head_dim) {
  const char* row = reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[pos / block_size]) * block_stride +
                                                  (pos % block_size) * token_stride + kv_offset);
  for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(row + byte, _MM_HINT_T0);
}

// Prefetches the first rows a pass will read (the in-loop prefetch covers the rest).
template <typename T>
inline void prefetch_first_rows(const T* cache, const int32_t* table, int64_t lo, int64_t seq_len, int64_t block_size,
                                int64_t block_stride, int64_t token_stride, int64_t kv_offset, int64_t head_dim) {
  for (int64_t pos = lo; pos < std::min(seq_len, lo + kAhead); ++pos)
    prefetch_row(cache, table, pos, block_size, block_stride, token_stride, kv_offset, head_dim);
}

// Row `pos` of one KV head, widened to float32 16 lanes at a time, with row pos + kAhead prefetched:
// the one way every pass below reads the cache.
template <typename T, int NC>
inline void load_row(__m512 (&row)[NC], const T* cache, const int32_t* table, int64_t pos, int64_t seq_len,
                     int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_offset) {
  const T* p = cache + static_cast<int64_t>(table[pos / block_size]) * block_stride + (pos % block_size) * token_stride +
               kv_offset;
  if (pos + kAhead < seq_len) prefetch_row(cache, table, pos + kAhead, block_size, block_stride, token_stride,
                                           kv_offset, NC * 16);
  for (int c = 0; c < NC; ++c) row[c] = load16(p + c * 16);
}

// Query head g's products with one key row, still 16 lanes (summed by the caller).
template <int NC>
inline __m512 head_products(const __m512 (&q)[NC], const __m512 (&k)[NC]) {
  __m512 sum = _mm512_mul_ps(q[0], k[0]);
  for (int c = 1; c < NC; ++c) sum = _mm512_fmadd_ps(q[c], k[c], sum);
  return sum;
}

// Sixteen vectors -> one: lane i is the sum of v[i]'s 16 lanes. A transposing tree of unpacks and
// 128-bit shuffles: 45 instructions for 16 sums, where one horizontal reduction each took ~8
// instructions and a long dependency chain (the scores' cost in the first version of this kernel).
inline __m512 sum16x16(__m512 v[16]) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i)  // 128-bit lane L of t[i]: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {  // lane L of u[i]: the lane-L sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 x[2];
  for (int i = 0; i < 2; ++i)  // lanes: u[2i] L0+L1, u[2i] L2+L3, u[2i+1] L0+L1, u[2i+1] L2+L3
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

// The scores of one task without a soft cap, 16 keys at a time: each key's products with every
// query head of the group stay vectors, and sum16x16 turns 16 keys' vectors into 16 scores.
template <typename T, int NC>
void decode_scores_avx512(const __m512 (&qv)[kMaxGroup][NC], int64_t group, const T* kc, const int32_t* table,
                          int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_offset,
                          int64_t lo, int64_t seq_len, float scale, float* scores, float* row_max) {
  const int64_t num_keys = seq_len - lo;
  __m512 top[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) top[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  prefetch_first_rows(kc, table, lo, seq_len, block_size, block_stride, token_stride, kv_offset, NC * 16);
  for (int64_t first = lo; first < seq_len; first += 16) {
    const int64_t count = std::min<int64_t>(16, seq_len - first);
    __m512 partial[kMaxGroup][16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t pos = first + j;
      if (j >= count) {
        for (int64_t g = 0; g < group; ++g) partial[g][j] = _mm512_setzero_ps();
        continue;
      }
      __m512 kv[NC];
      load_row<T, NC>(kv, kc, table, pos, seq_len, block_size, block_stride, token_stride, kv_offset);
      for (int64_t g = 0; g < group; ++g) partial[g][j] = head_products<NC>(qv[g], kv);
    }
    const __mmask16 live = static_cast<__mmask16>(count == 16 ? 0xFFFFu : (1u << count) - 1u);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s = _mm512_mul_ps(sum16x16(partial[g]), vscale);
      _mm512_mask_storeu_ps(scores + g * num_keys + (first - lo), live, s);
      top[g] = _mm512_mask_max_ps(top[g], live, top[g], s);
    }
  }
  for (int64_t g = 0; g < group; ++g) row_max[g] = _mm512_reduce_max_ps(top[g]);
}

// One (sequence, KV head) task: NC 16-float chunks per head (head_dim = 16 * NC), `group` query
// heads (<= kMaxGroup) sharing the KV head. q_wide: [group, head_dim] float32; scores: a buffer of
// at least group * num_keys floats; writes acc: [group, head_dim] (unnormalised) and denom.
template <typename T, int NC>
void decode_task_avx512(const float* q_wide, int64_t group, const T* kc, const T* vc, const int32_t* table,
                        int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_offset,
                        int64_t lo, int64_t seq_len, float scale, float softcap, float* scores, float* acc,
                        float* denom) {
  const int64_t num_keys = seq_len - lo;
  __m512 qv[kMaxGroup][NC];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = load16(q_wide + g * NC * 16 + c * 16);
  float row_max[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) row_max[g] = -std::numeric_limits<float>::infinity();
  if (softcap == 0.f) {
    decode_scores_avx512<T, NC>(qv, group, kc, table, block_size, block_stride, token_stride, kv_offset, lo, seq_len,
                                scale, scores, row_max);
  } else {  // Gemma 2's cap: a scalar tanh per score, one key at a time
    for (int64_t pos = lo; pos < seq_len; ++pos) {
      __m512 kv[NC];
      load_row<T, NC>(kv, kc, table, pos, seq_len, block_size, block_stride, token_stride, kv_offset);
      for (int64_t g = 0; g < group; ++g) {
        const float s = std::tanh(_mm512_reduce_add_ps(head_products<NC>(qv[g], kv)) * scale / softcap) * softcap;
        scores[g * num_keys + pos - lo] = s;
        row_max[g] = std::max(row_max[g], s);
      }
    }
  }
  // The values' first rows load while the softmax runs.
  prefetch_first_rows(vc, table, lo, seq_len, block_size, block_stride, token_stride, kv_offset, NC * 16);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * num_keys;
    const __m512 top = _mm512_set1_ps(row_max[g]);
    __m512 total = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= num_keys; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), top));
      _mm512_storeu_ps(row + i, e);
      total = _mm512_add_ps(total, e);
    }
    if (i < num_keys) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (num_keys - i)) - 1u);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + i), top));
      _mm512_mask_storeu_ps(row + i, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    denom[g] = _mm512_reduce_add_ps(total);
  }
  __m512 out[kMaxGroup][NC];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < NC; ++c) out[g][c] = _mm512_setzero_ps();
  for (int64_t pos = lo; pos < seq_len; ++pos) {
    __m512 vv[NC];
    load_row<T, NC>(vv, vc, table, pos, seq_len, block_size, block_stride, token_stride, kv_offset);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * num_keys + pos - lo]);
      for (int c = 0; c < NC; ++c) out[g][c] = _mm512_fmadd_ps(w, vv[c], out[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * NC * 16 + c * 16, out[g][c]);
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }  // bfloat16: round to nearest even

}  // namespace

template <typename T>
void paged_decode_attention_impl(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                                 torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                                 double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu() && out.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: block_tables and seq_lens must be int32");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const float fsoftcap = static_cast<float>(softcap);
  TORCH_CHECK(fsoftcap >= 0.f, "paged_decode_attention: softcap must be >= 0 (0: none)");
  // Offsets in elements; int64 throughout (a large pool passes 2**31 elements).
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [group, keys]
    std::vector<float> acc(group * head_dim);
    std::vector<float> q_wide(group * head_dim);  // the group's queries in float32
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t seq_len = lens[seq];
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t num_keys = seq_len - lo;
      const int32_t* table = tables + seq * max_blocks;
      const T* q_group = q + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) q_wide[i] = to_float(q_group[i]);
      T* o_group = o + (seq * num_heads + kv_head * group) * head_dim;
#if defined(__AVX512F__)
      if (group <= kMaxGroup && (head_dim == 64 || head_dim == 128)) {
        if (static_cast<int64_t>(scores.size()) < group * num_keys) scores.resize(group * num_keys);
        float denom[kMaxGroup];
        if (head_dim == 64) {
          decode_task_avx512<T, 4>(q_wide.data(), group, kc, vc, table, block_size, block_stride, token_stride,
                                   kv_head * head_dim, lo, seq_len, fscale, fsoftcap, scores.data(), acc.data(), denom);
        } else {
          decode_task_avx512<T, 8>(q_wide.data(), group, kc, vc, table, block_size, block_stride, token_stride,
                                   kv_head * head_dim, lo, seq_len, fscale, fsoftcap, scores.data(), acc.data(), denom);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.f / denom[g];
          for (int64_t d = 0; d < head_dim; ++d) o_group[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
        }
        continue;
      }
#endif
      scores.assign(group * num_keys, 0.f);
      std::vector<float> row_max(group, -std::numeric_limits<float>::infinity());
      for (int64_t pos = lo; pos < seq_len; ++pos) {
        const T* k = kc + static_cast<int64_t>(table[pos / block_size]) * block_stride +
                         (pos % block_size) * token_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          float s = dot(q_wide.data() + g * head_dim, k, head_dim) * fscale;
          if (fsoftcap > 0.f) s = std::tanh(s / fsoftcap) * fsoftcap;
          scores[g * num_keys + pos - lo] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * num_keys;
        for (int64_t i = 0; i < num_keys; ++i) {
          row[i] = std::exp(row[i] - row_max[g]);
          denom[g] += row[i];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = lo; pos < seq_len; ++pos) {
        const T* v = vc + static_cast<int64_t>(table[pos / block_size]) * block_stride +
                         (pos % block_size) * token_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          axpy(scores[g * num_keys + pos - lo], v, acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) o_group[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            double scale, int64_t sliding_window, double softcap) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 tensors only, got ", dtype);
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_decode_attention: query, key/value caches and out must share one dtype");
  if (dtype == torch::kFloat32) {
    paged_decode_attention_impl<float>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                       sliding_window, softcap);
  } else {
    paged_decode_attention_impl<at::BFloat16>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                              sliding_window, softcap);
  }
}
