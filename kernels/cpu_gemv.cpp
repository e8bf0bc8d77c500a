// A float32 matrix-vector product for the few rows of a batch-1 decode step: y = x W^T + b.
//
// Why: at one or two activation rows a linear layer is a pass over its weight, so its speed is
// the memory bandwidth it reaches. MKL's sgemv on the plain row-major weight reaches ~12.8 GB/s
// on the developers' 2-core VM, oneDNN's blocked weight less (kernels/cpu_linear.py); a loop that
// streams 4 weight rows at a time against the activations held in registers, split over the
// threads by output rows, reads the weight once at the machine's streaming rate.
//
// Numerics: float32 products summed in float32, 16 lanes then a tree over the lanes: another
// summation order than MKL's (results differ in the last bits, as any two GEMM libraries do).
//
// Layouts: x [M, K] and W [N, K] row-major with contiguous rows (x's row stride may be larger),
// b [N] or empty, y [M, N] freshly allocated. M <= kMaxRows.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kRowsPerStep = 4;  // weight rows streamed together (4 reads in flight)
constexpr int64_t kGrain = 32;       // output rows per parallel task

template <int M>
void gemv_rows(const float* x, int64_t x_stride, const float* w, const float* bias, float* y, int64_t y_stride,
               int64_t k_size, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
#if defined(__AVX512F__)
  const int64_t k_vec = k_size - k_size % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k_size % 16)) - 1u);
  for (; n + kRowsPerStep <= n_end; n += kRowsPerStep) {
    __m512 acc[kRowsPerStep][M];
    for (int r = 0; r < kRowsPerStep; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const float* w0 = w + n * k_size;
    for (int64_t k = 0; k < k_vec; k += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * x_stride + k);
      for (int r = 0; r < kRowsPerStep; ++r) {
        const __m512 wv = _mm512_loadu_ps(w0 + r * k_size + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    if (tail) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, x + m * x_stride + k_vec);
      for (int r = 0; r < kRowsPerStep; ++r) {
        const __m512 wv = _mm512_maskz_loadu_ps(tail, w0 + r * k_size + k_vec);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < kRowsPerStep; ++r) {
      const float b = bias != nullptr ? bias[n + r] : 0.0f;
      for (int m = 0; m < M; ++m) y[m * y_stride + n + r] = _mm512_reduce_add_ps(acc[r][m]) + b;
    }
  }
#endif
  for (; n < n_end; ++n) {  // the rows left over (all of them without AVX-512)
    const float* wr = w + n * k_size;
    for (int m = 0; m < M; ++m) {
      const float* xr = x + m * x_stride;
      float sum = 0.0f;
      for (int64_t k = 0; k < k_size; ++k) sum += wr[k] * xr[k];
      y[m * y_stride + n] = sum + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

template <int M>
void gemv(const float* x, int64_t x_stride, const float* w, const float* bias, float* y, int64_t n_size,
          int64_t k_size) {
  at::parallel_for(0, (n_size + kGrain - 1) / kGrain, 1, [&](int64_t begin, int64_t end) {
    gemv_rows<M>(x, x_stride, w, bias, y, n_size, k_size, begin * kGrain, std::min(end * kGrain, n_size));
  });
}

}  // namespace

torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_gemv: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "linear_gemv: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_gemv: x [M, K] and weight [N, K] must agree on K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "linear_gemv: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "linear_gemv: rows must be contiguous");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat && bias.is_contiguous() &&
                            bias.numel() == weight.size(0)),
              "linear_gemv: bias must be float32 [N]");
  const int64_t m_size = x.size(0), n_size = weight.size(0), k_size = weight.size(1);
  auto y = torch::empty({m_size, n_size}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  switch (m_size) {
    case 1: gemv<1>(xp, xs, wp, bp, yp, n_size, k_size); break;
    case 2: gemv<2>(xp, xs, wp, bp, yp, n_size, k_size); break;
    case 3: gemv<3>(xp, xs, wp, bp, yp, n_size, k_size); break;
    default: gemv<4>(xp, xs, wp, bp, yp, n_size, k_size); break;
  }
  return y;
}
