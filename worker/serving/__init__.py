"""An engine served: the asyncio wrapper, the model instance, its Ray actor and the slot host.

`async_engine` steps an engine on its own thread and streams each request's output; `step_turns`
interleaves co-resident engines' steps; `instance_worker` is one model instance (load, generate,
abort, stats); `instance_worker_actor` the instance as a Ray actor; `slot_host` one process
hosting several instances on a slot; `process_warmup` readies a spare process before a model
is assigned. The top layer: nothing else of the worker imports it.
"""
