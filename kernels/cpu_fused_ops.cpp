// Fused element-wise steps of a decoder layer on CPU: RMSNorm (alone, or after the residual add),
// SiLU-and-multiply, rotary embedding.
//
// Why: at decode batch sizes each of these is a chain of 5-8 small PyTorch ops (RMSNorm: upcast,
// square, mean, add, rsqrt, multiply, downcast, multiply by the weight), and on CPU each op costs
// a dispatch, an allocation and a pass over memory; in bfloat16 each also widens and narrows its
// operands. One pass per row does the same arithmetic in a fraction of the time.
//
// Numerics: the same operations in the same order and precision as the PyTorch code they replace
// (worker/llama.py's RMSNorm, MLP and worker/rotary_embedding.apply_rope, which follow
// transformers), including every intermediate rounding to bfloat16 that PyTorch does between two
// ops: results are bit-identical to it in float32 except for the order of the mean's sum in
// RMSNorm (last-bit differences) and exp's last bit in SiLU, and in bfloat16 the same up to those.
//
// Determinism: a row's result depends on its values only -- not on its address, the number of
// rows or threads. Sums run in 16 fixed lanes, then a fixed tree (a compiler-vectorised
// `#pragma omp simd reduction` may peel to an aligned address first, so a row's sum -- and a
// bfloat16 rounding after it -- would change with where the row sits: a model fed layer by layer
// then differed from the same model loaded whole).
//
// Threads: rows are split over threads only when a call has enough work to pay for waking them
// (decode batches run on the calling thread: the fork cost more than the work).
//
// Layouts: rows are the first dimension; the last dimension (and, for rope, the head dimension)
// must be contiguous; the row stride may be anything (a slice of a fused projection's output).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX512F__)
#include "cpu_vec_math.h"
#endif

namespace {

constexpr int kLanes = 16;
// Elements a call must touch before its rows are split over threads.
constexpr int64_t kParallelElements = 1 << 16;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements));
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t wide = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// float -> bfloat16 bits, round to nearest even, NaN kept a (quiet) NaN: c10's conversion,
// written branch-free so loops over it vectorise.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (x != x) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// Rounds like a PyTorch op producing `T` from a float32 result.
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const at::BFloat16*) {
  const uint32_t wide = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(at::BFloat16* p, int64_t i, float x) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(x); }

#if defined(__AVX512F__)
// 16 values at a time, with the same roundings as the scalar helpers above.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 round16(__m512 x, const float*) { return x; }
inline __m512 round16(__m512 x, const at::BFloat16*) {  // bf16_bits, widened back
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(x, p)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif

// Sum of squares of n values in 16 fixed lanes, then a fixed tree, then the tail.
template <typename T>
float sum_squares(const T* row, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = load(row, i + j);
      acc[j] += v * v;
    }
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  float sum = acc[0];
  for (; i < n; ++i) {
    const float v = load(row, i);
    sum += v * v;
  }
  return sum;
}

// out = weight * (x * rsqrt(mean(x**2) + eps)).to(T), as transformers' Llama RMSNorm.
template <typename T>
inline void normalise_row(T* out, const T* x, const T* weight, int64_t hidden, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, hidden) / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const float normed = round_to(load(x, i) * inv, x);
    store(out, i, load(weight, i) * normed);
  }
}

template <typename T>
void rms_norm_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1), x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalise_row(op + r * hidden, xp + r * x_stride, wp, hidden, feps);
  });
}

template <typename T>
void add_rms_norm_impl(torch::Tensor& sum, torch::Tensor& normed, const torch::Tensor& x,
                       const torch::Tensor& delta, const torch::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1), x_stride = x.stride(0), d_stride = delta.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* np = normed.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = xp + r * x_stride;
      const T* b = dp + r * d_stride;
      T* s = sp + r * hidden;
      // x + delta rounded to T (PyTorch's add), then the norm of that rounded sum
      for (int64_t i = 0; i < hidden; ++i) store(s, i, load(a, i) + load(b, i));
      normalise_row(np + r * hidden, static_cast<const T*>(s), wp, hidden, feps);
    }
  });
}

// silu(g) = g / (1 + exp(-g)) for 16 values (PyTorch's formula; exp to ~1 ulp).
inline void silu16(const float* g, float* out) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_loadu_ps(g);
  const __m512 e = thaw_cpu::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  _mm512_storeu_ps(out, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
#else
  for (int j = 0; j < kLanes; ++j) out[j] = g[j] / (1.f + std::exp(-g[j]));
#endif
}

template <typename T>
void silu_and_mul_impl(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t rows = x.size(0), width = x.size(1) / 2, x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    float g[kLanes], s[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * x_stride;
      const T* up = gate + width;
      T* orow = op + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + kLanes <= width; i += kLanes) {
        const __m512 x = load16(gate + i);
        const __m512 minus_x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), thaw_cpu::exp16(minus_x)));
        store16(orow + i, _mm512_mul_ps(round16(silu, gate), load16(up + i)));
      }
