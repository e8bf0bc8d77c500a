"""IncrementalDetokenizer: streamed deltas add up to the full decode, never split characters or stop strings."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from worker.models.demo_model import EOT_TOKEN, build_tokenizer
from worker.text.detokenizer import IncrementalDetokenizer
from worker.text.tokenizer import Tokenizer

MULTIBYTE_TEXTS = ["日本語", "😀🎉🚀", "café naïve", "👍🏽 ❤️", "Привет", "Kraków €5 ½"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return Tokenizer.from_dir(out)


def _byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the byte-level alphabet symbols, so characters are split across tokens."""
    byte_to_symbol = {b: s for s, b in _symbol_to_byte().items()}
    return [tok.token_to_id(byte_to_symbol[b]) for b in text.encode("utf-8")]


def _symbol_to_byte() -> dict[str, int]:
    # GPT-2's bytes_to_unicode table, which the ByteLevel pre-tokenizer / decoder use.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            symbols.append(256 + n)
            n += 1
    return {chr(s): b for b, s in zip(printable, symbols)}


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.append(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def _random_sequences(tok: Tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    sequences = []
    for _ in range(count):
        ids: list[int] = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            text = rng.choice(MULTIBYTE_TEXTS + [" hello", " the cat", "!", "\n"])
            if kind < 0.4:
                ids += _byte_token_ids(tok, text)  # characters split byte by byte
            elif kind < 0.8:
                ids += tok.encode(text, add_special_tokens=False)
            elif kind < 0.9:
                ids.append(tok.token_to_id(EOT_TOKEN))  # a special token mid-stream
            else:
                ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 4))]  # anything at all
        sequences.append(ids)
    return sequences


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_concatenation_invariant_random(tok, skip_special_tokens):
    rng = random.Random(1234)
    prompt = tok.encode("Tell me something:")
    num_clean = 0
    for ids in _random_sequences(tok, rng, 300):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        deltas = _stream(detok, ids)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full
        assert detok.output_text == full
        assert not detok.stopped and detok.matched_stop is None
        if "\ufffd" not in full:
            num_clean += 1
            assert all("\ufffd" not in d for d in deltas)
    assert num_clean > 200  # most sequences are valid UTF-8, so the split-character check really ran


def test_split_character_is_held_until_complete(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    ids = _byte_token_ids(tok, "😀")  # four bytes, four tokens
    assert len(ids) == 4
    assert [detok.append(i) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_flush_returns_incomplete_tail(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    ids = tok.encode(" ok", add_special_tokens=False) + _byte_token_ids(tok, "日")[:2]
    deltas = [detok.append(i) for i in ids]
    assert "".join(deltas) == " ok"
    assert detok.flush() == tok.decode(ids)[len(" ok") :]
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.append(ids[0])


def test_prompt_ending_mid_character(tok):
    prompt = tok.encode("a") + _byte_token_ids(tok, "é")[:1]
    ids = tok.encode(" fine", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(detok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("stop", ["Paris", "capital of", "é", "日本語", "\n\n"])
def test_stop_string_never_partially_emitted(tok, stop):
    text = "The capital of France is Paris.\n\nAnd café 日本語 too."
    rng = random.Random(7)
    for _ in range(20):
        # Mix normal tokens and byte tokens so the stop string spans tokens in many ways.
        ids: list[int] = []
        for word in text.split(" "):
            piece = word if not ids else " " + word
            ids += _byte_token_ids(tok, piece) if rng.random() < 0.5 else tok.encode(piece, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("Q:"), stop=[stop])
        emitted = ""
        for i in ids:
            emitted += detok.append(i)
            # Nothing from the stop string's start on has been shown, not even its first character.
            assert emitted == text[: len(emitted)]
            assert len(emitted) <= text.index(stop)
        emitted += detok.flush()
        full = tok.decode(ids)
        assert emitted == full[: full.index(stop)]
        assert detok.stopped and detok.matched_stop == stop
        assert detok.output_text == emitted


def test_stop_string_spanning_tokens_is_held_back(tok):
    prompt = tok.encode("Q:")
    ids = _byte_token_ids(tok, "ab STOP cd")
    detok = IncrementalDetokenizer(tok, prompt, stop=["STOP"])
    deltas = [detok.append(i) for i in ids]
    # "a", "b" go out; " " could start nothing so it goes out too; "S", "T", "O" are held; "P" completes it.
    assert deltas[:3] == ["a", "b", " "]
    assert deltas[3:7] == ["", "", "", ""]
    assert detok.stopped and detok.matched_stop == "STOP"
    assert deltas[7:] == ["", "", ""]
    assert detok.flush() == ""
    assert detok.output_text == "ab "


def test_false_start_of_stop_string_is_released(tok):
    ids = _byte_token_ids(tok, "STOMP STOP")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = [detok.append(i) for i in ids]
    assert "".join(deltas) == "STOMP "
    assert deltas[:4] == ["", "", "", "STOM"]  # held while it could still be "STOP"


def test_unmatched_stop_prefix_is_flushed(tok):
    ids = _byte_token_ids(tok, "the end is ST")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    emitted = "".join(detok.append(i) for i in ids)
    assert emitted == "the end is "
    assert detok.output_text == "the end is ST"
    assert detok.flush() == "ST"
    assert not detok.stopped and detok.matched_stop is None


def test_first_completed_stop_wins(tok):
    ids = tok.encode("abcd", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["abcd", "bc"])
    "".join(_stream(detok, ids))
    assert detok.matched_stop == "bc" and detok.output_text == "a"


def test_stop_invariant_random(tok):
    rng = random.Random(99)
    stops = ["😀", "the", "é n", "\n"]
    for ids in _random_sequences(tok, rng, 200):
        stop = rng.choice(stops)
        detok = IncrementalDetokenizer(tok, tok.encode("hi"), stop=[stop])
        out = "".join(_stream(detok, ids))
        full = tok.decode(ids)
        if stop in full:
            assert detok.stopped and out == full[: full.index(stop)]
        else:
            assert not detok.stopped and out == full


def test_leading_space_kept_with_prompt_context():
    # A SentencePiece-style decoder drops the leading space of the first token it sees.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([2]) == "world"  # alone, the space is gone
    detok = IncrementalDetokenizer(tok, [1])
    assert _stream(detok, [2, 3, 4]) == [" world", "!", " again", ""]


def test_validation_and_repr(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])
    with pytest.raises(ValueError, match="single string"):
        IncrementalDetokenizer(tok, [], stop="STOP")
    detok = IncrementalDetokenizer(tok, tok.encode("secret prompt"), stop=["secret stop"])
    detok.append(tok.encode(" secret", add_special_tokens=False)[0])
    assert "secret" not in repr(detok)
