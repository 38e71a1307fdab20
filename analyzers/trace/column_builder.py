"""The builder that appends each decoded chunk of trace events to numpy columns and makes the
`Trace` of them: one C-level pass per column and event group, names interned through a dict,
thread ids by one np.unique at the end, and sparse extras (steps, shapes, collective
parameters) read row by row only where present.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import compress, repeat
from operator import is_, is_not, itemgetter
from typing import Any, NamedTuple

import numpy as np

from diag.analyzers.trace import scan
from diag.analyzers.trace.columns import Trace
from diag.analyzers.trace.roofline import BANDWIDTH_OPS, FLOP_OPS
from diag.analyzers.trace.schema import (
    _C_GPU_ANN,
    _C_INSTANT,
    _C_KERNEL,
    _C_OP,
    _C_PY,
    _C_RUNTIME,
    _C_SYNC,
    _STEP_RE,
    Args,
    _Decoder,
    _g_args,
    _g_bytes,
    _g_coll,
    _g_corr,
    _g_dur,
    _g_ev,
    _g_ext,
    _g_ext_old,
    _g_flops,
    _g_name,
    _g_stream,
    _g_tid,
    _g_ts,
)


class CpuRows(NamedTuple):
    """One chunk's CPU-side events as columns, and accessors of the rows read one by one."""

    ids: np.ndarray
    code: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    tid: Any  # int64 array, or the raw values where some are not integers
    flops: np.ndarray
    ext: np.ndarray
    ev_idx: np.ndarray
    coll_rows: Iterable[int]
    args_of: Callable[[list[int]], list]  # those rows' args (structs of schema's CPU args)
    shapes_of: Callable[[list[int]], list[tuple[bytes, bytes | None] | None]]  # their input dims and types


