"""`WireRecord`: what every record that crosses a process boundary shares.

A record the controller, the gateway, a worker or a migration driver hands to another process is
a frozen dataclass deriving `WireRecord`, defined once in `wire/` and imported by both sides, so
the two cannot disagree on a key (house rule 11). Its dict form (`to_dict`, for JSON, logs and
stored copies) carries a schema tag, ``"schema": "<record>/<version>"``; `from_dict` reads it
back and refuses, naming the field, a tag of another version, an unknown key or a missing one.
The field checks live in each record's ``__post_init__`` (with the helpers below), so a record
built directly is checked the same way.

Pickling -- how Ray moves a record between processes -- goes through the dict form as well
(`__reduce__`): a record that crosses Ray carries its tag and is checked again on arrival, so a
process running another version of it fails at the boundary with a message that says so, not
later with an `AttributeError` deep inside.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

__all__ = ["WireRecord", "check_count", "check_member", "check_name", "check_optional_seconds", "check_seconds", "check_token_ids"]

R = TypeVar("R", bound="WireRecord")
E = TypeVar("E", bound=enum.Enum)

SCHEMA_KEY = "schema"


class WireRecord:
    """Base of the wire records (see the module docstring). A subclass is a dataclass and sets
    `SCHEMA` (``"<record>/<version>"``); the version goes up when a field changes meaning or a
    required one is added."""

    SCHEMA: ClassVar[str]

    @classmethod
    def record_name(cls) -> str:
        """The record's name in error messages (the schema tag without its version)."""
        return cls.SCHEMA.partition("/")[0]

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data (tuples as lists, nested records as dicts, enum members as their
        values) with its schema tag."""
        data: dict[str, Any] = {SCHEMA_KEY: self.SCHEMA}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            data[f.name] = _plain(getattr(self, f.name))
        return data

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record from `to_dict`'s form; `ValueError` naming the bad field. A dict without a
        tag is read as this version (data written before records were tagged)."""
        name = cls.record_name()
        if not isinstance(data, Mapping):
            raise ValueError(f"{name} must be a mapping of its fields, got {type(data).__name__}")
        schema = data.get(SCHEMA_KEY, cls.SCHEMA)
        if schema != cls.SCHEMA:
            raise ValueError(f"{name}.{SCHEMA_KEY} is {schema!r}, but this process reads {cls.SCHEMA!r}: "
                             "run the same thaw version in every process of the platform")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        unknown = sorted(str(key) for key in data if key != SCHEMA_KEY and key not in fields)
        if unknown:
            raise ValueError(f"{name}: unknown field {unknown[0]!r}; its fields are {', '.join(fields)}")
        missing = [key for key, f in fields.items() if key not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{name}.{missing[0]} is missing")
        return cls.from_fields({key: value for key, value in data.items() if key != SCHEMA_KEY})

    @classmethod
    def from_fields(cls: type[R], values: dict[str, Any]) -> R:
        """Builds the record from checked keys; a record with nested records overrides it."""
        try:
            return cls(**values)
        except TypeError as exc:  # cannot happen after from_dict's checks; named anyway
            raise ValueError(f"{cls.record_name()}: {exc}") from None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self).from_dict, (self.to_dict(),)


# Values `_plain` leaves as they are: a list of them is copied whole, not item by item.
_SCALAR_TYPES = frozenset({int, float, str, bool, bytes, type(None)})
_INT_TYPE = frozenset({int})


def _plain(value: Any) -> Any:
    if isinstance(value, WireRecord):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        if _SCALAR_TYPES.issuperset(map(type, value)):  # token ids: no Python call per item
            return list(value)
        return [_plain(item) for item in value]
    if isinstance(value, enum.Enum):  # read back without the enum class; the record checks the value
        return value.value
    return value


def _is_int(value: object) -> bool:
    """True for ints (numpy ints included), False for bools, which are ints in Python."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_member(record: str, field: str, kind: type[E], value: object) -> E:
    """`value` as a member of the enum `kind` (a member, or its value: a dict form carries values)."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        choices = ", ".join(repr(member.value) for member in kind)
        raise ValueError(f"{record}.{field} must be one of {choices}, got {value!r}") from None


def check_name(record: str, field: str, value: object, *, optional: bool = False) -> str | None:
    """A non-empty string (or None when `optional`)."""
    if optional and value is None:
        return None
    if not isinstance(value, str) or not value:
        what = "None or a non-empty string" if optional else "a non-empty string"
        raise ValueError(f"{record}.{field} must be {what}, got {value!r}")
    return value


def check_count(record: str, field: str, value: object, *, minimum: int = 0, optional: bool = False) -> int | None:
    """An integer >= `minimum` (or None when `optional`), as a plain int."""
    if optional and value is None:
        return None
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        what = f"None or an integer >= {minimum}" if optional else f"an integer >= {minimum}"
        raise ValueError(f"{record}.{field} must be {what}, got {value!r}")
    return int(value)  # type: ignore[arg-type]


def check_optional_seconds(record: str, field: str, value: object, *, positive: bool = False) -> float | None:
    """None, or a finite number of seconds >= 0 (> 0 when `positive`), as a float."""
    if value is None:
        return None
    return check_seconds(record, field, value, positive=positive)


def check_seconds(record: str, field: str, value: object, *, positive: bool = False) -> float:
    """A finite number of seconds >= 0 (> 0 when `positive`), as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError(f"{record}.{field} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def check_token_ids(record: str, field: str, value: object) -> tuple[int, ...]:
    """A list or tuple of token ids (integers >= 0), as a tuple."""
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"{record}.{field} must be a list of token ids, got {type(value).__name__}")
    if type(value) in (tuple, list) and _INT_TYPE.issuperset(map(type, value)) and (not value or min(value) >= 0):
        return tuple(value)  # the common case, checked in C (a tuple is not copied; a list from a dict form is)
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise ValueError(f"{record}.{field}[{i}] must be a token id (an integer >= 0), got {token!r}")
    return tuple(int(token) for token in value)
