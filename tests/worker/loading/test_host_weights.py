"""Weights parked in host memory while an engine sleeps (`worker.loading.host_weights`): every byte leaves the
device copy and comes back bit for bit, shared tensors stay shared, and an engine that sleeps this
way serves the same greedy tokens after waking (on CPU by choice; on CUDA by default, graphs re-captured)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from tests.model_factory import make_hf_checkpoint
from worker import Engine, EngineConfig, InstanceWorker, SamplingParams
from worker.loading.checkpoint import load_model
from worker.loading.host_weights import HostWeights
from worker.models.model_config import ModelConfig

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 8, 99, 3], [120, 7, 7, 64], [250, 31, 2, 88, 14, 19, 140, 61, 9]]


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tiny Llama whose head is its embedding matrix."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tied-llama"), "llama", seed=4, tie_word_embeddings=True)


def model_tensors(model) -> list[torch.Tensor]:
    """The strided tensors a model holds: parameters, buffers and plain attributes (a packed head's
    plain weight and bias), each object once."""
    attributes = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    found = {id(t): t for t in [*model.parameters(), *model.buffers(), *attributes] if t.layout == torch.strided}
    return list(found.values())


def distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors with shared memory counted once (every tensor here views its storage
    from offset 0, so a storage's bytes are its largest view's)."""
    by_storage: dict[int, int] = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        by_storage[ptr] = max(by_storage.get(ptr, 0), t.numel() * t.element_size())
    return sum(by_storage.values())


def storage_ptrs(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_weights_go_to_one_host_copy_and_come_back_bit_identical(tied_llama_dir):
    config = ModelConfig.from_model_dir(tied_llama_dir, dtype="float32")
    model, _ = load_model(tied_llama_dir, config)
    tensors = model_tensors(model)
    assert model.lm_head is None  # tied: the embedding is the head, one tensor for both
    expected = (sum(p.numel() for p in model.parameters()) + model.inv_freq.numel()) * 4
    # float32: 2 layers x 36,992 + the 1024 x 64 embedding (the head too) + the final norm's 64 + 8 RoPE frequencies
    assert expected == 4 * (2 * 36_992 + 1024 * 64 + 64 + 8) == 558_368
    before = [t.clone() for t in tensors]
    device_ptrs = storage_ptrs(tensors)
    assert len(device_ptrs) == len(tensors)  # one storage each
    weights = HostWeights(model, CPU, pin_memory=False)

    assert weights.offload() == expected == weights.num_bytes
    host_ptrs = storage_ptrs(tensors)
    assert weights.on_host and len(host_ptrs) == 1 and not host_ptrs & device_ptrs  # all in the one host buffer
    assert weights.offload() == 0  # already there
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))

    assert weights.restore() == expected
    assert not weights.on_host and weights.restore() == 0
    assert len(storage_ptrs(tensors)) == len(tensors) and not storage_ptrs(tensors) & host_ptrs
    assert all(t.device == CPU and torch.equal(t, b) and t.stride() == b.stride() for t, b in zip(tensors, before))
    assert model_tensors(model) == tensors  # the same Parameter objects, re-pointed in place


def test_shared_tensors_move_once_and_stay_shared(tied_llama_dir):
    """A pre-packed tied head keeps a plain copy that is a view of the embedding matrix: one storage
    for two tensors, copied once, and one storage for both again after the copy back."""
    engine = Engine(tied_llama_dir, EngineConfig(num_kv_blocks=16, dtype="float32"))
    model = engine.runner.model
    head, embedding = model.lm_head.plain_weight, model.embed_tokens.weight
    assert head.data_ptr() == embedding.data_ptr()
    tensors = model_tensors(model)
    expected = distinct_bytes(tensors)
    assert expected == sum(t.numel() * t.element_size() for t in tensors) - embedding.numel() * 4
    before = [t.clone() for t in tensors]
    weights = HostWeights(model, CPU, pin_memory=False)

    assert weights.offload() == expected
    assert head.data_ptr() == embedding.data_ptr()
    assert weights.restore() == expected
    assert head.data_ptr() == embedding.data_ptr()
    assert model.lm_head.plain_weight is head and model.embed_tokens.weight is embedding
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_pinning_is_refused_without_an_accelerator():
    with pytest.raises(ValueError, match="pin_memory needs an accelerator device"):
        HostWeights(torch.nn.Linear(2, 2), CPU, pin_memory=True)


def test_sleep_offloads_weights_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="sleep_offloads_weights must be true, false or None .by device., got 'yes'"):
        EngineConfig(sleep_offloads_weights="yes")


def test_a_cpu_engine_asked_to_offload_frees_pool_and_weights_and_serves_the_same_tokens(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32",
                                                 sleep_offloads_weights=True))
    assert engine.sleep_frees_weights
    before = [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]
    assert len({t for tokens in before for t in tokens}) > 3  # not one token repeated: a real check
    model = engine.runner.model
    tensors = model_tensors(model)
    weight_bytes = distinct_bytes(tensors)
    pool_bytes = engine.runner.kv_pool_bytes
    device_ptrs = storage_ptrs(tensors)

    assert engine.sleep() == pool_bytes + weight_bytes
    assert (engine.asleep, engine.runner.kv_pool_bytes, engine.host_weights.num_bytes) == (True, 0, weight_bytes)
    assert len(storage_ptrs(tensors)) == 1 and not storage_ptrs(tensors) & device_ptrs
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request(PROMPTS[0], GREEDY)
    assert engine.sleep() == 0

    engine.wake()
    assert not engine.asleep and not engine.host_weights.on_host and engine.runner.kv_pool_bytes == pool_bytes
    after = [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]
    assert after == before