class ColumnBuilder:
    def __init__(self):
        self.names: dict[str, int] = {}
        # Per column, a list of per-chunk numpy arrays, concatenated once in build().
        self.dev: dict[str, list] = {k: [] for k in ("name", "kind", "ts", "dur", "stream", "corr", "bytes", "ext")}
        self.rt: dict[str, list] = {k: [] for k in ("name", "ts", "dur", "corr", "stream")}
        self.cpu: dict[str, list] = {k: [] for k in ("name", "kind", "ts", "dur", "tid", "flops", "ext")}
        self.steps: list[tuple[int, float, float]] = []
        self.gpu_steps: list[float] = []
        self.shapes: dict[int, tuple[bytes, bytes | None, bytes | None]] = {}
        self.bw_shapes: dict[int, tuple[bytes, bytes | None]] = {}
        self.coll: dict[tuple[str, int], dict] = {}
        self.peak: dict[int, float] = {}
        self.n = 0
        self.n_cpu = 0
        self.n_dev = 0
        # Per name id: 0 plain, 1 ProfilerStep, 2 collective, 3 FLOP op, 4 bandwidth op.
        self._special: list[int] = []
        self._special_kinds = np.zeros(0, dtype=np.int8)
        self._names_cache: list[str] = []
        self.ev_idx: list[Any] = [0, None, None]  # count, min, max of Kineto's per-op "Ev Idx"
        self.decode = _Decoder()

    def _nid(self, name: str) -> int:
        n = self.names.get(name)
        if n is None:
            n = self.names[name] = len(self.names)
        return n

    def add(self, events: list, code: np.ndarray) -> None:
        """Append one decoded chunk (events and their category codes, from `_Decoder`):
        one C-level pass per column and event group, no per-event branching."""
        n = len(events)
        self.n += n
        if not n:
            return
        log = self.decode.log
        dev_idx = np.flatnonzero((code >= _C_KERNEL) & (code <= _C_SYNC))
        rt_idx = np.flatnonzero(code == _C_RUNTIME)
        cpu_idx = np.flatnonzero((code >= _C_OP) & (code <= _C_PY))
        if len(dev_idx):
            evs, c, dur, ts = _timed(_pick(events, dev_idx), code[dev_idx], log)
            args = list(map(_g_args, evs))
            m = len(evs)
            self.put_device(self._ids(evs, m), c, ts, dur, _int_column(args, m),
                            np.fromiter(map(_g_corr, args), np.int64, m),
                            np.fromiter(map(_g_bytes, args), np.float64, m), _ext_column(args, m),
                            _with_collective(args, m), _picker(args))
        if len(rt_idx):
            evs, _, dur, ts = _timed(_pick(events, rt_idx), None, log)
            args = list(map(_g_args, evs))
            m = len(evs)
            self.put_runtime(self._ids(evs, m), ts, dur, np.fromiter(map(_g_corr, args), np.int64, m),
                             _int_column(args, m))
        if len(cpu_idx):
            evs, c, dur, ts = _timed(_pick(events, cpu_idx), code[cpu_idx], log)
            args = list(map(_g_args, evs))
            m = len(evs)
            self.put_cpu(CpuRows(self._ids(evs, m), c, ts, dur, _raw_tids(evs, m),
                                 np.fromiter(map(_g_flops, args), np.float64, m), _ext_column(args, m),
                                 np.fromiter(map(_g_ev, args), np.int64, m), _with_collective(args, m),
                                 _picker(args), lambda js: [_dims_of(args[j]) for j in js]))
        for e in _pick(events, np.flatnonzero(code == _C_GPU_ANN)):
            if is_gpu_step(e.dur, e.ts, e.name):
                self.gpu_steps.append(e.ts)
        for e in _pick(events, np.flatnonzero(code == _C_INSTANT)):
            a = e.args
            note_peak(self.peak, e.dur, a.total_allocated, a.device_type, a.device_id)

    def take(self, data) -> None:
        """Decode one JSON array of events and append it: on the compiled path where it is built
        and takes the chunk, else on the Python one (which raises msgspec's errors)."""
        if not scan.take(self, data):
            self.add(*self.decode(data))

    def _ids(self, evs, n: int) -> np.ndarray:
        """Name ids; new names are numbered in order of appearance."""
        return _intern(self.names, list(map(_g_name, evs)), n)

    def put_device(self, ids, code, ts, dur, stream, corr, nbytes, ext, coll_rows, args_of) -> None:
        """Device events' columns; `args_of(rows)` gives those rows' args, read for the collectives."""
        dev = self.dev
        n = len(ids)
        if not n:
            return
        base = self.n_dev
        dev["name"].append(ids)
        dev["kind"].append(code - _C_KERNEL)
        dev["ts"].append(ts)
        dev["dur"].append(dur)
        dev["stream"].append(stream)
        dev["corr"].append(corr)
        dev["bytes"].append(nbytes)
        dev["ext"].append(ext)
        coll_rows = list(coll_rows)
        for j, a in zip(coll_rows, args_of(coll_rows)):
            self.coll[("dev", base + j)] = _coll_args(a)
        self.n_dev += n

    def put_runtime(self, ids, ts, dur, corr, stream) -> None:
        rt = self.rt
        if not len(ids):
            return
        rt["name"].append(ids)
        rt["ts"].append(ts)
        rt["dur"].append(dur)
        rt["corr"].append(corr)
        # HIP writes the stream as "0x0", which (like HTA) is not read as a device stream.
        rt["stream"].append(stream)

    def put_cpu(self, rows: CpuRows) -> None:
        cpu = self.cpu
        n = len(rows.ids)
        if not n:
            return
        base = self.n_cpu
        ids, dur, flops = rows.ids, rows.dur, rows.flops
        cpu["name"].append(ids)
        cpu["kind"].append(rows.code - _C_OP)
        cpu["ts"].append(rows.ts)
        cpu["dur"].append(dur)
        cpu["tid"].append(rows.tid)
        cpu["flops"].append(flops)
        cpu["ext"].append(rows.ext)
        ei = rows.ev_idx[rows.ev_idx >= 0]
        if len(ei):
            c = self.ev_idx
            c[0] += len(ei)
            c[1] = int(ei.min()) if c[1] is None else min(c[1], int(ei.min()))
            c[2] = int(ei.max()) if c[2] is None else max(c[2], int(ei.max()))
        self.n_cpu += n
        # Sparse extras, looked at only for the few rows that need them.
        known = len(self._special)
        if len(self.names) > known:
            names = self._name_list()
            self._special.extend(_special_kind(names[i]) for i in range(known, len(names)))
            self._special_kinds = np.asarray(self._special, dtype=np.int8)
        kinds = self._special_kinds[ids]
        # Bandwidth ops are many (most of a step's ops): their shapes are taken in one pass,
        # where the trace recorded any, outside the row-by-row loop of the rarer extras.
        bandwidth = np.flatnonzero(kinds == 4).tolist()
        for j, shape in zip(bandwidth, rows.shapes_of(bandwidth)):
            if shape is not None:
                self.bw_shapes[base + j] = shape
        extra = set(np.flatnonzero((kinds != 0) & (kinds != 4)).tolist())
        extra.update(np.flatnonzero(~np.isnan(flops)).tolist())
        extra.update(rows.coll_rows)
        names = self._name_list()
        extra_rows = sorted(extra)
        for j, a in zip(extra_rows, rows.args_of(extra_rows)):
            kind = int(kinds[j])
            if kind == 1:
                name = names[ids[j]]
                m = _STEP_RE.match(name)
                if m and len(m.group(1)) < 19:  # a step number within int64
                    self.steps.append((int(m.group(1)), float(rows.ts[j]), float(dur[j])))
                elif m:
                    self.decode.log().note(f"{name[:40]!r}: a step number beyond int64, not a step")
            if (kind == 3 or not math.isnan(a.flops)) and a.input_dims:
                self.shapes[base + j] = (bytes(a.input_dims), bytes(a.input_type) if a.input_type else None,
                                         bytes(a.concrete) if a.concrete else None)
            if a.coll_name is not None or (kind == 2 and a.input_dims):
                d = _coll_args(a)
                if a.input_dims:
                    d["input_dims"] = bytes(a.input_dims)
                    d["input_type"] = bytes(a.input_type) if a.input_type else None
                self.coll[("cpu", base + j)] = d

    def export(self) -> dict:
        """This builder's columns and extras, to be merged into another builder (worker -> main)."""
        return {
            "names": self._name_list(),
            "dev": {k: _cat(v, _DTYPES[k]) for k, v in self.dev.items()},
            "rt": {k: _cat(v, _DTYPES[k]) for k, v in self.rt.items()},
            "cpu": {k: (v if k == "tid" else _cat(v, _DTYPES[k])) for k, v in self.cpu.items()},
            "steps": self.steps, "gpu_steps": self.gpu_steps, "shapes": self.shapes, "bw_shapes": self.bw_shapes,
            "coll": self.coll,
            "peak": self.peak, "ev_idx": self.ev_idx, "n": self.n, "n_dev": self.n_dev, "n_cpu": self.n_cpu,
            "repairs": self.decode.repairs_done(),
        }

    def merge(self, part: dict) -> None:
        """Append an exported part after what this builder holds (ids remapped, rows offset)."""
        names = self.names
        nmap = np.array([names.setdefault(x, len(names)) for x in part["names"]], dtype=np.int32)
        for group, mine in (("dev", self.dev), ("rt", self.rt), ("cpu", self.cpu)):
            for k, arr in part[group].items():
                if k == "name" and len(arr):
                    arr = nmap[arr]
                if k == "tid":
                    mine[k].extend(arr)  # raw thread ids, numbered in build()
                else:
                    mine[k].append(arr)
        self.steps += part["steps"]
        self.gpu_steps += part["gpu_steps"]
        self.shapes.update({i + self.n_cpu: v for i, v in part["shapes"].items()})
        self.bw_shapes.update({i + self.n_cpu: v for i, v in part["bw_shapes"].items()})
        base = {"dev": self.n_dev, "cpu": self.n_cpu}
        self.coll.update({(w, i + base[w]): v for (w, i), v in part["coll"].items()})
        for d, v in part["peak"].items():
            self.peak[d] = max(self.peak.get(d, 0.0), v)
        c, o = self.ev_idx, part["ev_idx"]
        if o[0]:
            c[0] += o[0]
            c[1] = o[1] if c[1] is None else min(c[1], o[1])
            c[2] = o[2] if c[2] is None else max(c[2], o[2])
        self.n += part["n"]
        self.n_dev += part["n_dev"]
        self.n_cpu += part["n_cpu"]
        self.decode.seen += part["n"]
        if part.get("repairs"):
            self.decode.log().merge(part["repairs"])

    def _name_list(self) -> list[str]:
        if len(self._names_cache) != len(self.names):
            self._names_cache = list(self.names)  # dict keys in insertion order = id order
        return self._names_cache

    def _shortened(self, name: str) -> str:
        self.decode.log().note(f"name {name[:40]!r}... of {len(name):,} characters cut to {MAX_NAME_CHARS:,}")
        return f"{name[:MAX_NAME_CHARS]}...[{len(name):,} chars]"

    def build(self, source: str, meta: dict) -> Trace:
        f8, i8 = np.float64, np.int64
        d, r, c = self.dev, self.rt, self.cpu
        names = [""] * len(self.names)
        for s, i in self.names.items():
            names[i] = s if len(s) <= MAX_NAME_CHARS else self._shortened(s)
        return Trace(
            source=source,
            meta=meta,
            names=names,
            dev_name=_cat(d["name"], np.int32),
            dev_kind=_cat(d["kind"], np.int8),
            dev_ts=_cat(d["ts"], f8),
            dev_dur=_cat(d["dur"], f8),
            dev_stream=_cat(d["stream"], i8),
            dev_corr=_cat(d["corr"], i8),
            dev_bytes=_cat(d["bytes"], f8),
            dev_ext=_cat(d["ext"], i8),
            rt_name=_cat(r["name"], np.int32),
            rt_ts=_cat(r["ts"], f8),
            rt_dur=_cat(r["dur"], f8),
            rt_corr=_cat(r["corr"], i8),
            rt_stream=_cat(r["stream"], i8),
            cpu_name=_cat(c["name"], np.int32),
            cpu_kind=_cat(c["kind"], np.int8),
            cpu_ts=_cat(c["ts"], f8),
            cpu_dur=_cat(c["dur"], f8),
            cpu_tid=_tid_ids(c["tid"]),
            cpu_flops=_cat(c["flops"], f8),
            cpu_ext=_cat(c["ext"], i8),
            steps=_dedupe_steps(self.steps),
            gpu_step_ts=np.asarray(self.gpu_steps, dtype=f8),
            shapes=self.shapes,
            bw_shapes=self.bw_shapes,
            coll_args=self.coll,
            peak_allocated=self.peak,
            n_events=self.n,
            op_coverage=_coverage(self.ev_idx),
            repairs=self.decode.repairs_done(),
        )


