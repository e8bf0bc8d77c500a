"""The engine's migration hooks, two engines of the same tiny model in one process, stepped by hand
so every migration point is exact: a request moved at any step — by recompute or by copied KV
blocks, in one go or in stages while the source keeps decoding — finishes with the very tokens and
text it would have produced unmoved, greedy or seeded; what a client saw from the source before the
hand-off and from the destination after is exactly the unmoved output; refusals and failures leave
both engines as they were, down to the free-block count. A snapshot of another checkpoint is
refused (one naming none, rebuilt from a client's tokens, is not); a request running again is not
released; `request_progress` says where a request stands. A request with every sampling setting on
(penalties, bias, min-p, min_tokens, logprobs) moves the same: its penalty counts are rebuilt from
its tokens, and the logprobs of the tokens generated after the move come from the destination."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from worker import DemoModelConfig, Engine, EngineConfig, SamplingParams, write_demo_model
from worker import RequestProgress, RequestState
from worker.transfer.engine_migration import (
    MigrationRefusedError, UnknownRequestError, begin_import, cancel_import, commit_import, export_kv,
    export_request, extend_import, freeze_request, import_kv, import_request, prefill_import, release_request,
    request_progress, unfreeze_request,
)
from wire.request_snapshot import RequestSnapshot

TINY_DEMO = DemoModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=256, init_std=0.1)
CONFIG = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
PROMPT = "Paged attention stores keys and values"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
TUNED = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05, logit_bias={5: 2.0, 9: -1.0},
                       min_tokens=10, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("engine-migration") / "demo", TINY_DEMO)


@pytest.fixture(scope="module")
def source(model_dir):
    return Engine(model_dir, CONFIG)


@pytest.fixture(scope="module")
def dest(model_dir):
    return Engine(model_dir, CONFIG)


@pytest.fixture(scope="module")
def unmoved(source):
    """unmoved(params, prompt=PROMPT): what a client receives from the request left alone (memoised)."""
    cache = {}

    def run(params: SamplingParams, prompt: str = PROMPT) -> Client:
        if (params, prompt) not in cache:
            cache[params, prompt] = run_alone(source, params, prompt)
        return cache[params, prompt]

    return run


@pytest.fixture(autouse=True)
def idle_engines(source, dest):
    yield
    for engine in (source, dest):  # every test must leave both engines empty, every block free
        manager = engine.block_manager
        assert not engine.requests.request_ids() and manager.num_free_blocks == manager.num_blocks


class Client:
    """What a streaming client receives: token ids and text deltas, and how the stream ended."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.logprobs: list = []  # TokenLogprobs, for a request that asks for them

    def take(self, outputs, request_id: str) -> None:
        for out in outputs:
            if out.request_id == request_id:
                assert self.finish_reason is None, "nothing may arrive after the stream ended"
                self.token_ids.extend(out.new_token_ids)
                self.text += out.new_text
                self.finish_reason = out.finish_reason
                self.logprobs.extend(out.logprobs or ())


def run_alone(engine: Engine, params: SamplingParams, prompt: str = PROMPT) -> Client:
    client = Client()
    rid = engine.add_request(prompt, params, request_id="baseline")
    while engine.has_unfinished_requests():
        client.take(engine.step(), rid)
    return client


def start(engine: Engine, params: SamplingParams, num_steps: int, client: Client, prompt: str = PROMPT) -> str:
    rid = engine.add_request(prompt, params, request_id="moving")
    for _ in range(num_steps):
        client.take(engine.step(), rid)
    return rid


def finish(engine: Engine, rid: str, client: Client) -> None:
    while engine.has_unfinished_requests():
        client.take(engine.step(), rid)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-blocks"])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_shot_migration_at_a_random_step_changes_nothing(source, dest, params, with_kv, seed, unmoved):
    expected = unmoved(params)
    num_steps = random.Random(seed).randint(1, 30)  # step 1 ends the prefill; later ones decode
    client = Client()
    rid = start(source, params, num_steps, client)
    snapshot = freeze_request(source, rid)
    kv = export_kv(source, rid, 0, include_partial=True)[1] if with_kv else None
    import_request(dest, snapshot, kv)
    client.take([release_request(source, rid)], rid)
    assert client.finish_reason == "migrated" and not source.requests.request_ids()
    client.finish_reason = None  # the client follows the request to the destination
    finish(dest, rid, client)
    assert (client.token_ids, client.text, client.finish_reason) == (
        expected.token_ids, expected.text, expected.finish_reason)
    if with_kv:  # the destination computed only the last token: its KV is the source's
        assert snapshot.num_computed_tokens == snapshot.num_tokens - 1


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-blocks"])
def test_a_request_with_every_sampling_setting_moves_unchanged_with_its_logprobs(source, dest, with_kv, unmoved):
    expected = unmoved(TUNED)
    assert len(expected.logprobs) == len(expected.token_ids) == 40
    client = Client()
    rid = start(source, TUNED, 6, client)  # mid-way through min_tokens, penalties counting
    num_before = len(client.token_ids)
    snapshot = freeze_request(source, rid)
    assert snapshot.params == TUNED  # every setting rides in the snapshot
    kv = export_kv(source, rid, 0, include_partial=True)[1] if with_kv else None
    import_request(dest, snapshot, kv)
    client.take([release_request(source, rid)], rid)
    client.finish_reason = None
    finish(dest, rid, client)
    assert (client.token_ids, client.text, client.finish_reason) == (
        expected.token_ids, expected.text, expected.finish_reason)
    assert 0 < num_before < 40 and len(client.logprobs) == 40  # one per token: the source's, then the destination's
    for got, want in zip(client.logprobs, expected.logprobs):
        assert (got.token_id, set(got.top_token_ids)) == (want.token_id, set(want.top_token_ids))
        assert abs(got.logprob - want.logprob) < 1e-4


