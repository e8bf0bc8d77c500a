"""Requests moving between engines: live migration and a prefill handed over at a layer.

`engine_migration` (export, freeze, release a request; its KV blocks out and in; import one) and
`layer_handoff` are built only on ``Engine.requests`` (`worker.engine.request_lifecycle`);
`request_progress` says where a request stands for a client whose stream went quiet.
"""