_DTYPES = {"name": np.int32, "kind": np.int8, "ts": np.float64, "dur": np.float64, "stream": np.int64,
           "corr": np.int64, "bytes": np.float64, "ext": np.int64, "tid": np.int32, "flops": np.float64}


def _pick(events: list, idx: np.ndarray) -> list:
    if len(idx) == 0:
        return []
    if len(idx) == 1:
        return [events[int(idx[0])]]
    return list(itemgetter(*idx.tolist())(events))


def _cat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _intern(table: dict, values: list, n: int) -> np.ndarray:
    """Ids of values in table, adding new values in order of appearance. C-level passes
    only: a chunk brings few new values (a new ProfilerStep#N, a new kernel)."""
    ids = list(map(table.get, values))
    try:
        return np.fromiter(ids, np.int32, n)
    except TypeError:  # None: a new value
        for j in compress(range(n), map(is_, ids, repeat(None))):
            ids[j] = table.setdefault(values[j], len(table))
        return np.fromiter(ids, np.int32, n)


def _raw_tids(evs: list, n: int):
    """Thread ids of a chunk as Kineto writes them: an int64 array when all are integers,
    else the raw values (2021 traces write strings such as "stream 7")."""
    try:
        return np.fromiter(map(_g_tid, evs), np.int64, n)
    except (TypeError, ValueError, OverflowError):
        return list(map(_g_tid, evs))


