"""A decoded JSON object read into a msgspec Struct, its types settled once where it is read.

A run directory's files come from many agent versions and may be damaged. One whole
`msgspec.convert` settles a sound object; for a damaged one, each field is tried alone, and a
value the Struct refuses (the wrong type, not finite, out of its range) is left out, so it
reads as the field's default (not measured). Keys the Struct does not know are ignored.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)
# What msgspec.convert raises on a damaged object: a value the type refuses, or a key holding a
# lone surrogate (a damaged file's \ud800 escape), which no field name can match.
REFUSED = (msgspec.ValidationError, UnicodeEncodeError)


def fits(value, shape) -> bool:
    """Whether `value` converts to `shape` (a Struct, a TypedDict or any type msgspec reads)."""
    try:
        msgspec.convert(value, shape)
    except REFUSED:
        return False
    return True


def holds(kind: type[msgspec.Struct], field: str, value, base: dict[str, Any]) -> bool:
    """Whether a `kind` (its required fields given by `base`) can hold `value` as its `field`."""
    return fits({**base, field: value}, kind)


def settled(raw: dict, kind: type[S], base: dict[str, Any] | None = None, refused=None) -> S:
    """The `kind` that object `raw` holds. `base`: its required fields, already checked; each
    other field the Struct refuses is left out, and passed to `refused(name, value)` if given."""
    base = base or {}
    try:
        return msgspec.convert(raw, kind)
    except REFUSED:
        pass  # damaged somewhere: field by field below
    kept = dict(base)
    for name in kind.__struct_fields__:
        if name in base or name not in raw:
            continue
        if holds(kind, name, raw[name], base):
            kept[name] = raw[name]
        elif refused is not None:
            refused(name, raw[name])
    return msgspec.convert(kept, kind)


def note(problems: list | None, text: str) -> None:
    """A line for the run's problems, kept to a bounded number of them."""
    if problems is not None and len(problems) < 1000:
        problems.append(text)