#endif
      for (; i + kLanes <= width; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) g[j] = load(gate, i + j);
        silu16(g, s);
        // F.silu(gate) rounded to T, then times up
        for (int j = 0; j < kLanes; ++j) store(orow, i + j, round_to(s[j], gate) * load(up, i + j));
      }
      if (i < width) {
        const int64_t left = width - i;
        for (int j = 0; j < kLanes; ++j) g[j] = j < left ? load(gate, i + j) : 0.f;
        silu16(g, s);
        for (int64_t j = 0; j < left; ++j) store(orow, i + j, round_to(s[j], gate) * load(up, i + j));
      }
    }
  });
}

template <typename T>
void rope_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t rotary = cos.size(1), half = rotary / 2;
  const int64_t x_stride = x.stride(0), x_head_stride = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * rotary;
      const T* s = sp + t * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = xp + t * x_stride + h * x_head_stride;
        T* o = op + (t * heads + h) * head_dim;
        // x * cos + cat(-x2, x1) * sin, each product rounded to T before the sum (as PyTorch's ops)
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + kLanes <= half; i += kLanes) {
          const __m512 x1 = load16(in + i), x2 = load16(in + i + half);
          const __m512 minus_x2 =  // -x2 exactly (a sign flip, zeros included)
              _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
          store16(o + i, _mm512_add_ps(round16(_mm512_mul_ps(x1, load16(c + i)), in),
                                       round16(_mm512_mul_ps(minus_x2, load16(s + i)), in)));
          store16(o + i + half, _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(c + i + half)), in),
                                              round16(_mm512_mul_ps(x1, load16(s + i + half)), in)));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = load(in, i), x2 = load(in, i + half);
          store(o, i, round_to(x1 * load(c, i), in) + round_to(-x2 * load(s, i), in));
          store(o, i + half, round_to(x2 * load(c, i + half), in) + round_to(x1 * load(s, i + half), in));
        }
        for (int64_t i = rotary; i < head_dim; ++i) store(o, i, load(in, i));  // partial rotary: pass through
      }
    }
  });
}

void check_cpu_float(const torch::Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

bool is_float_kind(c10::ScalarType dtype) { return dtype == torch::kFloat32 || dtype == torch::kBFloat16; }

void check_norm_inputs(const char* op, const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(is_float_kind(x.scalar_type()), op, ": float32 or bfloat16 only");
  check_cpu_float(x, "x", x.scalar_type());
  check_cpu_float(weight, "weight", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, H] with a contiguous last dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight must be [H]");
}

}  // namespace

// x: [T, H] (last dim contiguous), weight: [H] -> [T, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm_inputs("rms_norm", x, weight);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(out, x, weight, eps);
  else rms_norm_impl<at::BFloat16>(out, x, weight, eps);
  return out;
}

// x, delta: [T, H] (last dims contiguous), weight: [H] -> (x + delta, rms_norm(x + delta)), each [T, H]
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps) {
  check_norm_inputs("add_rms_norm", x, weight);
  check_cpu_float(delta, "delta", x.scalar_type());
  TORCH_CHECK(delta.dim() == 2 && delta.size(0) == x.size(0) && delta.size(1) == x.size(1) && delta.stride(1) == 1,
              "add_rms_norm: delta must be [T, H] like x, with a contiguous last dimension");
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  auto normed = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32) add_rms_norm_impl<float>(sum, normed, x, delta, weight, eps);
  else add_rms_norm_impl<at::BFloat16>(sum, normed, x, delta, weight, eps);
  return {sum, normed};
}

// x: [T, 2I] (gate then up, last dim contiguous) -> [T, I]
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(is_float_kind(x.scalar_type()), "silu_and_mul: float32 or bfloat16 only");
  check_cpu_float(x, "x", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2I] with a contiguous last dimension");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(out, x);
  else silu_and_mul_impl<at::BFloat16>(out, x);
  return out;
}

// x: [T, H, D] (last dim contiguous), cos/sin: [T, R] contiguous, R <= D even -> [T, H, D]
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(is_float_kind(x.scalar_type()), "rope: float32 or bfloat16 only");
  check_cpu_float(x, "x", x.scalar_type());
  check_cpu_float(cos, "cos", x.scalar_type());
  check_cpu_float(sin, "sin", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope: x must be [T, H, D] with a contiguous last dimension");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0,
              "rope: cos and sin must be contiguous [T, R] with R even and <= D");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == torch::kFloat32) rope_impl<float>(out, x, cos, sin);
  else rope_impl<at::BFloat16>(out, x, cos, sin);
  return out;
}