def _tid_ids(parts: list) -> np.ndarray:
    """Thread ids numbered 0..k-1 (in sorted order when all are integers: one np.unique
    instead of a dict lookup per event; else in order of appearance)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        raw = _cat(parts, np.int64)
        return np.unique(raw, return_inverse=True)[1].astype(np.int32).reshape(-1)
    # A damaged trace may give a thread id of any JSON type; ids only need to tell threads apart.
    values = [v if type(v) in (int, str, float) else repr(v)
              for p in parts for v in (p.tolist() if isinstance(p, np.ndarray) else p)]
    return _intern({}, values, len(values))


# No profiled event lasts this long or lies this far from the epoch: a value beyond them is
# damage, and a loop or a bin count must never take its size from one.
MAX_EVENT_US = 1e12  # 11.6 days
# Demangled kernel names reach 2,000 characters; every later stage reads names character by
# character (return types, template arguments), so a longer one is cut here, once.
MAX_NAME_CHARS = 16_384
MAX_ABS_TS_US = 1e17  # about 3,170 years


def _timed(evs: list, code, log):
    """The complete ("X") events of a group, their codes, durations and start times: events without a
    duration (instant, flow) are dropped, and those whose time or duration no profiler
    writes are dropped and counted in the repairs (`log()`)."""
    n = len(evs)
    dur = np.fromiter(map(_g_dur, evs), np.float64, n)
    ts = np.fromiter(map(_g_ts, evs), np.float64, n)
    idx = timed_rows(dur, ts, lambda i: _g_name(evs[i]), log)
    if idx is None:
        return evs, code, dur, ts
    return _pick(evs, idx), (code[idx] if code is not None else None), dur[idx], ts[idx]


def timed_rows(dur: np.ndarray, ts: np.ndarray, name_at: Callable[[int], str], log) -> np.ndarray | None:
    """The rows of `_timed`'s events kept (None: all of them); the dropped odd ones are noted."""
    keep = dur >= 0
    odd = dur > MAX_EVENT_US
    odd |= np.abs(ts) > MAX_ABS_TS_US
    odd &= keep
    if odd.any():
        for i in np.flatnonzero(odd)[:3].tolist():
            log().note(f"event {name_at(i)[:40]!r}: ts {ts[i]:.4g} us, dur {dur[i]:.4g} us is beyond what "
                       "a profiler records, event ignored", event=True)
        log().events += max(0, int(odd.sum()) - 3)
        keep &= ~odd
    return None if keep.all() else np.flatnonzero(keep)