def test_kv_staged_while_the_source_decodes_then_a_short_stop(source, dest, unmoved):
    expected = unmoved(SEEDED)
    client = Client()
    rid = start(source, SEEDED, 3, client)
    snapshot = export_request(source, rid)
    begin_import(dest, snapshot, snapshot.num_tokens)
    copied_blocks, stage_sizes = 0, []
    for _ in range(3):  # each stage copies the blocks filled up since the last; the source never stops
        stage_snapshot, kv = export_kv(source, rid, copied_blocks, include_partial=False)
        import_kv(dest, stage_snapshot, copied_blocks, kv)
        copied_blocks += kv.shape[2]
        stage_sizes.append(kv.shape[2])
        for _ in range(5):
            client.take(source.step(), rid)
    final = freeze_request(source, rid)
    _, kv = export_kv(source, rid, copied_blocks, include_partial=True)
    assert import_kv(dest, final, copied_blocks, kv) == final.num_computed_tokens
    commit_import(dest, final)
    unfreeze_request(dest, rid)
    client.take([release_request(source, rid)], rid)
    client.finish_reason = None
    finish(dest, rid, client)
    assert (client.token_ids, client.text) == (expected.token_ids, expected.text)
    # The first stage ships every full block; after it, 5 decoded tokens fill one or two 4-token blocks.
    assert stage_sizes[0] == (snapshot.num_tokens - 1) // 4 and all(1 <= n <= 2 for n in stage_sizes[1:])
    assert kv.shape[2] <= 2  # the final stop copies at most the last full block and the partial one


def test_token_rounds_prefill_while_the_source_decodes(source, dest, unmoved):
    expected = unmoved(GREEDY)
    client = Client()
    rid = start(source, GREEDY, 2, client)
    begin_import(dest, export_request(source, rid), 0)
    for _ in range(3):  # a round: the destination catches up on what it has, the source moves on
        while prefill_import(dest, rid, max_num_tokens=5) < dest.requests.sequence(rid).num_tokens - 1:
            pass
        for _ in range(4):
            client.take(source.step(), rid)
        extend_import(dest, export_request(source, rid))
    final = freeze_request(source, rid)
    assert dest.requests.sequence(rid).num_computed_tokens == final.num_tokens - 5  # the last round's delta
    commit_import(dest, final)
    unfreeze_request(dest, rid)
    client.take([release_request(source, rid)], rid)
    client.finish_reason = None
    finish(dest, rid, client)
    assert (client.token_ids, client.text, client.finish_reason) == (
        expected.token_ids, expected.text, expected.finish_reason)


def test_stop_string_and_held_back_text_survive_the_hand_off(source, dest, unmoved):
    unstopped = unmoved(GREEDY)
    stop = unstopped.text[24:27]  # a stop string the source has not reached at the hand-off
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = unmoved(params)
    assert expected.finish_reason == "stop" and expected.text == unstopped.text[:unstopped.text.index(stop)]
    client = Client()
    rid = start(source, params, 8, client)
    import_request(dest, freeze_request(source, rid))
    client.take([release_request(source, rid)], rid)
    client.finish_reason = None
    finish(dest, rid, client)
    assert (client.text, client.finish_reason) == (expected.text, "stop")


def test_export_leaves_the_request_and_its_random_stream_alone(source, unmoved):
    expected = unmoved(SEEDED)
    client = Client()
    rid = start(source, SEEDED, 5, client)
    snapshot = export_request(source, rid)
    assert (snapshot.num_prompt_tokens, snapshot.num_output_tokens) == (len(snapshot.prompt_token_ids), 5)
    assert snapshot.num_computed_tokens == snapshot.num_tokens - 1 and len(snapshot.generator_state) > 0
    assert repr(snapshot) == (  # no token ids: logs never carry prompts or completions
        f"RequestSnapshot(request_id='moving', num_computed_tokens={snapshot.num_computed_tokens}, "
        "generator_device_type='cpu', checkpoint_id=None)")
    finish(source, rid, client)
    assert client.token_ids == expected.token_ids


