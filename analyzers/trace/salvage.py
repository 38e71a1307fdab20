"""Reading round damage in a trace's events: each damaged event is skipped and counted among the
trace's repairs, the events around it are kept, and the error of an event no decoder reads
names its index in the whole trace.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from diag.analyzers.trace.column_builder import ColumnBuilder
from diag.analyzers.trace.schema import TOO_DEEP
from diag.errors import DiagInputError

_INDEX_RE = re.compile(r"\$\[(\d+)\]")


def bad_event(path: str, exc: Exception, b: ColumnBuilder) -> DiagInputError:
    """The error of an event no decoder could read, at its index in the whole trace
    (msgspec counts from the start of the chunk)."""
    text = _INDEX_RE.sub(lambda m: f"traceEvents[{int(m.group(1)) + b.decode.seen}]", str(exc), count=1)
    return DiagInputError(f"not a Kineto trace: bad event ({text})", source=path)


def framed(buf: bytearray, lo: int, hi: int, close: bool = True) -> bytes:
    """buf[lo:hi] inside brackets, as one JSON array, in a single copy."""
    with memoryview(buf) as mv:
        return b"".join((b"[", mv[lo:hi], b"]" if close else b""))


_BYTE_RE = re.compile(r"\(byte (\d+)\)")


# Around damage, the element before or after an event may be damaged into another value
# than an object (an array nested too deep): an event ends before it, and starts after it.
_EVENT_ENDS_RE = re.compile(rb"\}\s*,\s*[{\[]")
_EVENT_STARTS_RE = re.compile(rb"[}\]]\s*,\s*\{")
MAX_SKIPPED = 256  # damaged events skipped in one chunk before the rest of it is given up


def salvage(path: str, buf: bytearray, start: int, end: int, b: ColumnBuilder) -> None:
    """Decode buf[start:end] (whole events) around damaged ones: the events before the
    damage, then on from the next event boundary after it. Each damaged event is counted
    among the trace's repairs; an error only when nothing around the damage can be told
    apart from it. Bounded: every round moves past the damage, and a chunk damaged in more
    than MAX_SKIPPED places is given up from there on."""
    for _ in range(MAX_SKIPPED):
        if start >= end:
            return
        try:
            b.add(*b.decode(framed(buf, start, end)))
            return
        except msgspec.ValidationError as exc:
            raise bad_event(path, exc, b) from None
        except msgspec.DecodeError as exc:
            reason = _BYTE_RE.sub("", str(exc)).strip()  # offsets within a chunk mean nothing to a reader
            bad = _damage_at(buf, start, end, exc)
            if bad is None:
                raise DiagInputError(f"corrupt JSON in traceEvents after event {b.decode.seen} ({reason})",
                                     source=path) from None
        before = [m for m in _EVENT_ENDS_RE.finditer(buf, start, max(start, bad))]
        if before:
            cut = before[-1].start() + 1
            try:
                b.add(*b.decode(framed(buf, start, cut)))
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass  # the damage reaches further back: these events go with it
        after = _EVENT_STARTS_RE.search(buf, max(bad, start) + 1, end)
        b.decode.log().note(f"event {b.decode.seen}: corrupt JSON ({reason}), event skipped", event=True)
        if after is None:
            return
        start = max(after.end() - 1, start + 1)
    b.decode.log().note(f"event {b.decode.seen}: more than {MAX_SKIPPED} damaged events in one stretch, "
                     "the rest of it skipped", event=True)


def _damage_at(buf: bytearray, start: int, end: int, exc: Exception) -> int | None:
    """Where in buf the decode error of buf[start:end] lies. Invalid UTF-8 is located by the
    codec over the stretch (msgspec's position is within the string it was reading)."""
    if "invalid UTF-8" in str(exc):
        try:
            bytes(buf[start:end]).decode("utf-8")
        except UnicodeDecodeError as u:
            return start + u.start
        return None
    if TOO_DEEP in str(exc):
        return _too_deep_at(buf, start, end)
    found = _BYTE_RE.search(str(exc))
    return start + int(found.group(1)) - 1 if found else None  # -1: the '[' framing the chunk


# An event nests a few levels (its args); one nested deeper than this holds the damage.
_EVENT_DEPTH = 64


def _too_deep_at(buf: bytearray, start: int, end: int) -> int | None:
    """Where buf[start:end] (whole events) first nests deeper than any event does. Brackets
    inside strings count too: that can only place the damage early, inside the same event."""
    with memoryview(buf)[start:end] as mv:
        b = np.frombuffer(mv, dtype=np.uint8)
        step = ((b == 0x5B) | (b == 0x7B)).astype(np.int32) - ((b == 0x5D) | (b == 0x7D))
    deep = np.flatnonzero(np.cumsum(step) > _EVENT_DEPTH)
    return start + int(deep[0]) if len(deep) else None
