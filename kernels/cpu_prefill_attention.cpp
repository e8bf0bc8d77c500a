// Dense prefill attention for CPU: the flash-attention loop (online softmax over key chunks) on
// contiguous K/V, returning the log-sum-exp as well, in bfloat16 with AVX512-BF16 dot products.
//
// Why it exists: prefill attention was about half of an engine step in the shared-prefix burst
// (a 1,024-token system prompt, 31 tails behind it): PyTorch's CPU flash op ran the tails' queries
// against the prefix at ~175 GFLOP/s on this 2-core Zen 5, its tiles multiplying
// through small oneDNN GEMMs whose inner dimension is only the head size (64). Here the operands
// are packed once per call for the instruction that multiplies them, and the tiles are register
// blocked:
//   scores  S[4 rows x 64 keys] = 16 zmm accumulators: VDPBF16PS (two bf16 products added into a
//           float32 lane, 32 per instruction) on key vectors of 16 keys x one pair of dims against
//           a broadcast pair of a query row's dims;
//   output  O[rows x D] += P V: a broadcast pair of a row's probabilities against the value rows
//           of that key pair, interleaved (16 dims x 2 keys per vector).
// 2.6x the op's rate on that shape (476 against 180 GFLOP/s). A float32 twin with FMAs was tried
// and dropped: 198 against the op's 189 GFLOP/s, no gain for its code.
// Softmax state (running max, sum) and the output accumulate in float32; the probabilities are
// rounded to bfloat16 before the P V product, as PyTorch's flash op rounds them for its GEMM.
//
// Layouts (contiguous):
//   q       [H, M, D]  bf16   H KV heads; each head's query rows (a GQA group folded into rows)
//   k, v    [H, N, D]  bf16   the keys and values every row may attend to
//   limits  [M]        int32  row m sees keys [0, limits[m]) (causal prompts), or empty: all N
//   out     [H, M, D]  bf16
//   lse     [H, M]     float32  log(sum_j exp(scale * q.k_j)) over the row's keys, natural log (the
//                               convention of PyTorch's `_scaled_dot_product_flash_attention_for_cpu`)
// D is 64 or 128. Compiled only where the compiler targets AVX512-BF16 (-march=native on such a
// CPU); elsewhere `prefill_attention_available()` is false and callers keep PyTorch's op.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "cpu_vec_math.h"
#define THAW_PREFILL_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

