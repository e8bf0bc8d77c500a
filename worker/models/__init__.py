"""The models: what a checkpoint is and the layers that compute it (the bottom layer).

`model_config` reads a Hugging Face ``config.json`` into a `ModelConfig` (or refuses it, naming
why); `llama` is the decoder every supported family shares (Llama 3, Mistral, Qwen, Phi-3, MoE
through `moe`), `gemma` its Gemma variant, `model_family` picks one; `rotary_embedding` the
rope tables; `weight_packing` how linear weights are laid out for the CPU kernels;
`demo_model` writes a small local checkpoint. Imports nothing else of the worker.
"""
