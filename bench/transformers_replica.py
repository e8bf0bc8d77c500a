"""The Ray Serve baseline's model server: `transformers_replica_app`, a deployment whose replica
loads a Hugging Face checkpoint with ``transformers`` and streams greedy tokens.

This is what a user builds without Thaw, and the baseline of both `bench/coldstart.py` and
`bench/multimodel.py`:
the deployment's name, its replica's CPUs (Ray sets the replica's intra-op threads from them) and
its autoscaling are parameters, so several models can each have their own deployment on one Ray,
and a replica may append one JSON line per finished load to a file (``start_log``) so a benchmark
counts the cold starts and their load times exactly instead of sampling replica states.

The request body is ``{"prompt": [token ids], "max_tokens": n}``; the answer is server-sent events,
one ``data: {"token": id}`` per generated token (no detokenizer: a random model's tokens need not
spell characters), then ``data: [DONE]``.

The replica class is defined inside the function, so Ray pickles it by value and a replica process
needs nothing of this repository on its path (the same reason `bench/coldstart.py` does so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def transformers_replica_app(model_dir: str, *, name: str, autoscaling: Mapping[str, Any], num_cpus: float,
                             max_ongoing_requests: int = 8, start_log: str | None = None):
    """A Ray Serve application of one deployment called `name` serving `model_dir` (bf16)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    if num_cpus <= 0:
        raise ValueError(f"num_cpus must be > 0 (a replica needs a CPU to compute on), got {num_cpus!r}")

    @serve.deployment(name=name, autoscaling_config=dict(autoscaling), ray_actor_options={"num_cpus": num_cpus},
                      max_ongoing_requests=max_ongoing_requests)
    class TransformersReplica:
        def __init__(self, path: str, deployment: str, log_path: str | None) -> None:
            import json
            import time

            started_s = time.time()
            import torch
            import transformers

            self.torch = torch
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            if log_path is not None:
                line = {"deployment": deployment, "started_at": started_s, "ready_at": time.time(),
                        "load_s": time.time() - started_s}
                with open(log_path, "a", encoding="utf-8") as log:
                    log.write(json.dumps(line) + "\n")  # one write per line: replicas append side by side

        async def __call__(self, request: Request) -> StreamingResponse:
            import json

            body = await request.json()
            torch, model = self.torch, self.model
            input_ids = torch.tensor([body["prompt"]])  # [1, T]
            max_tokens = int(body["max_tokens"])

            def events():
                past, x = None, input_ids
                with torch.inference_mode():
                    for _ in range(max_tokens):
                        out = model(input_ids=x, past_key_values=past, use_cache=True)
                        past = out.past_key_values
                        token = int(out.logits[0, -1].argmax())
                        yield f"data: {json.dumps({'token': token})}\n\n"
                        x = torch.tensor([[token]])  # [1, 1]
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return TransformersReplica.bind(model_dir, name, start_log)
