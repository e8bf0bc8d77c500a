// Fused element-wise steps of a decoder layer on CPU: RMSNorm, SiLU-and-multiply, rotary embedding.
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
// RMSNorm (last-bit differences), and in bfloat16 the same up to that and to exp's last bit.
//
// Layouts: rows are the first dimension; the last dimension (and, for rope, the head dimension)
// must be contiguous; the row stride may be anything (a slice of a fused projection's output).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t wide = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// Rounds like a PyTorch op producing `T` from a float32 result (bfloat16: round to nearest even).
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, at::BFloat16*) { return static_cast<float>(static_cast<at::BFloat16>(x)); }

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(at::BFloat16* p, int64_t i, float x) { p[i] = static_cast<at::BFloat16>(x); }

void check_cpu_float(const torch::Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

bool is_float_kind(c10::ScalarType dtype) { return dtype == torch::kFloat32 || dtype == torch::kBFloat16; }

template <typename T>
void rms_norm_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1), x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * x_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = load(row, i);
        sum += v * v;
      }
      // transformers: x * torch.rsqrt(mean(x**2) + eps), cast to the model dtype, times the weight
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + feps);
      T* orow = op + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float normed = round_to(load(row, i) * inv, static_cast<T*>(nullptr));
        store(orow, i, load(wp, i) * normed);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t rows = x.size(0), width = x.size(1) / 2, x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * x_stride;
      const T* up = gate + width;
      T* orow = op + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = load(gate, i);
        // F.silu(gate) rounded to T, then times up (PyTorch's x / (1 + exp(-x)))
        const float s = round_to(g / (1.f + std::exp(-g)), static_cast<T*>(nullptr));
        store(orow, i, s * load(up, i));
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
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * rotary;
      const T* s = sp + t * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = xp + t * x_stride + h * x_head_stride;
        T* o = op + (t * heads + h) * head_dim;
        // x * cos + cat(-x2, x1) * sin, each product rounded to T before the sum (as two PyTorch ops)
        for (int64_t i = 0; i < rotary; ++i) {
          const float rotated = i < half ? -load(in, i + half) : load(in, i - half);
          const float a = round_to(load(in, i) * load(c, i), static_cast<T*>(nullptr));
          const float b = round_to(rotated * load(s, i), static_cast<T*>(nullptr));
          store(o, i, a + b);
        }
        for (int64_t i = rotary; i < head_dim; ++i) store(o, i, load(in, i));  // partial rotary: pass through
      }
    }
  });
}

}  // namespace

// x: [T, H] (last dim contiguous), weight: [H] -> [T, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(is_float_kind(x.scalar_type()), "rms_norm: float32 or bfloat16 only");
  check_cpu_float(x, "x", x.scalar_type());
  check_cpu_float(weight, "weight", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with a contiguous last dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "rms_norm: weight must be [H]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(out, x, weight, eps);
  else rms_norm_impl<at::BFloat16>(out, x, weight, eps);
  return out;
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
