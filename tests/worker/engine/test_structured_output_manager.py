"""The engine's structured-output manager on its own: the grammar engine is built once, on first
use, even by racing admission threads; a model that cannot have one refuses structured requests
with the reason, found once; a step with no structured row makes no mask job. (What the masks do
to generation is tests/worker/engine/test_engine_structured_output.py's.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from wire import GrammarSpec, InvalidRequestError
from worker import SamplingParams
from worker.engine.sequence import Sequence
from worker.engine.structured_output_manager import StructuredOutputManager
from worker.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from worker.models.demo_model import build_tokenizer

    return Tokenizer.from_dir(build_tokenizer(tmp_path_factory.mktemp("manager-tokenizer")))


def sequence(request_id: str, params: SamplingParams, num_output: int = 0) -> Sequence:
    seq = Sequence(request_id=request_id, prompt_token_ids=[1, 2, 3], params=params, max_model_len=64)
    seq.token_ids.extend([5] * num_output)
    return seq


def test_racing_admissions_build_one_grammar_engine(tokenizer):
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size)
    assert not manager.started
    specs = [GrammarSpec.regex(f"[a-z]{{{n}}}") for n in range(1, 9)]
    barrier = threading.Barrier(len(specs))

    def admit(spec):
        barrier.wait()
        manager.check(spec)
        return manager.grammar_engine()

    with ThreadPoolExecutor(len(specs)) as pool:
        engines = list(pool.map(admit, specs))
    assert manager.started and all(engine is engines[0] for engine in engines)
    assert engines[0].num_cached_grammars == len(specs)  # each admission compiled its spec


def test_a_model_without_an_end_of_sequence_token_refuses_structured_requests(tokenizer):
    import tokenizers

    manager = StructuredOutputManager(Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE())), 16)
    for _ in range(2):  # the reason is found once and kept
        with pytest.raises(InvalidRequestError) as info:
            manager.check(GrammarSpec.json_object())
        assert str(info.value) == (
            "structured_output: this model cannot enforce it (structured output needs the model's end-of-sequence "
            "token: set eos_token in tokenizer_config.json or eos_token_id in generation_config.json); send the "
            "request without structured_output")
    assert not manager.started
    # A migrated request reaching a step here fails alone, with the same reason.
    seq = sequence("moved", SamplingParams(structured_output=GrammarSpec.json_object()))
    job = manager.begin([seq, sequence("free", SamplingParams())], overlap=False)
    assert job.rows == [] and list(job.failed) == [0]
    assert "this model cannot enforce it" in str(job.failed[0]) and seq.grammar is None


def test_no_structured_row_no_job(tokenizer):
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size)
    assert manager.begin([sequence("free", SamplingParams())]) is None
    assert not manager.started


@pytest.mark.parametrize("overlap", [True, False])
def test_the_job_masks_the_structured_rows_only_and_accept_follows_the_tokens(tokenizer, overlap):
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size + 8)
    spec = GrammarSpec.choice(["yes", "no"])
    seqs = [sequence("free", SamplingParams()), sequence("choice", SamplingParams(structured_output=spec))]
    job = manager.begin(seqs, overlap=overlap)
    assert job.rows == [1] and not job.failed
    logits = torch.zeros(2, tokenizer.vocab_size + 8)
    job.apply(logits)
    assert torch.equal(logits[0], torch.zeros(tokenizer.vocab_size + 8))  # the free row untouched
    allowed = torch.isfinite(logits[1]).nonzero().view(-1).tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    eos = min(manager.grammar_engine().eos_token_ids)
    for token_id in tokenizer.encode("no", add_special_tokens=False):
        assert manager.accept(seqs[1], token_id) is False
        seqs[1].append_token(token_id)
    assert manager.accept(seqs[1], eos) is True  # complete: the request stops