bool prefill_attention_available() {
#if defined(THAW_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

#if defined(THAW_PREFILL_BF16)
namespace {

constexpr int64_t kRows = 4;     // query rows per score tile
constexpr int64_t kChunk = 64;   // keys per chunk: 4 vectors of 16
constexpr int64_t kTaskRows = 64;  // query rows per parallel task

using thaw_cpu::exp16;

inline __m512i bcast_pair(const uint16_t* p) {  // two adjacent bf16 as one 32-bit lane, everywhere
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// K of one head packed for the score tile: [Np / 16][D / 2][16 keys][2 dims]; keys past N are 0.
void pack_keys(const uint16_t* k, int64_t n, int64_t d, int64_t np, uint16_t* out) {
  for (int64_t kb = 0; kb < np / 16; ++kb)
    for (int64_t p = 0; p < d / 2; ++p)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = kb * 16 + j;
        uint16_t* dst = out + ((kb * (d / 2) + p) * 16 + j) * 2;
        if (key < n) {
          dst[0] = k[key * d + 2 * p];
          dst[1] = k[key * d + 2 * p + 1];
        } else {
          dst[0] = dst[1] = 0;
        }
      }
}

// V of one head packed for the output update: [Np / 2][D][2 keys]; keys past N are 0.
void pack_values(const uint16_t* v, int64_t n, int64_t d, int64_t np, uint16_t* out) {
  for (int64_t j2 = 0; j2 < np / 2; ++j2)
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t key = 2 * j2 + e;
      for (int64_t c = 0; c < d; ++c) out[(j2 * d + c) * 2 + e] = key < n ? v[key * d + c] : 0;
    }
}

// One tile of up to kRows query rows against every key they see. NC = D / 16; elements are
// bfloat16 bits.
template <int NC>
void attend_tile(const uint16_t* q, int64_t rows, const int32_t* limit, const uint16_t* kp, const uint16_t* vp,
                 float scale, uint16_t* out, float* lse) {
  constexpr int64_t D = NC * 16;
  constexpr int64_t kPvRows = 16 / NC;  // output rows updated together: 16 accumulators
  float row_max[kRows], row_sum[kRows];
  alignas(64) float acc[kRows][D];
  alignas(64) uint16_t prob[kRows][kChunk];
  int64_t end = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.f;
    for (int64_t c = 0; c < D; ++c) acc[r][c] = 0.f;
    if (r < rows) end = std::max<int64_t>(end, limit[r]);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t start = 0; start < end; start += kChunk) {
    __m512 s[kRows][4];
    for (int64_t r = 0; r < kRows; ++r)
      for (int v = 0; v < 4; ++v) s[r][v] = _mm512_setzero_ps();
    const uint16_t* kc = kp + (start / 16) * D * 16;  // 16 keys x D dims per key block
    for (int64_t p = 0; p < D / 2; ++p) {
      __m512bh kv[4];
      for (int v = 0; v < 4; ++v)
        kv[v] = (__m512bh)_mm512_loadu_si512(kc + (v * (D / 2) + p) * 32);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh qb = (__m512bh)bcast_pair(q + std::min(r, rows - 1) * D + 2 * p);
        for (int v = 0; v < 4; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], qb, kv[v]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(limit[r] - start, kChunk);  // keys of this chunk the row sees
      __mmask16 valid[4];
      __m512 chunk_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int v = 0; v < 4; ++v) {
        valid[v] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(v * 16)),
                                           _mm512_set1_epi32(static_cast<int32_t>(std::max<int64_t>(seen, 0))));
        s[r][v] = _mm512_mul_ps(s[r][v], vscale);
        chunk_max = _mm512_mask_max_ps(chunk_max, valid[v], chunk_max, s[r][v]);
      }
      const float m_new = std::max(row_max[r], _mm512_reduce_max_ps(chunk_max));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet (cannot happen for row 0)
        std::memset(prob[r], 0, sizeof(prob[r]));
        continue;
      }
      const float alpha = std::exp(row_max[r] - m_new);  // 0 on the first chunk (row_max = -inf)
      row_max[r] = m_new;
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      __m512 pv[4];
      for (int v = 0; v < 4; ++v) {
        pv[v] = _mm512_maskz_mov_ps(valid[v], exp16(_mm512_sub_ps(s[r][v], vm)));
        sum = _mm512_add_ps(sum, pv[v]);
      }
      row_sum[r] = row_sum[r] * alpha + _mm512_reduce_add_ps(sum);
      // bf16 pairs of keys (2j, 2j+1) as 32-bit words: cvtne2ps_pbh(a, b) puts b in the low half.
      _mm512_storeu_si512(prob[r], (__m512i)_mm512_cvtne2ps_pbh(pv[1], pv[0]));
      _mm512_storeu_si512(prob[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(pv[3], pv[2]));
      if (alpha != 1.f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c) _mm512_store_ps(acc[r] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), va));
      }
    }
    const int64_t pairs = std::min<int64_t>(kChunk, end - start + 1) / 2;  // key pairs any row sees
    const uint16_t* vc = vp + start * D;  // [(start / 2) pairs][D][2]
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
      const int64_t nr = std::min<int64_t>(kPvRows, rows - r0);
      __m512 o[kPvRows][NC];
      for (int64_t r = 0; r < kPvRows; ++r)
        for (int c = 0; c < NC; ++c) o[r][c] = r < nr ? _mm512_load_ps(acc[r0 + r] + c * 16) : _mm512_setzero_ps();
      for (int64_t j2 = 0; j2 < pairs; ++j2) {  // an odd last key's partner has probability 0
        __m512bh vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vc + (j2 * D + c * 16) * 2);
        for (int64_t r = 0; r < kPvRows; ++r) {
          const __m512bh pb = (__m512bh)bcast_pair(prob[r0 + std::min(r, nr - 1)] + 2 * j2);
          for (int c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pb, vv[c]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) _mm512_store_ps(acc[r0 + r] + c * 16, o[r][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
    for (int c = 0; c < NC; ++c) {
      const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * D + c * 16), (__m256i)_mm512_cvtneps_pbh(x));
    }
    lse[r] = row_max[r] + std::log(row_sum[r]);
  }
}

