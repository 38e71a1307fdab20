"""Tolerant decoding: one oddly typed field costs that field, never the trace.

Real traces carry surprises the schema does not expect: a ROCm runtime event with
`"bytes": "128"`, a null `dur`, a `tid` object, an `args` that is a list. The typed
decoders (schema.py) reject the whole chunk for one such field. Only then, for that chunk
alone, the events are decoded as plain JSON and each field diag reads is checked against
the type it should have:
- a number written as a string is converted ("128" -> 128.0);
- anything else that does not fit (null, a list, an object, a bool, a non-numeric string)
  is dropped, so the field takes its default ("not recorded");
- an event that is not an object, or whose timestamp cannot be read, is dropped whole:
  placed at time 0 it would corrupt every interval around it.

Every change is counted (`Repairs`) and reported with a few examples, so a repaired trace
is analysed and says so. Well-formed chunks never come here: the fast path stays as fast.
"""

from __future__ import annotations

import math
import re
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec

from diag.analyzers.trace.schema import Args, Event

MAX_EXAMPLES = 5


class Repairs:
    """Counts of what the tolerant path changed, with a few examples."""

    def __init__(self):
        self.fields = 0
        self.events = 0
        self.examples: list[str] = []

    def note(self, text: str, event: bool = False) -> None:
        if event:
            self.events += 1
        else:
            self.fields += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(text)

    def merge(self, other: dict) -> None:
        self.fields += other.get("fields", 0)
        self.events += other.get("events", 0)
        self.examples += other.get("examples", [])[: MAX_EXAMPLES - len(self.examples)]

    def export(self) -> dict:
        return {"fields": self.fields, "events": self.events, "examples": list(self.examples)}