def is_gpu_step(dur: float, ts: float, name: str) -> bool:
    """A GPU-side ProfilerStep annotation, within what a profiler records."""
    return 0 <= dur <= MAX_EVENT_US and abs(ts) <= MAX_ABS_TS_US and "ProfilerStep" in name


def note_peak(peak: dict[int, float], dur: float, total, device_type, device_id) -> None:
    """A memory instant's allocated total into its device's peak (absent values are None)."""
    if dur < 0 and total is not None and device_type not in (0, None):  # device type 0 is the CPU
        d = int(device_id or 0)
        peak[d] = max(peak.get(d, 0.0), float(total))


def _with_collective(args: list, n: int):
    """Row numbers of the events whose args name a collective (a few per step)."""
    colls = list(map(_g_coll, args))
    if colls.count(None) == n:
        return ()
    return compress(range(n), map(is_not, colls, repeat(None)))


def _int_column(args: list, n: int) -> np.ndarray:
    """Integer stream ids; anything that is not an integer (HIP's "0x0", null) is -1."""
    try:
        return np.fromiter(map(_g_stream, args), np.int64, n)
    except (TypeError, ValueError, OverflowError):
        return np.fromiter(map(_int_or, map(_g_stream, args)), np.int64, n)


def _ext_column(args: list, n: int) -> np.ndarray:
    """External id (current schema), else "external id" (2021 schema), else -1."""
    new = np.fromiter(map(_g_ext, args), np.int64, n)
    missing = np.flatnonzero(new < 0)
    if len(missing):
        new[missing] = np.fromiter(map(_g_ext_old, _pick(args, missing)), np.int64, len(missing))
    return new


def _picker(items: list) -> Callable[[list[int]], list]:
    return lambda js: [items[j] for j in js]


def _dims_of(a) -> tuple[bytes, bytes | None] | None:
    return (bytes(a.input_dims), bytes(a.input_type) if a.input_type else None) if a.input_dims else None


def _int_or(v, default: int = -1) -> int:
    """v as an int64, else `default` (beyond int64, or not a number)."""
    try:
        x = v if type(v) is int else int(v)
    except (TypeError, ValueError, OverflowError):
        return default
    return x if -(2**63) <= x < 2**63 else default


def _special_kind(name: str) -> int:
    if name.startswith("ProfilerStep"):
        return 1
    if _is_comm_host(name):
        return 2
    if name in FLOP_OPS:
        return 3
    if name in BANDWIDTH_OPS:
        return 4
    return 0


def _coverage(ev_idx) -> float | None:
    count, lo, hi = ev_idx
    if not count or lo is None:
        return None
    return count / (hi - lo + 1)


def _dedupe_steps(steps):
    """One window per step number (the longest record), sorted by start."""
    best: dict[int, tuple[int, float, float]] = {}
    for st in steps:
        if st[0] not in best or st[2] > best[st[0]][2]:
            best[st[0]] = st
    return sorted(best.values(), key=lambda s: s[1])


def _is_comm_host(name: str) -> bool:
    return name == "record_param_comms" or name.startswith(("c10d::", "nccl:", "gloo:"))


def _coll_args(a: Args) -> dict:
    pg = a.pg_name if a.pg_name is not None else a.pg_id
    return {
        "collective": a.coll_name,
        "pg": None if pg is None else str(pg),
        "pg_desc": a.pg_desc,
        "group_size": a.group_size,
        "in_nelems": a.in_nelems,
        "out_nelems": a.out_nelems,
        "dtype": a.dtype,
        "seq": a.seq,
    }
