"""An engine that starts before its weights: layers are assigned as they land, prefills compute each
layer as soon as it is in (swept zigzag across requests), and greedy outputs are token for token
those of an engine that loaded everything first. The weights come from a fake `LayerReadiness`
that releases a layer only when the test says so (one threading.Event per layer), so every claim
about overlap is proven by events, not timing."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading

import pytest
import torch

from loader import LayerReadiness
from tests.model_factory import make_hf_checkpoint
from tests.worker.bf16_greedy import assert_greedy_up_to_bf16_rounding
from worker import AsyncEngine, Engine, EngineConfig, LayerLoadError, SamplingParams
from worker.serving.async_engine import EngineDeadError
from worker.loading.checkpoint import CheckpointError, layer_state_dict, read_checkpoint, to_engine_state_dict
from worker.loading.layer_gate import LayerGate
from worker.models.llama import LlamaForCausalLM
from worker.models.model_config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Three short prompts and one longer than the per-step token budget (32): its first chunk is
# prefilled while weights arrive, the rest after.
PROMPTS = ["the cat sat", "a long walk home", "zig zag", list(range(5, 45))]
TIMEOUT_S = 60.0  # a deadline for every wait: a bug fails the test instead of hanging it


class FakeLayerSource:
    """A `LayerReadiness` over a Hugging Face checkpoint whose layers arrive when `release`d."""

    def __init__(self, model_dir) -> None:
        config = ModelConfig.from_model_dir(model_dir)
        self.num_layers = config.num_hidden_layers
        tensors, _ = read_checkpoint(model_dir)
        self.groups: dict[int, dict[str, torch.Tensor]] = {k: {} for k in range(-1, self.num_layers + 1)}
        for name, tensor in tensors.items():
            match = re.search(r"\blayers\.(\d+)\.", name)
            layer = int(match.group(1)) if match else -1 if "embed_tokens" in name else self.num_layers
            self.groups[layer][name] = tensor
        self.released = {k: threading.Event() for k in self.groups}
        self.error: BaseException | None = None

    def release(self, *layers: int) -> None:
        for layer in layers:
            self.released[layer].set()

    def release_all(self) -> None:
        self.release(*self.groups)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.release_all()  # wake every waiter: it raises

    def layer_ready(self, layer: int) -> bool:
        return self.error is None and self.released[layer].is_set()

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        if not self.released[layer].wait(timeout_s):
            raise TimeoutError(f"layer {layer} not in after {timeout_s} s")
        if self.error is not None:
            raise self.error
        return dict(self.groups[layer])

    def wait_all(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        return {name: t for layer in self.groups for name, t in self.wait_layer(layer, timeout_s).items()}


class Driver:
    """Steps an engine on a thread until it is idle (what `AsyncEngine` does), keeping what it got."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc

    def join(self) -> dict[str, list[int]]:
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the engine hung"
        return self.tokens


def land(source: FakeLayerSource, gate: LayerGate, *layers: int) -> None:
    """Releases `layers` and returns once the gate has assigned them (its own thread or this one)."""
    source.release(*layers)
    for layer in layers:
        gate.ensure(layer)


