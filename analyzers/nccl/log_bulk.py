"""Bulk mode of the NCCL log parser: whole chunks of undecoded bytes, split in C by one
regular expression into the frequent line kinds (COLL, transport, per-call TUNING, no-op
INFO), which are counted per distinct field tuple; the other lines go to the per-line
parser. This is what keeps a multi-gigabyte log fast.
"""

from __future__ import annotations

from collections import Counter
from itertools import compress

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


class BulkLines:
    """Bulk mode: chunks of bytes in, per-line parsing only for the rare lines. A part of NcclLogParser (log.py)."""

    # -- bulk mode: the frequent line kinds of a large log, a whole chunk at a time ------------
    def feed_bytes(self, chunk: bytes, _glued: bool = True) -> None:
        """`feed_all` for a chunk of whole lines, each ending in a newline (the undecoded file).

        One compiled regular expression splits the chunk in C: COLL, transport, per-call
        TUNING and no-op INFO lines with a standard prefix come out as field tuples that are
        counted with a Counter, so Python runs once per distinct tuple instead of once per
        line and only distinct values are decoded. Every other line (init, WARN, errors,
        watchdog, odd prefixes) is decoded and goes to the per-line parser."""
        if _has_giant_line(chunk):
            self._feed_text(chunk)  # cut lines exactly as the per-line reader does
            return
        buf = b"\n" + chunk
        parts = _B_LINE.split(buf)
        n = len(parts) // _B_K
        if not n:
            self._feed_text(chunk)
            return
        rest = b"".join(parts[::_B_K])
        if buf.count(b"NCCL INFO ") != rest.count(b"NCCL INFO ") + n:
            # a matched line holds a second tag (lines glued by concurrent writers), which the
            # per-line parser reads from its last tag: that line goes to it, in order
            if _glued:
                self._feed_glued(chunk)
            else:
                self._feed_text(chunk)
            return
        self.lines += n
        self.nccl_lines += n
        cache, prefix = self._prefix_cache, self._prefix
        for pre in set(parts[1::_B_K]):
            pre = pre.decode("utf-8", "replace")
            if pre not in cache:
                prefix(pre)
        want: set[str] = set()  # signals counted in bulk whose evidence has room
        if any(parts[2::_B_K]):
            self._coll_bulk(parts)
        if any(parts[7::_B_K]):
            self._via_bulk(parts, want)
        if any(parts[12::_B_K]):
            self._tune_bulk(parts, want)
        if want:
            self._bulk_evidence(buf, want)
        if len(rest) > 1:
            self._feed_text(rest[1:])

    def _feed_glued(self, chunk: bytes) -> None:
        """`feed_bytes` for a chunk holding lines with two or more INFO tags: the runs of
        lines between them in bulk, those lines one by one, in file order."""
        start = pos = 0
        for ln in chunk.split(b"\n")[:-1]:
            end = pos + len(ln) + 1
            if ln.count(b"NCCL INFO ") > 1:
                if pos > start:
                    self.feed_bytes(chunk[start:pos], _glued=False)
                self._feed_text(chunk[pos:end])
                start = end
            pos = end
        if start < len(chunk):
            self.feed_bytes(chunk[start:], _glued=False)

    def _feed_text(self, chunk: bytes) -> None:
        lines = chunk.decode("utf-8", errors="replace").split("\n")
        if lines[-1] == "":
            lines.pop()
        if lines and max(map(len, lines)) > MAX_LINE:
            lines = [ln[:MAX_LINE] for ln in lines]
        self.feed_all(lines)

    def _coll_bulk(self, parts: list) -> None:
        # the columns hold None for the matches of other kinds: counted too, then dropped
        ops, opcs, comms = parts[2::_B_K], parts[3::_B_K], parts[5::_B_K]
        keys = Counter(zip(ops, parts[4::_B_K], parts[6::_B_K]))
        keys.pop(_NONE3, None)
        raw = self._coll_raw
        for (op, mid, nranks), n in keys.items():
            _, count, _, dt, _, red = mid.decode().split(" ")
            key = (op.decode(), count, dt, red, nranks.decode())
            raw[key] = raw.get(key, 0) + n
        if len(self._coll_comms) < MAX_COMMS:
            self._coll_comms.update((op.decode(), comm.decode()) for op, comm in set(zip(ops, comms)) if op)
        last = dict(zip(comms, opcs))
        last.pop(None, None)
        self._opc_last.update((comm.decode(), opc.decode()) for comm, opc in last.items())
        if len(raw) >= MAX_CACHE:
            self._flush_colls()

    def _via_bulk(self, parts: list, want: set) -> None:
        sel = parts[7::_B_K]
        tuples = compress(zip(sel, *(parts[i::_B_K] for i in range(8, 12))), sel)
        for (ch, src, dst, direction, via), n in Counter(tuples).items():
            sig = self._add_transport(ch.decode(), src.decode(), dst.decode(),
                                      direction.decode() if direction else None, via.decode("utf-8", "replace"), n)
            if sig is not None:
                b = self._bucket(sig)
                b.count += n
                if not b.full:
                    want.add(sig)

    def _tune_bulk(self, parts: list, want: set) -> None:
        sel = parts[12::_B_K]
        tuples = list(compress(zip(sel, *(parts[i::_B_K] for i in range(13, 18))), sel))
        for fields, n in Counter(tuples).items():
            self._add_tune(tuple(x.decode() if x is not None else None for x in fields), n)
        b = self._bucket("tuning_choice")
        b.count += len(tuples)
        if not b.full:
            want.add("tuning_choice")

    def _bulk_evidence(self, buf: bytes, want: set) -> None:
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
                b = self.signals[sig]
                b.lines.append(m.group(0)[1:].decode("utf-8", "replace").rstrip()[:1000])
                b.full = len(b.lines) >= b.cap
                if b.full:
                    want.discard(sig)
                    if not want:
                        return
