"""The per-character JSON scanners: `JsonScanner` accepts exactly what `json.loads` accepts
(checked on random documents and random corruptions of them), and `ToolCallObjectScanner`
reports the name, the arguments' characters and the end of a tool-call object where they are."""

from __future__ import annotations

import json
import random

import pytest

from infra.tool_call_json import JsonScanner, ObjectEvent, ScanStatus, ToolCallObjectScanner


def statuses(text: str) -> list[ScanStatus]:
    scanner = JsonScanner()
    out = []
    for char in text:
        out.append(scanner.push(char))
        if out[-1] is ScanStatus.ERROR:
            break
    return out


def scanner_accepts(text: str) -> bool:
    got = statuses(text)
    return len(got) == len(text) and got[-1] is ScanStatus.DONE and ScanStatus.ERROR not in got


def loads_accepts(text: str) -> bool:
    def no_constants(name: str):
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False
    return True


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -0.5, 10, 3.25e10, -1e-7, 2**70])
    if kind in (2, 3):
        return rng.choice(["", "plain", 'q"t', "b\\s", "\t\n\u0001", "é☃𝄞", "\ud800"])
    if kind in (4, 5):
        keys = [rng.choice(["a", "b", "ключ", ""]) + str(i) for i in range(rng.randrange(4))]
        return {key: random_value(rng, depth + 1) for key in keys}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


CORRUPTIONS = list(' \t\n{}[]":,-+.0123456789eEtrufalsn\\/xu') + ["\x01"]


def corrupt(text: str, rng: random.Random) -> str:
    at = rng.randrange(len(text) + 1)
    action = rng.randrange(3)
    if action == 0:
        return text[:at] + rng.choice(CORRUPTIONS) + text[at:]
    if action == 1:
        return text[:at] + text[at + 1:]
    return text[:at] + rng.choice(CORRUPTIONS) + text[at + 1:]


def test_scanner_accepts_exactly_what_json_loads_accepts():
    rng = random.Random(7)
    num_valid = num_invalid = 0
    for _ in range(3000):
        doc = json.dumps([random_value(rng)], ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        for text in [doc, corrupt(doc, rng), corrupt(corrupt(doc, rng), rng)]:
            # Wrapped in an array: the value ends at a character, and json.loads's tolerance of
            # whitespace around the document does not apply.
            text = "[" + text + "]"
            want = loads_accepts(text)
            assert scanner_accepts(text) == want, text
            num_valid, num_invalid = num_valid + want, num_invalid + (not want)
    assert num_valid > 3000 and num_invalid > 1500  # both sides of the comparison were exercised


@pytest.mark.parametrize("text", ["01", "1.", "-", ".5", "1e", "+1", "[1,]", '{"a":1,}', '{"a"}', "NaN", "tru",
                                  '"\\x"', '"\\u12G4"', '"a\nb"', "{'a': 1}", "[1 2]", "{1: 2}"])
def test_scanner_rejects_what_strict_json_rejects(text):
    wrapped = "[" + text + "]"
    assert not scanner_accepts(wrapped) and not loads_accepts(wrapped)


def test_top_level_number_ends_before_the_next_character():
    assert statuses("12,") == [ScanStatus.MORE, ScanStatus.MORE, ScanStatus.ENDED]
    assert statuses('"a" ') == [ScanStatus.MORE, ScanStatus.MORE, ScanStatus.DONE, ScanStatus.ERROR]
    assert statuses(" true") == [ScanStatus.MORE] * 4 + [ScanStatus.DONE]


def events(text: str, arguments_keys=frozenset({"arguments"}), ignored=frozenset()) -> str:
    """One letter per character: . nothing, N name, A arguments, D done, E error (then stops)."""
    scanner = ToolCallObjectScanner(arguments_keys, ignored)
    letters = {ObjectEvent.NOTHING: ".", ObjectEvent.NAME: "N", ObjectEvent.ARGUMENTS: "A",
               ObjectEvent.DONE: "D", ObjectEvent.ERROR: "E"}
    out = ""
    for char in text:
        out += letters[scanner.push(char)]
        if out[-1] == "E":
            break
    return out


def test_object_events_mark_the_name_and_the_arguments():
    text = ' {"name": "f", "arguments": {"a": [1]} }'
    assert events(text) == "............N...............AAAAAAAAAA.D"


def test_object_scanner_reads_the_name_with_escapes():
    scanner = ToolCallObjectScanner(frozenset({"arguments"}))
    for char in '{"arguments": {}, "name": "a\\u00e9\\"b"':
        scanner.push(char)
    assert scanner.name == 'aé"b' and scanner.arguments_started


@pytest.mark.parametrize("text, want", [
    ('{"name": "f", "id": 5, "arguments": {}}', "...........N.....E"),  # "id" not allowed: refused at its closing quote
    ('{"name": "f", "arguments": 5}', "...........N...............E"),
    ('{"name": 5', ".........E"),
    ('{"name": "", ', "..........E"),
    ("{}", ".E"),
    ('{"name": "f"}', "...........NE"),
    ('{"arguments": {}, "arguments": {}', "..............AA............E"),
])
def test_object_scanner_rejects_at_the_first_character_that_shows_it(text, want):
    assert events(text) == want


def test_object_scanner_ignores_the_keys_it_is_told_to():
    assert events('{"id": 12, "name": "f", "parameters": {}}', frozenset({"parameters"}), frozenset({"id"})) == (
        ".....................N................AAD")
