"""Migration between two engines on a GPU: the snapshot (with a CUDA generator's state) and the
KV blocks travel through host memory and pickling, as they do between Ray actors, and the moved
request finishes with exactly the tokens it would have produced unmoved, greedy or seeded, with
decode steps replayed from CUDA graphs on both sides."""

from __future__ import annotations

import pickle

import pytest

from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model
from worker.transfer.engine_migration import export_kv, freeze_request, import_request, release_request

pytestmark = pytest.mark.cuda

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
CONFIG = EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=16, device="cuda")
PROMPT = "Paged attention stores keys and values"


def tokens_of(engine: Engine, rid: str, outputs, into: list[int]) -> str | None:
    finish = None
    for out in outputs:
        if out.request_id == rid:
            into.extend(out.new_token_ids)
            finish = out.finish_reason
    return finish


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-blocks"])
def test_a_request_moves_between_gpu_engines_unchanged(tmp_path, params, with_kv):
    model_dir = write_demo_model(tmp_path / "demo", TINY_DEMO)
    source, dest = Engine(model_dir, CONFIG), Engine(model_dir, CONFIG)
    assert source.runner.decode_graphs is not None and source.runner.kv_pool.is_cuda

    unmoved: list[int] = []
    rid = source.add_request(PROMPT, params, request_id="alone")
    while source.has_unfinished_requests():
        tokens_of(source, rid, source.step(), unmoved)

    moved: list[int] = []
    rid = source.add_request(PROMPT, params, request_id="moving")
    for _ in range(9):
        tokens_of(source, rid, source.step(), moved)
    snapshot = pickle.loads(pickle.dumps(freeze_request(source, rid)))
    kv = export_kv(source, rid, 0, include_partial=True)[1].cpu() if with_kv else None
    import_request(dest, pickle.loads(pickle.dumps(snapshot)), kv)
    assert tokens_of(source, rid, [release_request(source, rid)], moved) == "migrated"
    finish = None
    while dest.has_unfinished_requests():
        finish = tokens_of(dest, rid, dest.step(), moved) or finish
    assert moved == unmoved and finish == "length"
