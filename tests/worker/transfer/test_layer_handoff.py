"""A prefill stopped at layer k on an instance whose weights are still arriving, finished by an
instance that holds every layer: the output (greedy and seeded) equals an unmoved run's, the
helper never recomputes layers < k for the prompt, the new instance frees everything, and what
cannot move at a layer is refused without a change."""

from __future__ import annotations

import pytest

from tests.worker.loading.test_layer_gate import FakeLayerSource, config_only, engine_config, land, run_all
from tests.worker.loading.test_layer_gate import tied_dir  # noqa: F401 - the fixture
from worker.engine.engine import Engine
from worker.transfer.engine_migration import MigrationRefusedError
from worker.transfer.layer_handoff import hand_over_prefill, take_over_prefill
from wire.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 17)), list(range(20, 25))]  # 7 and 5 tokens


def test_a_helper_finishes_a_prefill_from_layer_k_exactly(tied_dir, tmp_path):  # noqa: F811
    config = engine_config()
    params = [GREEDY, SEEDED]
    want = [list(c.output_token_ids) for c in Engine(tied_dir, config).generate(PROMPTS, params)]
    source = FakeLayerSource(tied_dir)
    receiver = Engine(config_only(tied_dir, tmp_path), config, weights=source)
    helper = Engine(tied_dir, config)
    rows: list[tuple[int, int]] = []  # (decoder layer, rows) the helper ran
    for k, layer in enumerate(helper.runner.model.layers):
        layer.register_forward_hook(lambda _m, args, _out, k=k: rows.append((k, args[0].shape[0])))

    ids = [receiver.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    land(source, receiver.runner.layer_gate, -1, 0, 1)
    assert receiver.step() == []  # both prompts wait at layer 2, the frontier
    for rid in ids:
        partial, final = hand_over_prefill(receiver, rid)
        assert final.finish_reason == "migrated" and final.new_token_ids == ()
        assert partial.next_layer == 2 and tuple(partial.kv.shape[:2]) == (2, 2)
        take_over_prefill(helper, partial)
    assert not receiver.has_unfinished_requests()
    assert receiver.block_manager.num_free_blocks == receiver.block_manager.num_blocks

    # Layers 2 and 3 ran for each prompt but its last token; layers 0 and 1 never saw a prompt.
    assert rows == [(2, 6), (3, 6), (2, 4), (3, 4)]
    got = run_all(helper)
    assert [got[rid] for rid in ids] == want
    assert rows[4:] and all(n == 2 for _, n in rows[4:])  # then one token per request per step: no prompt again
    source.release_all()  # let the receiver's gate thread finish


def test_what_cannot_move_at_a_layer_is_refused_unchanged(tied_dir, tmp_path):  # noqa: F811
    config = engine_config()
    source = FakeLayerSource(tied_dir)
    receiver = Engine(config_only(tied_dir, tmp_path), config, weights=source)
    queued = receiver.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(MigrationRefusedError, match="not in a layer-by-layer prefill pass"):
        hand_over_prefill(receiver, queued)  # not admitted to a pass yet
    long = receiver.add_request(list(range(5, 45)), GREEDY)  # 40 tokens: more than one 32-token pass
    land(source, receiver.runner.layer_gate, -1, 0)
    receiver.step()
    with pytest.raises(MigrationRefusedError, match="spans several passes"):
        hand_over_prefill(receiver, long)
    assert receiver.num_unfinished_requests == 2  # both still there, untouched
    source.release_all()
    want = Engine(tied_dir, config).generate([PROMPTS[0], list(range(5, 45))], GREEDY)
    got = run_all(receiver)
    assert [got[queued], got[long]] == [list(c.output_token_ids) for c in want]


def test_a_helper_that_has_no_room_refuses_and_keeps_nothing(tied_dir, tmp_path):  # noqa: F811
    config = engine_config()
    source = FakeLayerSource(tied_dir)
    receiver = Engine(config_only(tied_dir, tmp_path), config, weights=source)
    rid = receiver.add_request(PROMPTS[0], GREEDY)
    land(source, receiver.runner.layer_gate, -1, 0)
    receiver.step()
    partial, _ = hand_over_prefill(receiver, rid)
    full = Engine(tied_dir, engine_config(num_kv_blocks=1))  # 4 tokens of KV: a 7-token prompt cannot fit
    with pytest.raises(MigrationRefusedError):
        take_over_prefill(full, partial)
    assert not full.has_unfinished_requests() and full.block_manager.num_free_blocks == 1
    source.release_all()
