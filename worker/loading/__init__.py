"""Weights on their way in and out: a checkpoint read into a model, layer by layer as it lands.

`checkpoint` loads a model dir (or a `loader` layer source) into the model's parameters;
`layer_gate` holds a step before a layer whose weights have not arrived (`LayerLoadError` when
they cannot); `peer_weights` streams them from a running peer; `host_weights` moves a sleeping
engine's weights to pinned host memory and back; `checkpoint_identity` names what a model dir
holds; `host_allocator` and `reserved_memory` size a process's memory. Built on `worker.models`.
"""