void run_attention(const uint16_t* qd, const uint16_t* kd, const uint16_t* vd, int64_t h, int64_t m, int64_t n, int64_t d,
                   const std::vector<int32_t>& row_limits, float scale, uint16_t* od, float* ld) {
  const int64_t np = (n + kChunk - 1) / kChunk * kChunk;
  std::vector<uint16_t> kp(h * np * d), vp(h * np * d);
  at::parallel_for(0, h, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t head = begin; head < stop; ++head) {
      pack_keys(kd + head * n * d, n, d, np, kp.data() + head * np * d);
      pack_values(vd + head * n * d, n, d, np, vp.data() + head * np * d);
    }
  });
  const int64_t tasks_per_head = (m + kTaskRows - 1) / kTaskRows;
  at::parallel_for(0, h * tasks_per_head, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t head = task / tasks_per_head;
      const int64_t first = (task % tasks_per_head) * kTaskRows;
      const int64_t last = std::min(first + kTaskRows, m);
      for (int64_t r = first; r < last; r += kRows) {
        const int64_t rows = std::min(kRows, last - r);
        const uint16_t* qt = qd + (head * m + r) * d;
        uint16_t* ot = od + (head * m + r) * d;
        float* lt = ld + head * m + r;
        const uint16_t* kh = kp.data() + head * np * d;
        const uint16_t* vh = vp.data() + head * np * d;
        if (d == 64)
          attend_tile<4>(qt, rows, row_limits.data() + r, kh, vh, scale, ot, lt);
        else
          attend_tile<8>(qt, rows, row_limits.data() + r, kh, vh, scale, ot, lt);
      }
    }
  });
}

}  // namespace
#endif

std::vector<torch::Tensor> dense_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                   torch::Tensor limits, double scale) {
  TORCH_CHECK(prefill_attention_available(), "dense_prefill_attention needs AVX512-BF16 at build time");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [H, rows, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "dense_prefill_attention is bfloat16 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  const int64_t h = q.size(0), m = q.size(1), d = q.size(2), n = k.size(1);
  TORCH_CHECK(k.size(0) == h && v.size(0) == h && v.size(1) == n && k.size(2) == d && v.size(2) == d,
              "k and v must be [H, N, D] like q's H and D");
  TORCH_CHECK(d == 64 || d == 128, "head size must be 64 or 128, got ", d);
  TORCH_CHECK(n > 0, "no keys");
  std::vector<int32_t> row_limits(m, static_cast<int32_t>(n));
  if (limits.numel() > 0) {
    TORCH_CHECK(limits.scalar_type() == at::kInt && limits.numel() == m && limits.is_contiguous(),
                "limits must be [rows] int32");
    const int32_t* lp = limits.data_ptr<int32_t>();
    for (int64_t i = 0; i < m; ++i) {
      TORCH_CHECK(lp[i] >= 1 && lp[i] <= n, "every row must see between 1 and N keys");
      row_limits[i] = lp[i];
    }
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({h, m}, q.options().dtype(at::kFloat));
#if defined(THAW_PREFILL_BF16)
  run_attention(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), h, m, n, d, row_limits,
                static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                lse.data_ptr<float>());
#endif
  return {out, lse};
}