@pytest.mark.parametrize("arch", ["mixtral", "gemma3"])
def test_stacked_experts_and_gemma_buffers_round_trip(tmp_path, arch):
    """Mixtral's experts are stacked [E, 2I, H] and [E, H, I] parameters; Gemma 3 ties its head and
    holds its two RoPE settings as one stacked buffer. All of it leaves and comes back bit for bit."""
    model_dir = make_hf_checkpoint(tmp_path / arch, arch, seed=2)
    engine = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32",
                                            sleep_offloads_weights=True))
    before_tokens = [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]
    tensors = model_tensors(engine.runner.model)
    before = [t.clone() for t in tensors]
    freed = engine.runner.kv_pool_bytes + distinct_bytes(tensors)
    assert engine.sleep() == freed
    engine.wake()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)] == before_tokens


def test_deferred_packing_waits_while_the_weights_are_away(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=16, dtype="float32",
                                                 cpu_prepack_defer_bytes=0, sleep_offloads_weights=True))
    assert engine.weights_to_pack
    engine.sleep()
    assert (engine.weights_to_pack, engine.pack_weights_when_free()) == (False, 0)
    engine.wake()
    assert engine.weights_to_pack
    assert engine.pack_weights_when_free() == 4  # layer 0: qkv, o, gate_up, down


def test_an_asleep_engine_refuses_a_migrated_request(tiny_llama_dir):
    from worker import MigrationRefusedError
    from worker.transfer.engine_migration import begin_import, export_request

    source = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=16))
    request_id = source.add_request(PROMPTS[0], GREEDY)
    source.step()
    dest = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=16, sleep_offloads_weights=True))
    dest.sleep()
    with pytest.raises(MigrationRefusedError, match="this instance is asleep"):
        begin_import(dest, export_request(source, request_id))
    assert len(dest.requests) == 0


def test_a_cpu_engine_sleeps_with_its_weights_in_place_by_default(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=4, num_kv_blocks=16))
    tensors = model_tensors(engine.runner.model)
    ptrs = [t.data_ptr() for t in tensors]
    pool_bytes = engine.runner.kv_pool_bytes
    assert (engine.sleep_frees_weights, engine.host_weights) == (False, None)
    assert engine.sleep() == pool_bytes
    assert [t.data_ptr() for t in tensors] == ptrs
    engine.wake()
    assert engine.runner.kv_pool_bytes == pool_bytes


def test_the_instance_logs_what_its_sleep_moved(tiny_llama_dir, caplog):
    async def main():
        worker = InstanceWorker("inst-hw", "acme/tiny", tiny_llama_dir,
                                {"block_size": 4, "num_kv_blocks": 16, "sleep_offloads_weights": True})
        await worker.ready()
        engine = (await worker.serving_engine()).engine
        expected = engine.runner.kv_pool_bytes + distinct_bytes(model_tensors(engine.runner.model))
        with caplog.at_level(logging.INFO, logger="worker.serving.instance_worker"):
            freed = await worker.sleep()
            await worker.wake()
        moved = engine.host_weights.num_bytes
        await worker.shutdown()
        return freed, expected, moved

    freed, expected, moved = asyncio.run(main())
    assert freed == expected
    asleep, awake = [r.getMessage() for r in caplog.records if r.name == "worker.serving.instance_worker"][-2:]
    assert asleep.startswith(f"instance inst-hw asleep: {freed / 1e9:.3f} GB freed on cpu; weights "
                             f"({moved / 1e9:.3f} GB) moved to pageable host memory in ")
    assert awake.startswith("instance inst-hw awake in ")
    assert f"weights ({moved / 1e9:.3f} GB) copied back to cpu in " in awake


@pytest.mark.cuda
def test_a_cuda_engine_sleeps_in_host_memory_and_recaptures_its_graphs(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, device="cuda",
                                                 dtype="float32"))
    assert engine.sleep_frees_weights and engine.host_weights.pin_memory
    before = [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]
    assert engine.runner.decode_graphs.captured  # decode steps ran through graphs
    tensors = model_tensors(engine.runner.model)
    weight_bytes = distinct_bytes(tensors)
    pool_bytes = engine.runner.kv_pool_bytes
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()

    assert engine.sleep() == pool_bytes + weight_bytes
    assert allocated - torch.cuda.memory_allocated() >= pool_bytes + weight_bytes
    assert engine.runner.decode_graphs is None
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)

    engine.wake()
    assert all(t.device.type == "cuda" for t in tensors)
    assert engine.host_weights.restore_s > 0 and engine.runner.decode_graphs.captured == ()  # fresh, none yet
    after = [list(c.output_token_ids) for c in engine.generate(PROMPTS, GREEDY)]
    assert after == before
    assert engine.runner.decode_graphs.captured  # captured again, at the weights' new addresses
