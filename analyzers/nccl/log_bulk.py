"""Bulk mode of the NCCL log parser: whole chunks of undecoded bytes, split in C by one
regular expression into the frequent line kinds (COLL, transport, per-call TUNING, no-op
INFO), which are counted per distinct field tuple; the other lines go to the per-line
parser. This is what keeps a multi-gigabyte log fast.
"""

from __future__ import annotations

from collections import Counter
from itertools import compress
from typing import TYPE_CHECKING

from diag.analyzers.nccl.log_collectives import add_transport, add_tune, flush_colls
from diag.analyzers.nccl.log_grammar import (
    _B_K,
    _B_LINE,
    _NONE3,
    MAX_CACHE,
    MAX_COMMS,
    MAX_LINE,
    _has_giant_line,
    _transport_kind,
)
from diag.analyzers.nccl.log_state import LogState

if TYPE_CHECKING:  # the parser, for its feed_all
    from diag.analyzers.nccl.log import NcclLogParser


def feed_bytes(p: NcclLogParser, chunk: bytes, _glued: bool = True) -> None:
    """`feed_all` for a chunk of whole lines, each ending in a newline (the undecoded file).

    One compiled regular expression splits the chunk in C: COLL, transport, per-call
    TUNING and no-op INFO lines with a standard prefix come out as field tuples that are
    counted with a Counter, so Python runs once per distinct tuple instead of once per
    line and only distinct values are decoded. Every other line (init, WARN, errors,
    watchdog, odd prefixes) is decoded and goes to the per-line parser."""
    if _has_giant_line(chunk):
        feed_text(p, chunk)  # cut lines exactly as the per-line reader does
        return
    buf = b"\n" + chunk
    parts = _B_LINE.split(buf)
    n = len(parts) // _B_K
    if not n:
        feed_text(p, chunk)
        return
    rest = b"".join(parts[::_B_K])
    if buf.count(b"NCCL INFO ") != rest.count(b"NCCL INFO ") + n:
        # a matched line holds a second tag (lines glued by concurrent writers), which the
        # per-line parser reads from its last tag: that line goes to it, in order
        if _glued:
            feed_glued(p, chunk)
        else:
            feed_text(p, chunk)
        return
    p.lines += n
    p.nccl_lines += n
    cache, prefix = p.prefix_cache, p.prefix
    for pre in set(parts[1::_B_K]):
        pre = pre.decode("utf-8", "replace")
        if pre not in cache:
            prefix(pre)
    want: set[str] = set()  # signals counted in bulk whose evidence has room
    if any(parts[2::_B_K]):
        coll_bulk(p, parts)
    if any(parts[7::_B_K]):
        via_bulk(p, parts, want)
    if any(parts[12::_B_K]):
        tune_bulk(p, parts, want)
    if want:
        bulk_evidence(p, buf, want)
    if len(rest) > 1:
        feed_text(p, rest[1:])


def feed_glued(p: NcclLogParser, chunk: bytes) -> None:
    """`feed_bytes` for a chunk holding lines with two or more INFO tags: the runs of
    lines between them in bulk, those lines one by one, in file order."""
    start = pos = 0
    for ln in chunk.split(b"\n")[:-1]:
        end = pos + len(ln) + 1
        if ln.count(b"NCCL INFO ") > 1:
            if pos > start:
                feed_bytes(p, chunk[start:pos], _glued=False)
            feed_text(p, chunk[pos:end])
            start = end
        pos = end
    if start < len(chunk):
        feed_bytes(p, chunk[start:], _glued=False)


def feed_text(p: NcclLogParser, chunk: bytes) -> None:
    lines = chunk.decode("utf-8", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()
    if lines and max(map(len, lines)) > MAX_LINE:
        lines = [ln[:MAX_LINE] for ln in lines]
    p.feed_all(lines)


def coll_bulk(p: LogState, parts: list) -> None:
    # the columns hold None for the matches of other kinds: counted too, then dropped
    ops, opcs, comms = parts[2::_B_K], parts[3::_B_K], parts[5::_B_K]
    keys = Counter(zip(ops, parts[4::_B_K], parts[6::_B_K]))
    keys.pop(_NONE3, None)
    raw = p.coll_raw
    for (op, mid, nranks), n in keys.items():
        _, count, _, dt, _, red = mid.decode().split(" ")
        key = (op.decode(), count, dt, red, nranks.decode())
        raw[key] = raw.get(key, 0) + n
    if len(p.coll_comms) < MAX_COMMS:
        p.coll_comms.update((op.decode(), comm.decode()) for op, comm in set(zip(ops, comms)) if op)
    last = dict(zip(comms, opcs))
    last.pop(None, None)
    p.opc_last.update((comm.decode(), opc.decode()) for comm, opc in last.items())
    if len(raw) >= MAX_CACHE:
        flush_colls(p)


def via_bulk(p: LogState, parts: list, want: set) -> None:
    sel = parts[7::_B_K]
    tuples = compress(zip(sel, *(parts[i::_B_K] for i in range(8, 12))), sel)
    for (ch, src, dst, direction, via), n in Counter(tuples).items():
        sig = add_transport(p, ch.decode(), src.decode(), dst.decode(),
                                  direction.decode() if direction else None, via.decode("utf-8", "replace"), n)
        if sig is not None:
            b = p.bucket(sig)
            b.count += n
            if not b.full:
                want.add(sig)


def tune_bulk(p: LogState, parts: list, want: set) -> None:
    sel = parts[12::_B_K]
    tuples = list(compress(zip(sel, *(parts[i::_B_K] for i in range(13, 18))), sel))
    for fields, n in Counter(tuples).items():
        add_tune(p, tuple(x.decode() if x is not None else None for x in fields), n)
    b = p.bucket("tuning_choice")
    b.count += len(tuples)
    if not b.full:
        want.add("tuning_choice")


def bulk_evidence(p: LogState, buf: bytes, want: set) -> None:
    """The first bulk-counted lines as evidence of the signals in `want` (counts are already
    in). Runs only while one of their buckets has room: over the first chunks of a file."""
    for m in _B_LINE.finditer(buf):
        if m.group(7):
            sig = _transport_kind(m.group(11).decode("utf-8", "replace"))[4]
        elif m.group(12):
            sig = "tuning_choice"
        else:
            continue
        if sig in want:
            b = p.signals[sig]
            b.lines.append(m.group(0)[1:].decode("utf-8", "replace").rstrip()[:1000])
            b.full = len(b.lines) >= b.cap
            if b.full:
                want.discard(sig)
                if not want:
                    return
