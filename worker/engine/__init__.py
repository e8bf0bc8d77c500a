"""The engine: one process's continuous-batching loop over a paged KV cache.

`engine.Engine` steps it; under it, one owner per fact: `scheduler` decides what each step
computes and is the one writer of a request's progress (`Scheduler.update_from_output`);
`model_runner` is the one thing that executes the model's layers, a whole step or a layer at a
time (`execute`, `execute_layers`; `decode_graphs` replays its pass on CUDA), waiting at the layer
gate while weights arrive; `sampler` picks tokens (`step_logprobs` their log-probabilities);
`Engine.stats()` is the engine's load as one record (`engine_stats`); `request_lifecycle` is
the request table and the engine's public surface for moving requests; `request_admission`
checks and tokenizes what comes in; `zigzag_prefill` computes layers as they land; `kv_budget`
sizes the pool; `sequence` is one request's state.
Built on `worker.models`, `worker.loading`, `worker.kv` and `worker.text`.
"""
