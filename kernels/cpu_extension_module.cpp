// The Python module of Thaw's CPU kernels: one extension, one build, several source files.
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            double scale, int64_t sliding_window, double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, torch::Tensor bias);
bool prefill_attention_available();
namespace thaw_cpu {
bool prefill_f32_available();
}
std::vector<torch::Tensor> dense_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                   torch::Tensor limits, double scale);
torch::Tensor cascade_prefill_attention(torch::Tensor q, torch::Tensor k_prefix, torch::Tensor v_prefix,
                                        torch::Tensor k_suffix, torch::Tensor v_suffix, torch::Tensor member_rows,
                                        torch::Tensor member_keys, torch::Tensor suffix_limits, int64_t group,
                                        double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, float32 or bfloat16)");
  m.def("rms_norm", &rms_norm, "RMSNorm as transformers' Llama computes it (CPU, float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)): a residual add and the next norm (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of a fused gate_up projection (CPU)");
  m.def("rope", &rope, "Rotary embedding, rotate-half layout, partial rotary (CPU)");
  m.def("prefill_attention_available", &prefill_attention_available,
        "Whether dense_prefill_attention was built (AVX512-BF16 at build time)");
  m.def("prefill_attention_f32_available", &thaw_cpu::prefill_f32_available,
        "Whether the float32 prefill attention kernel was built (AVX-512F at build time)");
  m.def("dense_prefill_attention", &dense_prefill_attention,
        "Flash attention of [H, M, D] bf16 or float32 queries over [H, N, D] keys/values, per-row key limits; (out, lse)");
  m.def("cascade_prefill_attention", &cascade_prefill_attention,
        "Cascade attention (bf16 or float32): every row over a shared prefix, then over its member's own keys");
  m.def("linear_gemv", &linear_gemv, "x W^T + b for 1-4 float32 rows, streaming the weight (CPU)");
}