def _kinds(annotation) -> set:
    """The plain Python types a struct field accepts (Any and Raw accept every JSON value)."""
    if annotation is Any or annotation is msgspec.Raw:
        return {"any"}
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kinds(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return set().union(*(_kinds(a) for a in get_args(annotation)))
    if annotation in (int, float, str, type(None)):
        return {annotation}
    return {"any"}


_EVENT_FIELDS = {f.encode_name: _kinds(f.type) for f in msgspec.structs.fields(Event) if f.name != "args"}
_ARGS_FIELDS = {f.encode_name: _kinds(f.type) for f in msgspec.structs.fields(Args)}
_encode = msgspec.json.encode
_decode_events = msgspec.json.Decoder(list[Event]).decode
_decode_any = msgspec.json.Decoder().decode


def _number(v) -> float | None:
    """A JSON string holding a finite number, as a float."""
    if isinstance(v, str):
        try:
            x = float(v.strip())
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


# What the columns hold: int64, and floats far from overflowing when added or scaled.
_INT_RANGE = (-(2**63), 2**63 - 1)
_FLOAT_BOUND = 1e300


def _in_range(x) -> bool:
    t = type(x)
    if t is int:
        return _INT_RANGE[0] <= x <= _INT_RANGE[1]
    if t is float:
        return -_FLOAT_BOUND <= x <= _FLOAT_BOUND
    return True


def _fit(value, kinds: set):
    """(value fitted to the kinds, changed?) or (None, True) when it cannot fit (drop it)."""
    if "any" in kinds:
        return value, False
    t = type(value)
    if t is int and int not in kinds and float in kinds:  # msgspec reads an int as a float
        return (value, False) if abs(value) <= _FLOAT_BOUND else (None, True)
    if t in kinds:
        return (value, False) if _in_range(value) else (None, True)
    if float in kinds or int in kinds:
        x = _number(value) if t is str else (float(value) if t is float and int in kinds and value.is_integer()
                                              else None)
        if x is not None:
            if int in kinds and float not in kinds:
                return (int(x), True) if x.is_integer() and _in_range(int(x)) else (None, True)
            return (x, True) if _in_range(x) else (None, True)
    if str in kinds and t in (int, float) and t is not bool:
        return str(value), True
    return None, True


def _repair_fields(obj: dict, fields: dict, where: str, index: int, repairs: Repairs) -> dict:
    out = {}
    for key, value in obj.items():
        kinds = fields.get(key)
        if kinds is None:
            continue  # a key diag does not read: left out, nothing to check
        fitted, changed = _fit(value, kinds)
        if changed:
            shown = repr(value)[:40]
            if fitted is None:
                repairs.note(f"event {index}: {where}{key} = {shown} ignored")
                continue
            repairs.note(f"event {index}: {where}{key} = {shown} read as {fitted!r}")
        out[key] = fitted
    return out


def repair_event(obj, index: int, repairs: Repairs) -> dict | None:
    """The event with every field diag reads fitted to its type; None to drop it."""
    if not isinstance(obj, dict):
        repairs.note(f"event {index}: not an object ({type(obj).__name__}), ignored", event=True)
        return None
    if "ts" in obj and _fit(obj["ts"], _EVENT_FIELDS["ts"])[0] is None:
        repairs.note(f"event {index}: unreadable timestamp {repr(obj['ts'])[:40]}, event ignored", event=True)
        return None
    out = _repair_fields({k: v for k, v in obj.items() if k != "args"}, _EVENT_FIELDS, "", index, repairs)
    args = obj.get("args")
    if args is not None:
        if isinstance(args, dict):
            out["args"] = _repair_fields(args, _ARGS_FIELDS, "args.", index, repairs)
        else:
            repairs.note(f"event {index}: args = {repr(args)[:40]} ignored")
    return out


# A JSON number whose exponent takes it beyond float range (msgspec refuses to read it) is
# found by its exponent first, then its mantissa read backwards: few bytes of a trace are an
# `e`, while a search that starts at every digit scans a chunk at 15 MB/s, and a damaged
# trace's last chunk is decoded once for each place its closing bracket may be.
_HUGE_EXPONENT = re.compile(rb"[eE]\+?0*(?:\d{4,}|309|3[1-9]\d|[4-9]\d\d)(?!\d)")
_MANTISSA_END = re.compile(rb"(?<![\d.])-?\d+(?:\.\d+)?\Z")
MAX_MANTISSA = 4096  # bytes looked back for a mantissa


def _nulled_overflows(data: bytes) -> tuple[bytes, int]:
    """data with every number beyond float range replaced by null, and how many there were."""
    out, last, n = [], 0, 0
    for m in _HUGE_EXPONENT.finditer(data):
        head = data[max(last, m.start() - MAX_MANTISSA):m.start()]
        mantissa = _MANTISSA_END.search(head)
        if mantissa is None:
            continue
        begin = m.start() - (len(head) - mantissa.start())
        if begin > 0 and data[begin - 1] in b"0123456789.":
            continue  # part of a longer token
        out += [data[last:begin], b"null"]
        last, n = m.end(), n + 1
    out.append(data[last:])
    return b"".join(out), n


def decode_tolerant(data: bytes, first_index: int, repairs: Repairs) -> list:
    """Events of one JSON array (a chunk the typed decoders rejected), repaired field by field.

    first_index: the index in the whole trace of the chunk's first event, for the examples.
    Raises msgspec.DecodeError when the chunk is not JSON at all (the caller's business).
    """
    try:
        items = _decode_any(data)
    except msgspec.ValidationError:  # a number beyond float range (1e400): unreadable, read as null
        data, n = _nulled_overflows(bytes(data))
        items = _decode_any(data)
        repairs.note(f"events from {first_index}: {n} number(s) beyond the float range ignored")
        repairs.fields += n - 1
    if not isinstance(items, list):
        raise msgspec.DecodeError("traceEvents chunk is not a JSON array")
    fixed = []
    for k, obj in enumerate(items):
        ev = repair_event(obj, first_index + k, repairs)
        if ev is not None:
            fixed.append(ev)
    return _decode_events(_encode(fixed))