def run_all(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def config_only(model_dir, tmp_path):
    """A copy of `model_dir` without its weights: what a worker has before the stream starts."""
    dst = tmp_path / "no-weights"
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dst


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 32,
                           "layer_timeout_s": TIMEOUT_S} | overrides)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """Four decoder layers (room for a zigzag) and a head tied to the embedding."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tied-llama"), "llama", seed=12, num_hidden_layers=4,
                              tie_word_embeddings=True)


# ---- the per-layer state dict ---------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny_llama_dir", "tied_dir"])
def test_layer_state_dicts_make_up_the_whole_state_dict(model, request):
    model_dir = request.getfixturevalue(model)
    config = ModelConfig.from_model_dir(model_dir)
    source = FakeLayerSource(model_dir)
    whole = to_engine_state_dict({n: t for g in source.groups.values() for n, t in g.items()}, config)
    pieces = {}
    for layer, tensors in source.groups.items():
        state = layer_state_dict(layer, tensors, config)
        assert not set(state) & set(pieces)
        pieces |= state
    assert pieces.keys() == whole.keys()
    assert all(torch.equal(pieces[name], whole[name]) for name in whole)
    assert ("lm_head.weight" in whole) == (not config.tie_word_embeddings)


def test_layer_state_dict_names_what_is_wrong(tiny_llama_dir):
    config = ModelConfig.from_model_dir(tiny_llama_dir)
    source = FakeLayerSource(tiny_llama_dir)
    layer1 = dict(source.groups[1])
    del layer1["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"layer 1 of the checkpoint lacks tensor\(s\) model.layers.1.mlp.up"):
        layer_state_dict(1, layer1, config)
    with pytest.raises(CheckpointError, match="does not use: model.layers.0.self_attn.q_proj.weight"):
        layer_state_dict(1, source.groups[1] | {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, config)
    with pytest.raises(ValueError, match="layer 3 does not exist"):
        layer_state_dict(3, {}, config)


# ---- the gate alone -------------------------------------------------------------------------

def test_gate_assigns_each_layer_once_and_tracks_the_frontier(tiny_llama_dir):
    config = ModelConfig.from_model_dir(tiny_llama_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    source = FakeLayerSource(tiny_llama_dir)
    gate = LayerGate(source, model, timeout_s=TIMEOUT_S)
    assert isinstance(source, LayerReadiness)
    assert gate.assign_ready() == 0 and gate.frontier == 0  # nothing in: returns at once
    source.release(-1, 0, 2)  # layer 2 (final) lands out of order
    assert gate.assign_ready() == 2 and gate.frontier == 2  # -1 and 0; 2 waits behind the missing 1
    assert gate.is_assigned(0) and not gate.is_assigned(1) and not gate.is_assigned(2)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert not qkv.is_meta and not qkv.requires_grad
    gate.ensure(0)  # already in: nothing reassigned
    assert model.layers[0].self_attn.qkv_proj.weight is qkv
    gate.ensure(2)
    assert gate.frontier == 2 and not gate.complete and model.lm_head.weight.shape == (config.vocab_size, 64)
    source.release(1)
    assert gate.assign_ready() == 1 and gate.complete and gate.completed_at is not None
    assert not any(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="layer 3 does not exist"):
        gate.ensure(3)


def test_gate_failure_names_the_layer_and_sticks(tiny_llama_dir):
    config = ModelConfig.from_model_dir(tiny_llama_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    source = FakeLayerSource(tiny_llama_dir)
    gate = LayerGate(source, model, timeout_s=TIMEOUT_S)
    source.release(-1)
    gate.ensure(-1)
    source.fail(ConnectionError("peer went away"))
    with pytest.raises(LayerLoadError, match=r"layer 0 could not be made resident: ConnectionError: peer went away"):
        gate.ensure(0)
    with pytest.raises(LayerLoadError, match="layer 0"):  # the first failure is kept
        gate.ensure(1)
    gate.ensure(-1)  # what is resident stays usable
    assert gate.assign_ready() == 0 and "layer 0" in str(gate.error)


def test_gate_times_out_naming_the_layer(tiny_llama_dir):
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_model_dir(tiny_llama_dir))
    gate = LayerGate(FakeLayerSource(tiny_llama_dir), model, timeout_s=0.05)
    with pytest.raises(LayerLoadError, match=r"layer -1 \(embedding\) could not be made resident: TimeoutError"):
        gate.ensure(-1)


# ---- the engine -----------------------------------------------------------------------------

@pytest.mark.parametrize("model,dtype,zigzag", [
    ("tiny_llama_dir", "float32", True), ("tiny_llama_dir", "bfloat16", True),
    ("tied_dir", "float32", True), ("tiny_llama_dir", "float32", False),
])
def test_requests_sent_before_any_layer_match_a_loaded_engine(model, dtype, zigzag, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    config = engine_config(dtype=dtype, zigzag_prefill=zigzag)
    loaded = Engine(model_dir, config)
    want = [list(c.output_token_ids) for c in loaded.generate(PROMPTS, GREEDY)]

    source = FakeLayerSource(model_dir)
    engine = Engine(config_only(model_dir, tmp_path), config, weights=source)
    assert not engine.weights_resident and engine.load_s is None and "0 of" in engine.load_report
    layer0_computed = threading.Event()
    engine.runner.model.layers[0].register_forward_hook(lambda *_: layer0_computed.set())
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    driver = Driver(engine)
    source.release(-1, 0)
    # Compute overlaps the transfer: layer 0 ran while the final layer was still withheld.
    assert layer0_computed.wait(TIMEOUT_S)
    assert not source.released[source.num_layers].is_set() and not engine.weights_resident
    source.release_all()
    got = driver.join()
    assert driver.error is None
    if dtype == "float32":
        assert [got[rid] for rid in ids] == want
    else:
        # Weights arriving change how the long prompt is chunked (32 + 8 tokens here, 6 + 29 + 5
        # loaded), so its attention runs other paths that round differently in bfloat16: held to
        # transformers up to that rounding instead, as every bfloat16 path is (tests/worker/bf16_greedy.py).
        prompt_ids = [loaded.tokenizer.encode_prompt(p) for p in PROMPTS]
        assert_greedy_up_to_bf16_rounding(model_dir, prompt_ids, [list(got[rid]) for rid in ids])
    assert engine.weights_resident and engine.load_s > 0 and engine.runner.layer_gate is None
    assert engine.load_report.startswith(f"layer by layer from FakeLayerSource: {source.num_layers + 2} layers")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # fp32 weights were pre-packed per layer exactly where the loaded engine pre-packed them.
    kinds = [type(m).__name__ for m in engine.runner.model.modules()]
    assert kinds == [type(m).__name__ for m in loaded.runner.model.modules()]


def test_zigzag_a_prefill_at_the_frontier_waits_while_a_later_one_catches_up(tied_dir, tmp_path):
    config = engine_config()
    prompts = [list(range(10, 13)), list(range(20, 25)), list(range(30, 37))]  # 3, 5 and 7 tokens
    want = [list(c.output_token_ids) for c in Engine(tied_dir, config).generate(prompts, GREEDY)]
    source = FakeLayerSource(tied_dir)
    engine = Engine(config_only(tied_dir, tmp_path), config, weights=source)
    gate = engine.runner.layer_gate
    ran: list[tuple[int, int]] = []  # (decoder layer, tokens in the sub-batch): who ran which layer, in order
    for k, layer in enumerate(engine.runner.model.layers):
        layer.register_forward_hook(lambda _m, args, _out, k=k: ran.append((k, args[0].shape[0])))

    a, b = (engine.add_request(p, GREEDY) for p in prompts[:2])
    land(source, gate, -1, 0)
    assert engine.step() == [] and ran == [(0, 3), (0, 5)]  # both at the frontier (layer 1 missing)
    c = engine.add_request(prompts[2], GREEDY)
    land(source, gate, 1)
    assert engine.step() == []
    # The oldest move first; then the newcomer runs layers 0 and 1 while A and B wait at layer 2.
    assert ran[2:] == [(1, 3), (1, 5), (0, 7), (1, 7)]
    land(source, gate, 2, 3, 4)
    first = engine.step()  # the last layer is in: every prefill finishes, oldest first, in this step
    assert ran[6:] == [(2, 3), (3, 3), (2, 5), (3, 5), (2, 7), (3, 7)]
    assert [o.request_id for o in first] == [a, b, c] and all(o.num_output_tokens == 1 for o in first)
    rest = run_all(engine)
    assert [[o.new_token_ids[0] for o in first if o.request_id == rid] + rest[rid] for rid in (a, b, c)] == want


def test_abort_while_weights_arrive_frees_the_request(tiny_llama_dir, tmp_path):
    source = FakeLayerSource(tiny_llama_dir)
    engine = Engine(config_only(tiny_llama_dir, tmp_path), engine_config(), weights=source)
    gone, kept = engine.add_request("to be aborted", GREEDY), engine.add_request("the cat sat", GREEDY)
    land(source, engine.runner.layer_gate, -1, 0)
    engine.step()
    assert engine.abort(gone).finish_reason == "abort" and engine.num_unfinished_requests == 1
    source.release_all()
    [want] = Engine(tiny_llama_dir, engine_config()).generate(["the cat sat"], GREEDY)
    assert run_all(engine) == {kept: list(want.output_token_ids)}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("zigzag", [True, False])
def test_a_source_failure_fails_the_waiting_requests_naming_the_layer(zigzag, tiny_llama_dir, tmp_path):
    source = FakeLayerSource(tiny_llama_dir)
    engine = Engine(config_only(tiny_llama_dir, tmp_path), engine_config(zigzag_prefill=zigzag), weights=source)
    layer0_computed = threading.Event()
    engine.runner.model.layers[0].register_forward_hook(lambda *_: layer0_computed.set())
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    driver = Driver(engine)
    source.release(-1, 0)
    assert layer0_computed.wait(TIMEOUT_S)  # the driver now waits for layer 1
    source.fail(ConnectionError("peer went away"))
    driver.join()
    assert isinstance(driver.error, LayerLoadError) and "layer 1" in str(driver.error)
    assert "peer went away" in str(driver.error)
    assert engine.weights_error is not None and "layer 1" in str(engine.weights_error)
    assert not engine.weights_resident and engine.load_s is None and "failed after 2 of 4 layers" in engine.load_report
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(LayerLoadError, match="cannot serve.*layer 1"):
        engine.add_request("too late", GREEDY)


def test_async_streams_fail_with_the_layer_named(tiny_llama_dir, tmp_path):
    source = FakeLayerSource(tiny_llama_dir)
    engine = Engine(config_only(tiny_llama_dir, tmp_path), engine_config(), weights=source)
    layer0_computed = threading.Event()
    engine.runner.model.layers[0].register_forward_hook(lambda *_: layer0_computed.set())
    async_engine = AsyncEngine(engine)

    async def collect(prompt):
        return [out async for out in async_engine.generate(prompt, GREEDY)]

    async def main():
        streams = [asyncio.create_task(collect(p)) for p in PROMPTS[:2]]
        source.release(-1, 0)
        assert await asyncio.get_running_loop().run_in_executor(None, layer0_computed.wait, TIMEOUT_S)
        source.fail(ConnectionError("peer went away"))
        return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), TIMEOUT_S)

    try:
        results = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert all(isinstance(r, EngineDeadError) and "layer 1" in str(r) for r in results), results
    assert isinstance(async_engine.error, LayerLoadError)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "10"])
def test_layer_timeout_must_be_positive(value):
    with pytest.raises(ValueError, match="layer_timeout_s must be a positive number"):
        EngineConfig(layer_timeout_s=value)


def test_a_foreign_layer_fails_like_a_lost_one(tiny_llama_dir):
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_model_dir(tiny_llama_dir))
    source = FakeLayerSource(tiny_llama_dir)
    del source.groups[1]["model.layers.1.mlp.up_proj.weight"]
    gate = LayerGate(source, model, timeout_s=TIMEOUT_S)
    source.release_all()
    assert gate.assign_ready() == 2 and gate.frontier == 2  # -1 and 0; layer 1 is refused
    with pytest.raises(LayerLoadError, match=r"layer 1 could not be made resident: CheckpointError: .*up_proj"):
        gate.ensure(1)
    with pytest.raises(LayerLoadError, match="layer 1"):
        gate.ensure(2)


def test_the_thaw_loader_is_a_source_too(tiny_llama_dir, tmp_path):
    from loader import ThawCheckpointLoader, convert_checkpoint

    thaw_dir = tmp_path / "thaw"
    convert_checkpoint(tiny_llama_dir, thaw_dir, progress=False)
    want = [list(c.output_token_ids) for c in Engine(tiny_llama_dir, engine_config()).generate(PROMPTS, GREEDY)]
    loader = ThawCheckpointLoader(thaw_dir)  # its buffer holds the weights: open as long as the engine runs
    engine = Engine(thaw_dir, engine_config(), weights=loader)
    got = engine.generate(PROMPTS, GREEDY)
    assert [list(c.output_token_ids) for c in got] == want
    assert engine.weights_resident and engine.load_report.startswith("layer by layer from ThawCheckpointLoader")


def test_migration_is_refused_while_weights_arrive_and_allowed_after(tiny_llama_dir, tmp_path):
    from worker.transfer.engine_migration import MigrationRefusedError, begin_import, export_request, freeze_request

    source = FakeLayerSource(tiny_llama_dir)
    engine = Engine(config_only(tiny_llama_dir, tmp_path), engine_config(), weights=source)
    rid = engine.add_request("the cat sat", GREEDY)
    land(source, engine.runner.layer_gate, -1, 0)
    engine.step()  # a pass is mid-way through the layers: migration could not capture it
    for refused in (lambda: export_request(engine, rid), lambda: freeze_request(engine, rid)):
        with pytest.raises(MigrationRefusedError, match="weights are still arriving"):
            refused()
    loaded = Engine(tiny_llama_dir, engine_config())
    other = loaded.add_request("a dog ran", GREEDY)
    with pytest.raises(MigrationRefusedError, match="weights are still arriving"):
        begin_import(engine, export_request(loaded, other))
    source.release_all()
    run_all(engine)
    assert engine.runner.layer_gate is None
    begin_import(engine, export_request(loaded, other))  # fully loaded now: accepted
