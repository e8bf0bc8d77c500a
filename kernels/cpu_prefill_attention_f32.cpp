// Float32 prefill attention for CPU: the flash-attention loop with query rows in vector lanes.
//
// Why it exists: in float32 the shared-prefix burst spent a third of its time in PyTorch's CPU
// flash op (117-154 GFLOP/s on this 2-core Zen 5, where oneDNN's float32 GEMMs reach ~430), and the
// bf16 kernel's layout (a few rows against 16-key vectors) ported to FMAs gained nothing (198 against
// 189 GFLOP/s): it reloads each key vector for every 4 rows, and reduces every row's max and sum
// across lanes. Here a tile is 16 x RV query rows, one row per lane:
//   scores  S^T[8 keys x RV vectors of rows] = 8 x RV accumulators: per head dim d, the tile's
//           q[., d] (RV vectors, from the transposed tile, in L1) against a broadcast k[key, d];
//   softmax per lane: the running max and sum are vectors, the chunk's max is a vertical max over
//           its keys, so no horizontal reduction anywhere;
//   output  O^T[8 dims x RV vectors] += P^T[key] * broadcast v[key, dim], over the chunk's keys.
// Keys and values are read in place (row-major, a key's D floats contiguous): no packing.
// Arithmetic stays float32 throughout. Rows are independent and each row's sums run in a fixed order
// (keys in order, 64 a chunk), so a row's result does not depend on the tile or lane it lands in.
#include "cpu_prefill_attention_f32.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "cpu_vec_math.h"
#define THAW_PREFILL_F32 1
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace thaw_cpu {

bool prefill_f32_available() {
#if defined(THAW_PREFILL_F32)
  return true;
#else
  return false;
#endif
}

#if defined(THAW_PREFILL_F32)
namespace {

constexpr int kRowVectors = 2;                 // vectors of 16 query rows per tile
constexpr int kTileRows = 16 * kRowVectors;    // query rows per tile
constexpr int64_t kChunk = 64;                 // keys per online-softmax step
constexpr int kKeyBlock = 8;                   // keys per score block (8 x kRowVectors accumulators)
constexpr int kDimBlock = 8;                   // output dims per P V block

// One tile's rows and its online-softmax state. Row i of the tile is lane i % 16 of vector i / 16.
template <int D>
struct Tile {
  int rows = 0;                          // real rows; the rest are padding (zero queries, every key)
  const float* q[kTileRows];             // each row's query (D floats)
  float* out[kTileRows];                 // where each row's output goes (D floats)
  float* lse[kTileRows];                 // where each row's log-sum-exp goes, or null
  alignas(64) float qt[D][kTileRows];    // the queries transposed: qt[d][row]
  alignas(64) float acc[D][kTileRows];   // unnormalised output, transposed
  alignas(64) float s[kChunk][kTileRows];  // a chunk's scores, then its probabilities
  __m512 row_max[kRowVectors];
  __m512 row_sum[kRowVectors];

  void start() {
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < kTileRows; ++i) {
        qt[d][i] = i < rows ? q[i][d] : 0.f;
        acc[d][i] = 0.f;
      }
    for (int r = 0; r < kRowVectors; ++r) {
      row_max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      row_sum[r] = _mm512_setzero_ps();
    }
  }

  void finish() {
    alignas(64) float sums[kTileRows], maxes[kTileRows];
    for (int r = 0; r < kRowVectors; ++r) {
      _mm512_store_ps(sums + 16 * r, row_sum[r]);
      _mm512_store_ps(maxes + 16 * r, row_max[r]);
    }
    for (int i = 0; i < rows; ++i) {
      const float inv = 1.f / sums[i];
      for (int d = 0; d < D; ++d) out[i][d] = acc[d][i] * inv;
      if (lse[i] != nullptr) *lse[i] = maxes[i] + std::log(sums[i]);
    }
  }
};

// Folds one key set into the tile: lane i sees keys [0, limit[i]) of k, v ([keys, D] row-major).
// `limit` has kTileRows entries (padding rows: any value in 1..end); `end` is their maximum.
template <int D>
void attend_keys(Tile<D>& t, const float* k, const float* v, const int32_t* limit, int64_t end, float scale) {
  __m512i lim[kRowVectors];
  int32_t min_limit = std::numeric_limits<int32_t>::max();
  for (int r = 0; r < kRowVectors; ++r) lim[r] = _mm512_loadu_si512(limit + 16 * r);
  for (int i = 0; i < kTileRows; ++i) min_limit = std::min(min_limit, limit[i]);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t start = 0; start < end; start += kChunk) {
    const int64_t cn = std::min(kChunk, end - start);
    // Scores of the chunk, 8 keys at a time (a short last block repeats its last key; unused).
    for (int64_t kb = 0; kb < cn; kb += kKeyBlock) {
      const int64_t nk = std::min<int64_t>(kKeyBlock, cn - kb);
      const float* kr[kKeyBlock];
      for (int j = 0; j < kKeyBlock; ++j) kr[j] = k + (start + kb + std::min<int64_t>(j, nk - 1)) * D;
      __m512 a[kKeyBlock][kRowVectors];
      for (int j = 0; j < kKeyBlock; ++j)
        for (int r = 0; r < kRowVectors; ++r) a[j][r] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        __m512 qv[kRowVectors];
        for (int r = 0; r < kRowVectors; ++r) qv[r] = _mm512_load_ps(&t.qt[d][16 * r]);
        for (int j = 0; j < kKeyBlock; ++j) {
          const __m512 kv = _mm512_set1_ps(kr[j][d]);
          for (int r = 0; r < kRowVectors; ++r) a[j][r] = _mm512_fmadd_ps(qv[r], kv, a[j][r]);
        }
      }
      for (int j = 0; j < nk; ++j)
        for (int r = 0; r < kRowVectors; ++r) _mm512_store_ps(&t.s[kb + j][16 * r], _mm512_mul_ps(a[j][r], vscale));
    }
    // Online softmax per lane; keys at or past a lane's limit get probability exactly 0. Chunks
    // inside every limit (all but the causal diagonal's) take the unmasked loops: one array of
    // masks for every chunk measured ~20% slower than comparing twice in the masked ones.
    const bool masked = start + cn > min_limit;
    for (int r = 0; r < kRowVectors; ++r) {
      __m512 m = t.row_max[r];
      for (int64_t j = 0; j < cn; ++j) {
        const __m512 x = _mm512_load_ps(&t.s[j][16 * r]);
        if (masked) {
          const __mmask16 seen = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(start + j)), lim[r]);
          m = _mm512_mask_max_ps(m, seen, m, x);
        } else {
          m = _mm512_max_ps(m, x);
        }
      }
      // Every lane has seen a key by now (limits >= 1, chunk 0 holds key 0), so m is finite.
      const __m512 alpha = thaw_cpu::exp16(_mm512_sub_ps(t.row_max[r], m));  // ~0 on the first chunk
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < cn; ++j) {
        __m512 p = thaw_cpu::exp16(_mm512_sub_ps(_mm512_load_ps(&t.s[j][16 * r]), m));
        if (masked) {
          const __mmask16 seen = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(start + j)), lim[r]);
          p = _mm512_maskz_mov_ps(seen, p);
        }
        sum = _mm512_add_ps(sum, p);
        _mm512_store_ps(&t.s[j][16 * r], p);
      }
      t.row_sum[r] = _mm512_fmadd_ps(t.row_sum[r], alpha, sum);
      t.row_max[r] = m;
      for (int d = 0; d < D; ++d)
        _mm512_store_ps(&t.acc[d][16 * r], _mm512_mul_ps(_mm512_load_ps(&t.acc[d][16 * r]), alpha));
    }
    // O^T += P^T V, 8 output dims at a time over the chunk's keys.
    const float* vc = v + start * D;
    for (int c0 = 0; c0 < D; c0 += kDimBlock) {
      __m512 o[kDimBlock][kRowVectors];
      for (int i = 0; i < kDimBlock; ++i)
        for (int r = 0; r < kRowVectors; ++r) o[i][r] = _mm512_load_ps(&t.acc[c0 + i][16 * r]);
      for (int64_t j = 0; j < cn; ++j) {
        __m512 pv[kRowVectors];
        for (int r = 0; r < kRowVectors; ++r) pv[r] = _mm512_load_ps(&t.s[j][16 * r]);
        const float* vr = vc + j * D + c0;
        for (int i = 0; i < kDimBlock; ++i) {
          const __m512 vv = _mm512_set1_ps(vr[i]);
          for (int r = 0; r < kRowVectors; ++r) o[i][r] = _mm512_fmadd_ps(pv[r], vv, o[i][r]);
        }
      }
      for (int i = 0; i < kDimBlock; ++i)
        for (int r = 0; r < kRowVectors; ++r) _mm512_store_ps(&t.acc[c0 + i][16 * r], o[i][r]);
    }
  }
}

