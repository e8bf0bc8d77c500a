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
// 2.6x the op's rate on that shape (476 against 180 GFLOP/s). This layout ported to float32 FMAs
// gained nothing (198 against the op's 189 GFLOP/s); float32 has its own kernel with query rows in
// vector lanes (cpu_prefill_attention_f32.cpp), to which both entry points below hand float32 calls.
// Softmax state (running max, sum) and the output accumulate in float32; the probabilities are
// rounded to bfloat16 before the P V product, as PyTorch's flash op rounds them for its GEMM.
//
// Two entry points share the tiles: `dense_prefill_attention` (one key set, per-row limits, with
// the log-sum-exp) and `cascade_prefill_attention` (a burst behind one cached prefix: each row's
// online softmax runs over the shared prefix, packed once per KV head, and then over its own
// sequence's keys past it, so the two parts need no log-sum-exp merge; 12.7 -> 8.8 ms a layer on
// the shared-prefix burst against the dense kernel's two parts merged in PyTorch).
//
// Layouts of the dense entry (contiguous; the cascade's are at its definition):
//   q       [H, M, D]  bf16   H KV heads; each head's query rows (a GQA group folded into rows)
//   k, v    [H, N, D]  bf16   the keys and values every row may attend to
//   limits  [M]        int32  row m sees keys [0, limits[m]) (causal prompts), or empty: all N
//   out     [H, M, D]  bf16
//   lse     [H, M]     float32  log(sum_j exp(scale * q.k_j)) over the row's keys, natural log (the
//                               convention of PyTorch's `_scaled_dot_product_flash_attention_for_cpu`)
// D is 64 or 128. The bf16 kernel is compiled only where the compiler targets AVX512-BF16
// (-march=native on such a CPU), the float32 one where it targets AVX-512F; elsewhere
// `prefill_attention_available()` (bf16) or `thaw_cpu::prefill_f32_available()` is false and callers
// keep PyTorch's op. float32 operands take the same layouts (float for bf16, lse alike).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_prefill_attention_f32.h"

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

// The online-softmax state of a tile of up to kRows query rows: running max and sum per row and the
// unnormalised output, all float32. NC = D / 16.
template <int NC>
struct TileState {
  static constexpr int64_t D = NC * 16;
  float row_max[kRows];
  float row_sum[kRows];
  alignas(64) float acc[kRows][D];

  TileState() {
    for (int64_t r = 0; r < kRows; ++r) {
      row_max[r] = -std::numeric_limits<float>::infinity();
      row_sum[r] = 0.f;
      for (int64_t c = 0; c < D; ++c) acc[r][c] = 0.f;
    }
  }

  // out rows = acc / sum in bf16; lse (may be null) = max + log(sum).
  void finish(int64_t rows, uint16_t* out, float* lse) const {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
      for (int c = 0; c < NC; ++c) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * D + c * 16), (__m256i)_mm512_cvtneps_pbh(x));
      }
      if (lse != nullptr) lse[r] = row_max[r] + std::log(row_sum[r]);
    }
  }
};