def test_a_refused_handshake_changes_nothing(model_dir, source, unmoved):
    small = Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=20))  # 80 slots: the request needs 54
    expected = unmoved(GREEDY)
    client = Client()
    rid = start(source, GREEDY, 2, client)
    snapshot = freeze_request(source, rid)
    # A request of the destination's own leaves one block fewer than the snapshot's tokens need.
    num_blocker_blocks = 20 - (small.block_manager.blocks_for(snapshot.num_tokens) - 1)
    blocker = small.add_request([5] * (4 * num_blocker_blocks - 1), SamplingParams(max_tokens=2), "blocker")
    small.step()
    free_before = small.block_manager.num_free_blocks
    with pytest.raises(MigrationRefusedError, match="KV blocks"):
        begin_import(small, snapshot, snapshot.num_tokens)
    assert small.block_manager.num_free_blocks == free_before and set(small.requests.request_ids()) == {blocker}
    unfreeze_request(source, rid)  # the source carries on, as if nothing happened
    finish(source, rid, client)
    assert client.token_ids == expected.token_ids and client.text == expected.text


def test_a_migration_failing_after_blocks_were_copied_frees_them_and_the_source_finishes(source, dest, unmoved):
    expected = unmoved(SEEDED)
    client = Client()
    rid = start(source, SEEDED, 6, client)
    begin_import(dest, export_request(source, rid), 8)
    stage, kv = export_kv(source, rid, 0, include_partial=False)
    import_kv(dest, stage, 0, kv)
    final = freeze_request(source, rid)
    assert dest.block_manager.num_free_blocks < dest.block_manager.num_blocks
    out = cancel_import(dest, rid)  # the destination gave up after the copy
    assert out.finish_reason == "abort"
    assert dest.block_manager.num_free_blocks == dest.block_manager.num_blocks and not dest.requests.request_ids()
    unfreeze_request(source, rid)
    finish(source, rid, client)
    assert (client.token_ids, client.text) == (expected.token_ids, expected.text)
    assert final.num_output_tokens == 6


def test_refusals_name_the_reason(model_dir, source, dest):
    client = Client()
    rid = start(source, GREEDY, 1, client)
    snapshot = export_request(source, rid)
    with pytest.raises(MigrationRefusedError, match="cache holds 8"):
        begin_import(Engine(model_dir, EngineConfig(block_size=4, num_kv_blocks=2)), snapshot)
    begin_import(dest, snapshot, 4)
    with pytest.raises(MigrationRefusedError, match="already in use"):
        begin_import(dest, snapshot)
    with pytest.raises(MigrationRefusedError, match="do not fit"):
        import_kv(dest, snapshot, 0, torch.zeros(2, 2, 1, 8, 2, 16))
    with pytest.raises(ValueError, match="does not extend"):
        extend_import(dest, RequestSnapshot(rid, snapshot.prompt_token_ids, (1, 2), GREEDY, 0))
    cancel_import(dest, rid)
    source.abort(rid)
    with pytest.raises(UnknownRequestError, match="not on this instance"):
        export_request(source, rid)
    assert cancel_import(dest, rid) is None


def test_a_snapshot_of_another_checkpoint_is_refused_and_one_naming_none_is_not(source, dest):
    client = Client()
    rid = start(source, GREEDY, 3, client)
    snapshot = export_request(source, rid)
    v1 = dataclasses.replace(snapshot, checkpoint_id="ckpt-00000000000000v1")
    free = dest.block_manager.num_free_blocks
    with pytest.raises(MigrationRefusedError, match="request 'moving' was computed by checkpoint ckpt-00000000000000v1 "
                                                    "and this instance serves checkpoint ckpt-00000000000000v2"):
        begin_import(dest, v1, v1.num_tokens, checkpoint_id="ckpt-00000000000000v2")
    assert not dest.requests.request_ids() and dest.block_manager.num_free_blocks == free  # the refusal changed nothing
    # The same checkpoint is taken; so is a snapshot naming none (a recovery from a client's tokens).
    for taken in (v1, snapshot):
        begin_import(dest, taken, taken.num_tokens, checkpoint_id="ckpt-00000000000000v1")
        cancel_import(dest, rid)
    source.abort(rid)


def test_a_request_running_again_cannot_be_released(source):
    client = Client()
    rid = start(source, GREEDY, 2, client)
    freeze_request(source, rid)
    unfreeze_request(source, rid)  # its freeze lapsed: it runs here again
    with pytest.raises(MigrationRefusedError, match="request 'moving' is waiting here, not frozen: it carries on"):
        release_request(source, rid)
    finish(source, rid, client)
    assert client.finish_reason == "length" and len(client.token_ids) == GREEDY.max_tokens


def test_progress_says_where_a_request_stands(source):
    rid = source.add_request(PROMPT, GREEDY, request_id="moving")
    queued = request_progress(source, rid)
    num_prompt_tokens = queued.num_tokens
    assert (queued.state, queued.num_computed_tokens) == (RequestState.QUEUED, 0)
    source.step()  # a prefill chunk of at most 16 tokens
    running = request_progress(source, rid)
    assert running.state is RequestState.RUNNING and running.num_computed_tokens == min(16, num_prompt_tokens)
    freeze_request(source, rid)
    assert request_progress(source, rid).state is RequestState.FROZEN
    source.abort(rid)
    assert request_progress(source, rid) == RequestProgress(rid, RequestState.UNKNOWN, 0, 0)
