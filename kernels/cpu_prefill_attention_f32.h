// The float32 prefill attention kernel (cpu_prefill_attention_f32.cpp), called by the entry points of
// cpu_prefill_attention.cpp once they have checked the tensors. Layouts are those entries' (contiguous
// float32): q [H, M, D], keys and values [H, N, D]; D is 64 or 128.
#pragma once

#include <cstdint>

namespace thaw_cpu {

// Whether the kernel was built (AVX-512F at build time); elsewhere callers keep PyTorch's op.
bool prefill_f32_available();

// Row m of head h attends to keys [0, limits[m]) of head h's k, v (every limits[m] in 1..N);
// out [H, M, D], lse [H, M] (natural log of the row's sum of exp(scale * q.k)).
void dense_prefill_f32(const float* q, const float* k, const float* v, int64_t h, int64_t m, int64_t n, int64_t d,
                       const int32_t* limits, float scale, float* out, float* lse);

// A burst behind one shared prefix: q [H, G * R, D] (row g * R + r is query head g's row r), the
// prefix's keys [H, P, D], the members' own keys [H, S, D] (member i: rows member_rows[i] to
// member_rows[i + 1], keys member_keys[i] to member_keys[i + 1]); row r sees the whole prefix, then
// the first suffix_limits[r] keys of its member's. out [H, G * R, D].
void cascade_prefill_f32(const float* q, const float* k_prefix, const float* v_prefix, const float* k_suffix,
                         const float* v_suffix, int64_t h, int64_t group, int64_t num_rows, int64_t p, int64_t s,
                         int64_t d, const int32_t* member_rows, const int32_t* member_keys, int64_t num_members,
                         const int32_t* suffix_limits, float scale, float* out);

}  // namespace thaw_cpu
