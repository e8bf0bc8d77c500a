"""Memory a spare worker faults ahead of its model: the engine loads its weights into the reserved
block and builds its KV pool in the reserved buffer, with outputs identical to an engine without."""

from __future__ import annotations

import pytest

from loader import convert_checkpoint
from worker import Engine, EngineConfig, SamplingParams
from worker.engine.model_runner import kv_bytes_per_block
from worker.serving.process_warmup import warm_up_process
from worker.loading.reserved_memory import ReservedMemory

CONFIG = EngineConfig(num_kv_blocks=32, block_size=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello there", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def thaw_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("thaw") / "m"
    convert_checkpoint(tiny_llama_dir, out, progress=False)
    return out


def token_ids(engine: Engine) -> list[list[int]]:
    return [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]


def test_reserved_weights_and_kv_are_used_and_outputs_unchanged(thaw_dir):
    plain = Engine(thaw_dir, CONFIG)
    kv_bytes = CONFIG.num_kv_blocks * kv_bytes_per_block(plain.model_config, CONFIG.block_size,
                                                         plain.model_config.torch_dtype)
    reserved = ReservedMemory(weight_bytes=8 << 20, kv_bytes=kv_bytes + 4096)
    [block] = reserved.weights._blocks  # the one pre-faulted block
    engine = Engine(thaw_dir, CONFIG, reserved=reserved)
    embed = engine.runner.model.embed_tokens.weight
    assert embed.untyped_storage().data_ptr() == block.aligned.untyped_storage().data_ptr()  # read into it
    assert reserved.weights.num_bytes_in_use == block.capacity
    assert reserved.take_kv_buffer(1) is None  # the engine took the KV buffer: it is handed out once
    assert engine.runner.kv_pool.untyped_storage().nbytes() == kv_bytes + 4096
    assert token_ids(engine) == token_ids(plain)


def test_a_reservation_too_small_is_not_used(thaw_dir):
    reserved = ReservedMemory(weight_bytes=4096, kv_bytes=4096)
    engine = Engine(thaw_dir, CONFIG, reserved=reserved)
    [small, *fresh] = reserved.weights._blocks
    assert not small.in_use and len(fresh) == 1  # a fresh buffer for the weights
    assert reserved.take_kv_buffer(4096) is not None  # left untouched: the pool was allocated instead
    assert token_ids(engine) == token_ids(Engine(thaw_dir, CONFIG))


def test_bad_reservations_are_refused():
    with pytest.raises(ValueError, match="weight_bytes must be an integer >= 0"):
        ReservedMemory(weight_bytes=-1)
    with pytest.raises(ValueError, match="kv_bytes must be an integer >= 0"):
        ReservedMemory(kv_bytes=1.5)


def test_warm_up_runs_and_a_failing_one_is_only_logged(monkeypatch, caplog):
    assert warm_up_process() > 0

    def broken(dtypes):
        raise RuntimeError("no disk")

    monkeypatch.setattr("worker.serving.process_warmup._warm_up", broken)
    assert warm_up_process() >= 0
    assert "warm-up failed" in caplog.text


@pytest.mark.cuda
def test_warm_up_on_a_gpu_creates_the_context_and_compiles_the_kernels(caplog):
    import torch

    with caplog.at_level("ERROR"):
        assert warm_up_process(("float32",), cuda=True) > 0
    assert torch.cuda.is_initialized()
    assert not [r for r in caplog.records if "warm-up failed" in r.getMessage()]