// Folds one packed key set into a tile's state: row r sees keys [0, limit[r]) of it. Called once
// for a dense call, twice for a cascade (the shared prefix, then the row's own keys past it): the
// online softmax carries over between key sets exactly as between chunks.
template <int NC>
void attend_keys(TileState<NC>& st, const uint16_t* q, int64_t rows, const int32_t* limit, const uint16_t* kp,
                 const uint16_t* vp, float scale) {
  constexpr int64_t D = NC * 16;
  constexpr int64_t kPvRows = 16 / NC;  // output rows updated together: 16 accumulators
  alignas(64) uint16_t prob[kRows][kChunk];
  int64_t end = 0;
  for (int64_t r = 0; r < rows; ++r) end = std::max<int64_t>(end, limit[r]);
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
      if (seen >= kChunk) {  // the common case: every key of the chunk
        for (int v = 0; v < 4; ++v) {
          valid[v] = 0xFFFF;
          s[r][v] = _mm512_mul_ps(s[r][v], vscale);
          chunk_max = _mm512_max_ps(chunk_max, s[r][v]);
        }
      } else {
        for (int v = 0; v < 4; ++v) {
          valid[v] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(v * 16)),
                                             _mm512_set1_epi32(static_cast<int32_t>(std::max<int64_t>(seen, 0))));
          s[r][v] = _mm512_mul_ps(s[r][v], vscale);
          chunk_max = _mm512_mask_max_ps(chunk_max, valid[v], chunk_max, s[r][v]);
        }
      }
      const float m_new = std::max(st.row_max[r], _mm512_reduce_max_ps(chunk_max));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet (cannot happen for row 0)
        std::memset(prob[r], 0, sizeof(prob[r]));
        continue;
      }
      const float alpha = std::exp(st.row_max[r] - m_new);  // 0 on the first chunk (row_max = -inf)
      st.row_max[r] = m_new;
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      __m512 pv[4];
      for (int v = 0; v < 4; ++v) {
        pv[v] = _mm512_maskz_mov_ps(valid[v], exp16(_mm512_sub_ps(s[r][v], vm)));
        sum = _mm512_add_ps(sum, pv[v]);
      }
      st.row_sum[r] = st.row_sum[r] * alpha + _mm512_reduce_add_ps(sum);
      // bf16 pairs of keys (2j, 2j+1) as 32-bit words: cvtne2ps_pbh(a, b) puts b in the low half.
      _mm512_storeu_si512(prob[r], (__m512i)_mm512_cvtne2ps_pbh(pv[1], pv[0]));
      _mm512_storeu_si512(prob[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(pv[3], pv[2]));
      if (alpha != 1.f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < NC; ++c)
          _mm512_store_ps(st.acc[r] + c * 16, _mm512_mul_ps(_mm512_load_ps(st.acc[r] + c * 16), va));
      }
    }
    const int64_t pairs = std::min<int64_t>(kChunk, end - start + 1) / 2;  // key pairs any row sees
    const uint16_t* vc = vp + start * D;  // [(start / 2) pairs][D][2]
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
      const int64_t nr = std::min<int64_t>(kPvRows, rows - r0);
      __m512 o[kPvRows][NC];
      for (int64_t r = 0; r < kPvRows; ++r)
        for (int c = 0; c < NC; ++c)
          o[r][c] = r < nr ? _mm512_load_ps(st.acc[r0 + r] + c * 16) : _mm512_setzero_ps();
      for (int64_t j2 = 0; j2 < pairs; ++j2) {  // an odd last key's partner has probability 0
        __m512bh vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vc + (j2 * D + c * 16) * 2);
        for (int64_t r = 0; r < kPvRows; ++r) {
          const __m512bh pb = (__m512bh)bcast_pair(prob[r0 + std::min(r, nr - 1)] + 2 * j2);
          for (int c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pb, vv[c]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int c = 0; c < NC; ++c) _mm512_store_ps(st.acc[r0 + r] + c * 16, o[r][c]);
    }
  }
}