// Tile rows' limits for one key set: the given ones, padding rows at the largest; returns the largest.
int64_t tile_limits(const int32_t* given, int rows, int32_t* limit) {
  int32_t end = 1;
  for (int i = 0; i < rows; ++i) end = std::max(end, given[i]);
  for (int i = 0; i < kTileRows; ++i) limit[i] = i < rows ? given[i] : end;
  return end;
}

template <int D>
void dense_tiles(const float* q, const float* k, const float* v, int64_t h, int64_t m, int64_t n,
                 const int32_t* limits, float scale, float* out, float* lse) {
  const int64_t tiles_per_head = (m + kTileRows - 1) / kTileRows;
  at::parallel_for(0, h * tiles_per_head, 1, [&](int64_t begin, int64_t stop) {
    auto tile = std::make_unique<Tile<D>>();
    int32_t given[kTileRows], limit[kTileRows];
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t head = task / tiles_per_head, first = (task % tiles_per_head) * kTileRows;
      tile->rows = static_cast<int>(std::min<int64_t>(kTileRows, m - first));
      for (int i = 0; i < tile->rows; ++i) {
        const int64_t row = head * m + first + i;
        tile->q[i] = q + row * D;
        tile->out[i] = out + row * D;
        tile->lse[i] = lse + row;
        given[i] = limits != nullptr ? limits[first + i] : static_cast<int32_t>(n);
      }
      const int64_t end = tile_limits(given, tile->rows, limit);
      tile->start();
      attend_keys<D>(*tile, k + head * n * D, v + head * n * D, limit, end, scale);
      tile->finish();
    }
  });
}

