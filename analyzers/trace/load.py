"""Streaming loader for Kineto (torch.profiler) Chrome-trace JSON, plain or gzipped.

Why not `json.load` or one DataFrame: a 2M-event trace is ~1 GB of JSON and several GB
as Python dicts. Here the file is decompressed in blocks, the `traceEvents` array is cut
at event boundaries into chunks of a few MB, and each chunk is appended to numpy columns
per event class before the next chunk is read: by the compiled reader (`scan`), which
goes from the bytes to the columns in one pass, where it is built and takes the chunk;
else decoded by msgspec into small typed structs, whose fields become the columns.

Where the time goes on a 2M-event trace on the Python path, and what keeps each part small:
- inflating: ISA-L (python-isal) when installed, 2-3x faster than zlib (the fallback); it
  runs in a reader thread (both release the GIL), overlapping the decoding;
- decoding: a tagged union keyed on "cat" gives each category a struct holding only the
  keys its columns need; flow events (a third of the events) become empty structs;
- columns: one C-level pass (map/attrgetter into np.fromiter) per column and event
  group; names are interned through a dict (new names only in Python), thread ids by one
  np.unique at the end; sparse extras (steps, shapes, collective parameters) are looked
  at row by row only for the few rows that carry them;
- copies: a large inflated block is decoded straight from the block up to its last event
  boundary, framed in one copy; only the partial event after it is carried over.

For large files on a machine with idle CPUs, slices (cut where the count of unescaped
quotes shows the cut lies outside any string) are decoded by worker processes and their
columns merged in order; the result is identical to the serial path.

Both trace schemas are understood:
- current: kernel, gpu_memcpy, gpu_memset, cuda_runtime/cuda_driver, cuda_sync, cpu_op,
  user_annotation, gpu_user_annotation, python_function;
- 2021: Kernel, Memcpy, Memset, Runtime, Operator (tid may be a string such as "stream 7").
HIP traces (ROCm) use the same categories; their runtime calls carry a string stream id.
"""

from __future__ import annotations

import gc
import os
import re
import threading
from typing import NoReturn

import msgspec
import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.column_builder import ColumnBuilder
from diag.analyzers.trace.columns import Trace
from diag.analyzers.trace.read_blocks import blocks, threaded
from diag.analyzers.trace.salvage import bad_event, framed, salvage
from diag.analyzers.trace.schema import TOO_DEEP, _decode_any
from diag.errors import DiagInputError

CHUNK_BYTES = 8 << 20
# The longest single event (its name and args) read; a string longer than this is damage.
MAX_EVENT_BYTES = 64 << 20


_KEY_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
# The JSON Array Format of the Trace Event format: a bare array of events, whose closing
# bracket may be missing (a writer that died mid-trace; the format allows it).
_ARRAY_RE = re.compile(rb"\[\s*\{")
_SEP_RE = re.compile(rb"\}\s*,\s*\{")
_END_RE = re.compile(rb"\}?(?<!\s)\s*\]")


# Large traces are decoded by worker processes, chunk by chunk, while the main process
# inflates and cuts the stream; below this size the process start-up does not pay off.
PARALLEL_MIN_GZ_BYTES = 8 << 20
PARALLEL_MIN_JSON_BYTES = 64 << 20
MAX_DECODE_WORKERS = 4


