"""What a request's output must match: the structured-output forms of the OpenAI and vLLM APIs.

One small, hashable record per constraint, independent of the grammar library, so it can key the
compiled-grammar cache (`worker.text.structured_output.GrammarEngine`) and travel from the gateway to
the worker in `SamplingParams.structured_output` (a wire record: tagged dict form). The forms:

- ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
- ``json_schema``: a JSON document valid against a JSON Schema (``response_format:
  {"type": "json_schema", ...}`` with ``strict``; vLLM's ``guided_json``);
- ``regex``: text fully matching a regular expression (vLLM's ``guided_regex``; Rust `regex`
  syntax: no look-around, no back-references);
- ``choice``: exactly one of a list of strings (vLLM's ``guided_choice``);
- ``structural_tag``: free text in which each tagged segment, opened by one of `triggers`, must
  be ``begin`` + JSON valid against ``schema`` + ``end`` (vLLM's ``structural_tag``: tool calls
  such as ``<function=get_weather>{"city": "Paris"}</function>`` inside ordinary text).

Constructors check the shape of what they are given and raise `ValueError` saying what to
change; whether a schema or pattern can be compiled is decided by the engine, which raises
`ValueError` too. `text` holds the constraint as compact JSON (or the pattern itself), keeping
the schema's key order, which is the order the properties will be generated in. The repr never
shows the text (a schema may carry a user's data), only the kind, a digest and the length.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from wire.wire_record import WireRecord

__all__ = ["GRAMMAR_KINDS", "GrammarSpec"]

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "structural_tag")


def _compact_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be plain JSON (objects, arrays, strings, finite numbers, booleans, "
                         f"null): {exc}") from exc


def _schema_object(schema: Mapping[str, Any] | str, what: str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    if not isinstance(schema, Mapping):
        raise ValueError(f"{what} must be a JSON object (a JSON Schema such as "
                         f'{{"type": "object", "properties": {{...}}}}), got {type(schema).__name__}')
    return dict(schema)


def _canonical_choice(options: Any) -> str:
    if isinstance(options, str) or not isinstance(options, Sequence) or not options:
        raise ValueError("the choice constraint must be a non-empty list of strings")
    for index, option in enumerate(options):
        if not isinstance(option, str) or not option:
            raise ValueError(f"choice[{index}] must be a non-empty string")
    return _compact_json(list(options), "the choice list")


def _canonical_structural_tag(tag: Any) -> str:
    if not isinstance(tag, Mapping) or set(tag) != {"structures", "triggers"}:
        raise ValueError('a structural tag is {"structures": [...], "triggers": [...]}')
    structures, triggers = tag["structures"], tag["triggers"]
    if isinstance(triggers, str) or not isinstance(triggers, Sequence) or not triggers:
        raise ValueError("structural_tag triggers must be a non-empty list of strings")
    for index, trigger in enumerate(triggers):
        if not isinstance(trigger, str) or not trigger:
            raise ValueError(f"structural_tag triggers[{index}] must be a non-empty string")
    if isinstance(structures, (str, Mapping)) or not isinstance(structures, Sequence) or not structures:
        raise ValueError('structural_tag structures must be a non-empty list of {"begin", "schema", "end"}')
    clean = []
    for index, structure in enumerate(structures):
        where = f"structural_tag structures[{index}]"
        if not isinstance(structure, Mapping):
            raise ValueError(f'{where} must be an object with "begin", "schema" and "end"')
        unknown = sorted(set(structure) - {"begin", "schema", "end"})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; it takes begin, schema and end")
        begin, end = structure.get("begin"), structure.get("end")
        if not isinstance(begin, str) or not begin:
            raise ValueError(f"{where}.begin must be a non-empty string")
        if not isinstance(end, str):
            raise ValueError(f"{where}.end must be a string")
        if not any(begin.startswith(trigger) for trigger in triggers):
            raise ValueError(f"{where}.begin must start with one of the triggers")
        schema = _schema_object(structure.get("schema", {}), f"{where}.schema")
        clean.append({"begin": begin, "schema": schema, "end": end})
    return _compact_json({"structures": clean, "triggers": list(triggers)}, "the structural tag")


def _canonical_text(kind: str, text: str) -> str:
    """`text` checked for `kind` and rewritten compactly (equal constraints, equal text)."""
    if kind == "json_object":
        if text:
            raise ValueError("a json_object constraint takes no schema; use json_schema to give one")
        return text
    if kind == "regex":
        if not text:
            raise ValueError("the regex constraint must be a non-empty string (a regular expression)")
        return text
    what = {"json_schema": "the JSON schema", "choice": "the choice list", "structural_tag": "the structural tag"}[kind]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    if kind == "json_schema":
        return _compact_json(_schema_object(value, what), what)
    if kind == "choice":
        return _canonical_choice(value)
    return _canonical_structural_tag(value)


@dataclass(frozen=True)
class GrammarSpec(WireRecord):
    """One structured-output constraint. `text` is the schema / choice list / structural tag as
    JSON text, or the regex; it is validated and rewritten compactly on construction. The
    classmethods take Python values."""

    SCHEMA: ClassVar[str] = "grammar_spec/1"

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"GrammarSpec.text must be a string, got {type(self.text).__name__}")
        object.__setattr__(self, "text", _canonical_text(self.kind, self.text))

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        """`schema`: a JSON Schema, as a dict or as JSON text."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        return cls("json_schema", _compact_json(_schema_object(schema, "the JSON schema"), "the JSON schema"))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not isinstance(pattern, str):
            raise ValueError(f"the regex constraint must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls("choice", _canonical_choice(options))

    @classmethod
    def structural_tag(cls, structures: Sequence[Mapping[str, Any]], triggers: Sequence[str]) -> GrammarSpec:
        """vLLM's structural tag: `structures` of ``{"begin", "schema", "end"}``, and the
        `triggers` (prefixes of the begins) that open a tagged segment in free text."""
        return cls("structural_tag", _canonical_structural_tag({"structures": structures, "triggers": triggers}))

    # ---- reading -----------------------------------------------------------------------------

    def value(self) -> Any:
        """The constraint as Python data: the schema dict, the list of choices, the structural
        tag dict; the pattern for regex; None for json_object."""
        if self.kind == "json_object":
            return None
        if self.kind == "regex":
            return self.text
        return json.loads(self.text)

    def __repr__(self) -> str:
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:12]
        return f"GrammarSpec(kind={self.kind!r}, sha256={digest}, chars={len(self.text)})"