template <int D>
void cascade_tiles(const float* q, const float* k_prefix, const float* v_prefix, const float* k_suffix,
                   const float* v_suffix, int64_t h, int64_t group, int64_t num_rows, int64_t p, int64_t s,
                   const int32_t* member_rows, const int32_t* member_keys, int64_t num_members,
                   const int32_t* suffix_limits, float scale, float* out) {
  // A tile holds rows of one member, any of the group's query heads (they share the member's keys):
  // the member's (g, r) rows in order, kTileRows at a time.
  struct Task { int64_t head, member, first; };
  std::vector<Task> tasks;
  for (int64_t head = 0; head < h; ++head)
    for (int64_t i = 0; i < num_members; ++i) {
      const int64_t rows = (member_rows[i + 1] - member_rows[i]) * group;
      for (int64_t first = 0; first < rows; first += kTileRows) tasks.push_back({head, i, first});
    }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t stop) {
    auto tile = std::make_unique<Tile<D>>();
    int32_t given[kTileRows], limit[kTileRows];
    for (int64_t t = begin; t < stop; ++t) {
      const Task& task = tasks[t];
      const int64_t first_row = member_rows[task.member], member_len = member_rows[task.member + 1] - first_row;
      tile->rows = static_cast<int>(std::min<int64_t>(kTileRows, member_len * group - task.first));
      for (int i = 0; i < tile->rows; ++i) {
        const int64_t flat = task.first + i, g = flat / member_len, r = first_row + flat % member_len;
        const int64_t row = task.head * group * num_rows + g * num_rows + r;  // in [H, G * R]
        tile->q[i] = q + row * D;
        tile->out[i] = out + row * D;
        tile->lse[i] = nullptr;
        given[i] = suffix_limits[r];
      }
      tile->start();
      for (int i = 0; i < kTileRows; ++i) limit[i] = static_cast<int32_t>(p);
      attend_keys<D>(*tile, k_prefix + task.head * p * D, v_prefix + task.head * p * D, limit, p, scale);
      const int64_t end = tile_limits(given, tile->rows, limit);
      const int64_t key0 = (task.head * s + member_keys[task.member]) * D;
      attend_keys<D>(*tile, k_suffix + key0, v_suffix + key0, limit, end, scale);
      tile->finish();
    }
  });
}

}  // namespace
#endif

void dense_prefill_f32(const float* q, const float* k, const float* v, int64_t h, int64_t m, int64_t n, int64_t d,
                       const int32_t* limits, float scale, float* out, float* lse) {
#if defined(THAW_PREFILL_F32)
  if (d == 64)
    dense_tiles<64>(q, k, v, h, m, n, limits, scale, out, lse);
  else
    dense_tiles<128>(q, k, v, h, m, n, limits, scale, out, lse);
#endif
}

void cascade_prefill_f32(const float* q, const float* k_prefix, const float* v_prefix, const float* k_suffix,
                         const float* v_suffix, int64_t h, int64_t group, int64_t num_rows, int64_t p, int64_t s,
                         int64_t d, const int32_t* member_rows, const int32_t* member_keys, int64_t num_members,
                         const int32_t* suffix_limits, float scale, float* out) {
#if defined(THAW_PREFILL_F32)
  if (d == 64)
    cascade_tiles<64>(q, k_prefix, v_prefix, k_suffix, v_suffix, h, group, num_rows, p, s, member_rows, member_keys,
                      num_members, suffix_limits, scale, out);
  else
    cascade_tiles<128>(q, k_prefix, v_prefix, k_suffix, v_suffix, h, group, num_rows, p, s, member_rows,
                       member_keys, num_members, suffix_limits, scale, out);
#endif
}

}  // namespace thaw_cpu