def decode_workers(path: str) -> int:
    """Worker processes worth using for one file: 1 (serial) unless it is large and CPUs allow."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
    except OSError:
        return 1
    if size < (PARALLEL_MIN_GZ_BYTES if gz else PARALLEL_MIN_JSON_BYTES):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Workers cost ~30% more CPU in total (slices and columns cross process boundaries);
    # that pays only with idle CPUs. On a saturated machine, decode in this process.
    try:
        idle = cpus - os.getloadavg()[0]
    except OSError:
        idle = cpus
    n = min(cpus, MAX_DECODE_WORKERS, int(idle + 0.5))
    return n if n >= 2 else 1


def _decode_part(data: bytes) -> tuple[str, object]:
    """Worker: decode one slice of whole events and return its columns."""
    gc.disable()
    b = ColumnBuilder()
    try:
        b.take(b"".join((b"[", data, b"]")))
    except msgspec.ValidationError as exc:
        return "error", str(bad_event("", exc, b)).split(": ", 1)[-1]
    except msgspec.DecodeError:
        try:  # the slice is whole events: damaged ones are skipped as in this process
            salvage("", bytearray(data), 0, len(data), b)
        except DiagInputError as exc:
            return "error", str(exc).split(": ", 1)[-1]
    return "ok", b.export()


class _Parallel:
    """Decodes slices in worker processes and merges the parts into the main builder in order."""

    def __init__(self, workers: int, builder: ColumnBuilder, path: str):
        import multiprocessing as mp
        from collections import deque
        from concurrent.futures import ProcessPoolExecutor

        # fork is cheap and safe while this process has a single thread; the reader thread
        # starts only after the workers exist (they are forked at the first submit).
        method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "forkserver"
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method))
        self.pending: deque = deque()
        self.limit = 2 * workers  # bounds memory: slices in flight
        self.b = builder
        self.path = path
        self.pool.submit(int).result()  # start the workers now

    def submit(self, data: bytes) -> None:
        self.pending.append(self.pool.submit(_decode_part, data))
        while len(self.pending) > self.limit:
            self._merge_one()

    def _merge_one(self) -> None:
        status, part = self.pending.popleft().result()
        if status != "ok":
            raise DiagInputError(part, source=self.path)
        self.b.merge(part)

    def drain(self) -> None:
        while self.pending:
            self._merge_one()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


def load_trace(path: str | os.PathLike, workers: int | None = 1) -> Trace:
    """Load one Kineto trace into columns. Raises DiagInputError for unusable files.

    workers: decoding processes; 1 (the default) decodes in this process, so a library
    caller such as the agent on a training node never spawns processes; None chooses by
    file size and idle CPUs (what `diag analyze` does).
    """
    path = os.fspath(path)
    # Millions of short-lived acyclic objects: the cyclic GC would rescan them for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    par = None
    try:
        n = decode_workers(path) if workers is None else max(1, int(workers))
        b = ColumnBuilder()
        if n > 1:
            try:
                par = _Parallel(n, b, path)
            except (OSError, ValueError, RuntimeError):
                par = None  # no worker processes here (sandbox, limits): decode serially
        stream = threaded(blocks(path))
        return _load(path, stream, b, par)
    except OSError as exc:
        raise DiagInputError(f"cannot read ({exc.strerror or exc})", source=path) from None
    finally:
        if par is not None:
            par.close()
        if was_enabled:
            gc.enable()


def _load(path: str, blocks, b: ColumnBuilder, par: _Parallel | None = None) -> Trace:
    buf = bytearray()
    head = None  # bytes before the traceEvents array
    bare = False  # the Trace Event format's JSON Array Format: the file is the events array
    first = True
    it = iter(blocks)
    for blk in it:
        buf += blk
        lead = len(buf) - len(buf.lstrip()) if first else len(buf)
        first = first and lead == len(buf)  # the first bytes past any whitespace say which form
        a = _ARRAY_RE.match(buf, lead)
        if a:
            head, bare = b"{", True
            del buf[: a.end() - 1]  # keep the first event's brace
            break
        m = _KEY_RE.search(buf)
        if m:
            head = bytes(buf[: m.start()])
            del buf[: m.end()]
            break
        if len(buf) > (64 << 20):  # 64 MB without a traceEvents key: not a trace
            break
    if head is None:
        for _ in it:  # drain to detect gzip errors first
            pass
        _not_a_trace(path, bytes(buf))
    tail = None
    eof = False
    while True:
        if tail is None and (len(buf) >= CHUNK_BYTES or eof):
            consumed, tail_pos = _decode_chunks(path, buf, b, final=eof, par=par)
            if tail_pos is not None:
                tail = bytes(buf[tail_pos:])
                del buf[:]
            else:
                del buf[:consumed]
                if len(buf) > MAX_EVENT_BYTES + CHUNK_BYTES:
                    raise DiagInputError(f"an event in traceEvents is longer than {MAX_EVENT_BYTES >> 20} MiB "
                                         "(no profiler writes one): damaged or hostile data", source=path)
        if tail is not None and len(tail) > MAX_EVENT_BYTES:
            raise DiagInputError(f"more than {MAX_EVENT_BYTES >> 20} MiB after traceEvents: not a trace's metadata",
                                 source=path)
        if eof:
            break
        blk = next(it, None)
        if blk is None:
            eof = True
            if bare and tail is None:
                _close_bare_array(buf, b)
            continue
        if tail is not None:
            tail += blk
        elif par is None and len(blk) >= CHUNK_BYTES // 2 and len(buf) < CHUNK_BYTES:
            rest = _decode_direct(buf, blk, b)
            if rest is None:
                buf += blk
            else:
                buf = rest
        else:
            buf += blk
    if par is not None:
        par.drain()
    if tail is None:
        raise DiagInputError("truncated JSON: the traceEvents array never ends", source=path)
    if bare:
        if tail.strip(b" \t\r\n\x00"):
            raise DiagInputError("data after the trace's event array", source=path)
        meta = {}
    else:
        meta = _parse_meta(path, head, tail, b)
    if b.n == 0:
        raise DiagInputError("trace has no events", source=path)
    if b.n_dev == 0 and b.n_cpu == 0:
        raise DiagInputError("trace has no CPU or device activity events", source=path)
    return b.build(path, meta)


_DIRECT_WINDOW = 64 << 10


def _close_bare_array(buf: bytearray, b: ColumnBuilder) -> None:
    """End a bare event array that its writer left open: drop a trailing comma, and a last
    event cut off mid-way (a writer that died; noted), then close the array."""
    end = len(buf.rstrip(b" \t\r\n\x00"))
    if end and buf[end - 1] == 0x5D:  # "]": closed already
        return
    del buf[end:]
    if buf.endswith(b","):
        del buf[-1:]
    # The last event: whole unless the writer stopped inside it.
    seps = list(_SEP_RE.finditer(buf[-MAX_EVENT_BYTES:]))
    start = len(buf) - min(len(buf), MAX_EVENT_BYTES) + seps[-1].start() + 1 if seps else 0
    try:
        whole = isinstance(_decoded_any(bytes(buf[start:]).strip().lstrip(b",").strip()), dict)
    except (msgspec.DecodeError, UnicodeDecodeError):
        whole = False
    if not whole and seps:
        del buf[start:]
        b.decode.log().note("the event array ends inside an event (its writer stopped): that event is left out")
    buf += b"]"


def _decode_direct(buf: bytearray, blk: bytes, b: ColumnBuilder) -> bytearray | None:
    """Decode the unconsumed front of the array (buf) and a new large block up to the
    block's last event boundary, framed in a single copy (instead of appending the block
    to buf and cutting it again). Returns what follows that boundary; None when there is
    no boundary near the block's end or the text does not decode (the boundary lay inside
    a string, or the array ends in this block): the caller then takes the general path.
    """
    found = list(_SEP_RE.finditer(blk, max(0, len(blk) - _DIRECT_WINDOW)))
    if not found:
        return None
    last = found[-1]
    with memoryview(blk) as mv:
        data = b"".join((b"[", buf, mv[: last.start() + 1], b"]"))
    try:
        b.take(data)
    except msgspec.DecodeError:  # ValidationError included: the general path reports it
        return None
    del data
    return bytearray(blk[last.end() - 1:])


def _decode_chunks(path: str, buf: bytearray, b: ColumnBuilder, final: bool, par: _Parallel | None = None):
    """Decode whole events from the front of buf. Returns (bytes consumed, tail start or None).

    A candidate boundary `}, {` may lie inside a string (a kernel name); then the chunk
    ends inside that string, fails to decode, and is extended to the next candidate.
    """
    n = len(buf)
    start = 0
    while start < n and buf[start] in b" \t\r\n,":
        start += 1
    if start < n and buf[start] == ord("]"):
        return n, start + 1
    while True:
        if not final and n - start < CHUNK_BYTES:
            return start, None
        if final and n - start < CHUNK_BYTES:
            if par is not None:
                par.drain()  # keep event order: every earlier slice first
            return _decode_final(path, buf, start, b)
        pos = start + CHUNK_BYTES - 1
        if par is not None:
            # Workers decode; the cut must lie outside strings, checked by quote parity.
            end = _boundary_outside_strings(buf, start, pos)
            if end is None:
                if not final:
                    return start, None
                par.drain()
                return _decode_final(path, buf, start, b)
            par.submit(bytes(buf[start:end]))
            start = end
            while start < n and buf[start] != ord("{"):
                start += 1
            continue
        tries = 0
        while True:
            m = _SEP_RE.search(buf, pos)
            if m is None:
                if not final:
                    return start, None
                return _decode_last(path, buf, start, b)
            try:
                b.take(framed(buf, start, m.start() + 1))
            except msgspec.ValidationError as exc:
                raise bad_event(path, exc, b) from None
            except msgspec.DecodeError as exc:
                tries += 1
                if _misplaced(exc) and tries < MAX_CUT_TRIES:
                    pos = m.end()
                    continue
                salvage(path, buf, start, m.start() + 1, b)
            break
        start = m.end() - 1  # the '{' of the next event


def _unescaped_quotes(buf, lo: int, hi: int) -> int:
    """Number of string delimiters in buf[lo:hi] (quotes not escaped by a backslash).

    Counted with numpy (several GB/s) rather than bytes.count; escaped quotes are looked
    for only where the slice holds a backslash at all (a memchr scan), which most
    Kineto text does not.
    """
    view = np.frombuffer(buf, dtype=np.uint8, count=hi - lo, offset=lo)
    try:
        n = int(np.count_nonzero(view == 0x22))
        if buf.find(b"\\", lo, hi) < 0:
            return n
        for i in np.flatnonzero((view[1:] == 0x22) & (view[:-1] == 0x5C)).tolist():
            k, j = 0, lo + i
            while j >= lo and buf[j] == 0x5C:  # a quote after an odd run of backslashes is escaped
                k += 1
                j -= 1
            if k % 2:
                n -= 1
        return n
    finally:
        del view  # the bytearray cannot be resized while a view of it is alive


def _boundary_outside_strings(buf, start: int, pos: int) -> int | None:
    """End (just after the `}`) of the first `}, {` at or after pos that is not inside a string."""
    quotes = 0
    counted = start
    for m in _SEP_RE.finditer(buf, pos):
        end = m.start() + 1
        quotes += _unescaped_quotes(buf, counted, end)
        counted = end
        if quotes % 2 == 0:
            return end
    return None


def _decode_final(path: str, buf: bytearray, start: int, b: ColumnBuilder):
    """The rest of the array and its closing bracket (see `_decode_last`)."""
    return _decode_last(path, buf, start, b)


def _decode_last(path: str, buf: bytearray, start: int, b: ColumnBuilder):
    """The last events and the array's closing bracket; returns the tail's start.

    The closing bracket is searched from the end: only the real one decodes (a later one
    leaves the metadata as trailing characters, an earlier one an unclosed event), and
    the real one is followed by the metadata alone, so it is found in a few tries. When
    damage stops every candidate, the events are salvaged around it."""
    cands = list(_END_RE.finditer(buf, start))[-MAX_CUT_TRIES:]
    damaged = None
    for m in reversed(cands):
        close = m.end()
        try:
            b.take(framed(buf, start, close, close=False))
        except msgspec.ValidationError as exc:
            raise bad_event(path, exc, b) from None
        except msgspec.DecodeError as exc:
            if damaged is None and not _misplaced(exc) and buf[m.start()] == ord("}"):
                damaged = m
            continue
        return len(buf), close
    if damaged is not None:
        salvage(path, buf, start, damaged.start() + 1, b)
        return len(buf), damaged.end()
    raise DiagInputError(f"truncated or corrupt JSON in traceEvents after event {b.decode.seen}", source=path)


# A chunk cut at a `}, {` inside a string ends inside that string ("truncated"); it is
# extended to the next candidate at most this often. Any other decode error is damage.
MAX_CUT_TRIES = 64


def _misplaced(exc: Exception) -> bool:
    """The error of a cut in the wrong place, not of damage: inside a string ("truncated"),
    or past the end of the array (the metadata left as "trailing characters")."""
    text = str(exc)
    return "truncated" in text or "trailing characters" in text


def _parse_meta(path: str, head: bytes, tail: bytes, b: ColumnBuilder) -> dict:
    h = head.strip()
    if not h.startswith(b"{"):
        raise DiagInputError("not a Kineto trace (top level is not a JSON object)", source=path)
    h = h.rstrip()
    body = h[1:].rstrip().rstrip(b",")
    t = tail.strip()
    if not t.endswith(b"}"):
        raise DiagInputError("truncated JSON after traceEvents", source=path)
    t = t[:-1].strip().lstrip(b",")
    parts = [p for p in (body.strip(), t.strip()) if p]
    text = b"{" + b",".join(parts) + b"}"
    try:
        meta = _decoded_any(text)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # The events are whole; damaged metadata costs the device and rank details only.
        try:
            meta = _decoded_any(text.decode("utf-8", "replace").encode())
            note = f"metadata: invalid UTF-8 replaced ({exc})"
        except msgspec.DecodeError:
            meta = {}
            note = f"metadata: corrupt JSON outside traceEvents ({exc}), ignored"
        b.decode.log().note(note)
    if not isinstance(meta, dict):
        raise DiagInputError("not a Kineto trace", source=path)
    return meta


def window_array(windows) -> np.ndarray:
    """[(step, lo, hi), ...] as an (n, 2) array of [lo, hi), the form the facts take."""
    return np.array([[w[1], w[2]] for w in windows], dtype=np.float64).reshape(-1, 2)


def _device_ends(trace: Trace) -> tuple[float, np.ndarray]:
    """When the device finished the work launched before the first ProfilerStep, and per
    ProfilerStep, the end of the last device activity launched inside its host span (matched
    by correlation id to the runtime call that launched it); -inf where none."""
    ends = np.full(len(trace.steps), -np.inf)
    if not trace.has_device or not len(trace.rt_ts):
        return -np.inf, ends
    host = np.array([[ts, ts + dur] for _, ts, dur in trace.steps], dtype=np.float64)
    if np.any(host[1:, 0] < host[:-1, 1]):  # overlapping host spans: which step launched what is unclear
        return -np.inf, ends
    # Step -1 holds the calls made before the first step; device work whose launch the trace
    # lacks counts there too when it began before the first step.
    launched_in = np.where(trace.rt_ts < host[0, 0], len(host), iv.window_of(trace.rt_ts, host))
    call = trace.launch_calls()
    dev_step = np.where(call >= 0, launched_in[np.maximum(call, 0)], -1)
    # Work the trace has no launch for (the profiler's warm-up records none) and that ran
    # before the first step's own work is the queue that step found.
    first_own = trace.dev_ts[dev_step == 0].min() if np.any(dev_step == 0) else host[0, 1]
    dev_step[(dev_step < 0) & (trace.dev_ts < first_own)] = len(host)
    out = np.full(len(host) + 1, -np.inf)
    ok = dev_step >= 0
    np.maximum.at(out, dev_step[ok], (trace.dev_ts + trace.dev_dur)[ok])
    return float(out[-1]), out[:-1]


def _decoded_any(data: bytes):
    """Any JSON value; nesting too deep is a DecodeError like other damage."""
    try:
        return _decode_any(data)
    except RecursionError:
        raise msgspec.DecodeError(TOO_DEEP) from None


def _not_a_trace(path: str, data: bytes) -> NoReturn:
    s = data.lstrip()
    if not s:
        raise DiagInputError("empty file", source=path)
    try:
        doc = _decoded_any(s)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        msg = str(exc)
        if "truncated" in msg.lower():
            raise DiagInputError("truncated JSON", source=path) from None
        raise DiagInputError(f"not JSON ({msg})", source=path) from None
    if isinstance(doc, dict):
        raise DiagInputError(
            "JSON is not a Kineto trace (no traceEvents key; keys: "
            + ", ".join(sorted(map(str, doc))[:6]) + ")", source=path)
    if isinstance(doc, list):
        raise DiagInputError("JSON array is not a Kineto trace (expected an object with traceEvents)",
                             source=path)
    raise DiagInputError("JSON is not a Kineto trace", source=path)


def step_windows(trace: Trace) -> list[tuple[int | None, float, float]]:
    """(step, start, end) per ProfilerStep; without steps the whole trace is one window.

    On a device, a step lasts until the device has run what the step launched: a loop that
    never waits for the device runs its host steps far ahead, and their host spans alone
    would leave most kernels outside every step. Each step then starts where the one before
    it ended, so that no time is counted twice."""
    if trace.steps:
        before, ends = _device_ends(trace)
        out: list[tuple[int | None, float, float]] = []
        prev_end = before  # device work launched before the first step: the warm-up's queue
        for k, (num, ts, dur) in enumerate(trace.steps):
            lo = max(ts, prev_end)
            hi = max(ts + dur, float(ends[k]), lo)
            out.append((num, lo, hi))
            prev_end = hi
        trace.keep_host_spans(window_array(out), window_array([(n, ts, ts + dur) for n, ts, dur in trace.steps]))
        return out
    firsts: list[float] = []
    lasts: list[float] = []
    for ts, dur in ((trace.dev_ts, trace.dev_dur), (trace.cpu_ts, trace.cpu_dur), (trace.rt_ts, trace.rt_dur)):
        if len(ts):
            firsts.append(ts.min())
            lasts.append((ts + dur).max())
    if not firsts:
        return []
    return [(None, float(min(firsts)), float(max(lasts)))]