// One tile of up to kRows query rows against every key they see (a dense call).
template <int NC>
void attend_tile(const uint16_t* q, int64_t rows, const int32_t* limit, const uint16_t* kp, const uint16_t* vp,
                 float scale, uint16_t* out, float* lse) {
  TileState<NC> st;
  attend_keys<NC>(st, q, rows, limit, kp, vp, scale);
  st.finish(rows, out, lse);
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

// A cascade: every row attends to the shared prefix (all P keys), then to its member's own keys
// (the first suffix_limits[r] of them); rows g * R + r of a KV head are query head g's row r.
void run_cascade(const uint16_t* qd, const uint16_t* kpre, const uint16_t* vpre, const uint16_t* ksuf,
                 const uint16_t* vsuf, int64_t h, int64_t group, int64_t num_rows, int64_t p, int64_t s, int64_t d,
                 const std::vector<int32_t>& member_rows, const std::vector<int32_t>& member_keys,
                 const int32_t* suffix_limits, float scale, uint16_t* od) {
  const int64_t num_members = static_cast<int64_t>(member_rows.size()) - 1;
  const int64_t pp = (p + kChunk - 1) / kChunk * kChunk;
  std::vector<int64_t> packed(num_members + 1, 0);  // each member's suffix, padded to whole chunks
  for (int64_t i = 0; i < num_members; ++i) {
    const int64_t keys = member_keys[i + 1] - member_keys[i];
    packed[i + 1] = packed[i] + (keys + kChunk - 1) / kChunk * kChunk;
  }
  std::vector<uint16_t> kp(h * pp * d), vp(h * pp * d), ksp(h * packed[num_members] * d),
      vsp(h * packed[num_members] * d);
  at::parallel_for(0, h * (num_members + 1), 1, [&](int64_t begin, int64_t stop) {
    for (int64_t job = begin; job < stop; ++job) {
      const int64_t head = job / (num_members + 1), i = job % (num_members + 1);
      if (i == num_members) {
        pack_keys(kpre + head * p * d, p, d, pp, kp.data() + head * pp * d);
        pack_values(vpre + head * p * d, p, d, pp, vp.data() + head * pp * d);
        continue;
      }
      const int64_t keys = member_keys[i + 1] - member_keys[i], np = packed[i + 1] - packed[i];
      const int64_t src = (head * s + member_keys[i]) * d, dst = (head * packed[num_members] + packed[i]) * d;
      pack_keys(ksuf + src, keys, d, np, ksp.data() + dst);
      pack_values(vsuf + src, keys, d, np, vsp.data() + dst);
    }
  });
  // Tasks: (head, query head of the group, member, first row) tiles of kRows rows, one member each.
  struct Task { int64_t head, g, member, first, rows; };
  std::vector<Task> tasks;
  for (int64_t head = 0; head < h; ++head)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < num_members; ++i)
        for (int64_t r = member_rows[i]; r < member_rows[i + 1]; r += kRows)
          tasks.push_back({head, g, i, r, std::min<int64_t>(kRows, member_rows[i + 1] - r)});
  const std::vector<int32_t> whole_prefix(kRows, static_cast<int32_t>(p));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 4, [&](int64_t begin, int64_t stop) {
    for (int64_t t = begin; t < stop; ++t) {
      const Task& task = tasks[t];
      const int64_t row = task.head * group * num_rows + task.g * num_rows + task.first;  // in [H, G*R]
      const uint16_t* suffix_k = ksp.data() + (task.head * packed[num_members] + packed[task.member]) * d;
      const uint16_t* suffix_v = vsp.data() + (task.head * packed[num_members] + packed[task.member]) * d;
      if (d == 64) {
        TileState<4> st;
        attend_keys<4>(st, qd + row * d, task.rows, whole_prefix.data(), kp.data() + task.head * pp * d,
                       vp.data() + task.head * pp * d, scale);
        attend_keys<4>(st, qd + row * d, task.rows, suffix_limits + task.first, suffix_k, suffix_v, scale);
        st.finish(task.rows, od + row * d, nullptr);
      } else {
        TileState<8> st;
        attend_keys<8>(st, qd + row * d, task.rows, whole_prefix.data(), kp.data() + task.head * pp * d,
                       vp.data() + task.head * pp * d, scale);
        attend_keys<8>(st, qd + row * d, task.rows, suffix_limits + task.first, suffix_k, suffix_v, scale);
        st.finish(task.rows, od + row * d, nullptr);
      }
    }
  });
}

}  // namespace
#endif

std::vector<torch::Tensor> dense_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                   torch::Tensor limits, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [H, rows, D]");
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || f32) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(), "dense_prefill_attention takes bfloat16 or float32 q, k, v alike");
  TORCH_CHECK(f32 ? thaw_cpu::prefill_f32_available() : prefill_attention_available(),
              f32 ? "the float32 kernel needs AVX-512F at build time" : "the bfloat16 kernel needs AVX512-BF16 at build time");
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
  if (f32) {
    thaw_cpu::dense_prefill_f32(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), h, m, n, d,
                                row_limits.data(), static_cast<float>(scale), out.data_ptr<float>(),
                                lse.data_ptr<float>());
    return {out, lse};
  }
#if defined(THAW_PREFILL_BF16)
  run_attention(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), h, m, n, d, row_limits,
                static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                lse.data_ptr<float>());
#endif
  return {out, lse};
}

torch::Tensor cascade_prefill_attention(torch::Tensor q, torch::Tensor k_prefix, torch::Tensor v_prefix,
                                        torch::Tensor k_suffix, torch::Tensor v_suffix, torch::Tensor member_rows,
                                        torch::Tensor member_keys, torch::Tensor suffix_limits, int64_t group,
                                        double scale) {
  const bool f32 = q.scalar_type() == at::kFloat;
  for (const auto& t : {q, k_prefix, v_prefix, k_suffix, v_suffix}) {
    TORCH_CHECK(t.dim() == 3 && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) &&
                    t.scalar_type() == q.scalar_type() && t.is_contiguous(),
                "q and the keys and values must be contiguous [H, rows, D], all bfloat16 or all float32");
  }
  TORCH_CHECK(f32 ? thaw_cpu::prefill_f32_available() : prefill_attention_available(),
              f32 ? "the float32 kernel needs AVX-512F at build time" : "the bfloat16 kernel needs AVX512-BF16 at build time");
  const int64_t h = q.size(0), m = q.size(1), d = q.size(2), p = k_prefix.size(1), s = k_suffix.size(1);
  TORCH_CHECK(d == 64 || d == 128, "head size must be 64 or 128, got ", d);
  TORCH_CHECK(group >= 1 && m % group == 0, "q's rows must be group x rows");
  const int64_t num_rows = m / group;
  for (const auto& t : {k_prefix, v_prefix, k_suffix, v_suffix}) {
    TORCH_CHECK(t.size(0) == h && t.size(2) == d, "keys and values must have q's H and D");
  }
  TORCH_CHECK(v_prefix.size(1) == p && v_suffix.size(1) == s && p > 0, "a prefix of keys, values to match");
  for (const auto& t : {member_rows, member_keys, suffix_limits}) {
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), "offsets and limits are int32");
  }
  TORCH_CHECK(member_rows.numel() == member_keys.numel() && member_rows.numel() >= 2, "one offset per member + 1");
  TORCH_CHECK(suffix_limits.numel() == num_rows, "one suffix limit per row");
  const std::vector<int32_t> rows(member_rows.data_ptr<int32_t>(), member_rows.data_ptr<int32_t>() + member_rows.numel());
  const std::vector<int32_t> keys(member_keys.data_ptr<int32_t>(), member_keys.data_ptr<int32_t>() + member_keys.numel());
  TORCH_CHECK(rows.front() == 0 && rows.back() == num_rows && keys.front() == 0 && keys.back() == s,
              "member offsets must run from 0 to the rows and the suffix keys");
  const int32_t* limits = suffix_limits.data_ptr<int32_t>();
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    TORCH_CHECK(rows[i] < rows[i + 1] && keys[i] < keys[i + 1], "every member has rows and keys");
    for (int32_t r = rows[i]; r < rows[i + 1]; ++r)
      TORCH_CHECK(limits[r] >= 1 && limits[r] <= keys[i + 1] - keys[i], "a suffix limit past its member's keys");
  }
  auto out = torch::empty_like(q);
  if (f32) {
    thaw_cpu::cascade_prefill_f32(q.data_ptr<float>(), k_prefix.data_ptr<float>(), v_prefix.data_ptr<float>(),
                                  k_suffix.data_ptr<float>(), v_suffix.data_ptr<float>(), h, group, num_rows, p, s, d,
                                  rows.data(), keys.data(), static_cast<int64_t>(rows.size()) - 1, limits,
                                  static_cast<float>(scale), out.data_ptr<float>());
    return out;
  }
#if defined(THAW_PREFILL_BF16)
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  run_cascade(bits(q), bits(k_prefix), bits(v_prefix), bits(k_suffix), bits(v_suffix), h, group, num_rows, p, s, d,
              rows, keys, limits, static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
  return out;
}
