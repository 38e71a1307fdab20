"""A decoded trace as numpy columns per event class (`Trace`), and the builder that appends
each decoded chunk of events to them (`_Builder`): one C-level pass per column and event
group, names interned through a dict, thread ids by one np.unique at the end, and sparse
extras (steps, shapes, collective parameters) read row by row only where present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_, is_not, itemgetter

import numpy as np

from diag.analyzers import intervals as iv
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


@dataclass
class Trace:
    """Columns per event class of one rank's trace. Times in microseconds."""

    source: str
    meta: dict
    names: list[str]
    # Device activity (kernels, copies, sets, device-side syncs).
    dev_name: np.ndarray
    dev_kind: np.ndarray
    dev_ts: np.ndarray
    dev_dur: np.ndarray
    dev_stream: np.ndarray  # -1 when not an integer (HTA's rule)
    dev_corr: np.ndarray
    dev_bytes: np.ndarray  # NaN when unknown
    # Host runtime calls (cudaLaunchKernel, cudaStreamSynchronize, hipMemcpy...).
    rt_name: np.ndarray
    rt_ts: np.ndarray
    rt_dur: np.ndarray
    rt_corr: np.ndarray
    rt_stream: np.ndarray
    # CPU ops, annotations and python functions.
    cpu_name: np.ndarray
    cpu_kind: np.ndarray
    cpu_ts: np.ndarray
    cpu_dur: np.ndarray
    cpu_tid: np.ndarray
    cpu_flops: np.ndarray  # NaN when not recorded
    cpu_ext: np.ndarray
    # ProfilerStep windows (host side), sorted by start: (step number, ts, dur).
    steps: list[tuple[int, float, float]]
    dev_ext: np.ndarray  # External id: links a kernel to the CPU op that launched it
    gpu_step_ts: np.ndarray  # starts of ProfilerStep annotations on the device timeline
    # Sparse extras: per CPU row index, raw (Input Dims, Input type, Concrete Inputs) of ops
    # with a FLOPs arg or whose FLOPs diag derives from shapes (roofline.FLOP_OPS).
    shapes: dict[int, tuple[bytes, bytes | None, bytes | None]] = field(default_factory=dict)
    # Per CPU row index, raw (Input Dims, Input type) of the common elementwise, copy and
    # reduction ops (roofline.BANDWIDTH_OPS): the bytes their kernels move.
    bw_shapes: dict[int, tuple[bytes, bytes | None]] = field(default_factory=dict)
    # Collective parameters, per row of cpu (key ("cpu", i)) or device (("dev", i)).
    coll_args: dict[tuple[str, int], dict] = field(default_factory=dict)
    peak_allocated: dict[int, float] = field(default_factory=dict)  # device id -> bytes
    n_events: int = 0
    # Share of the profiler's host events present ("Ev Idx" numbers them consecutively);
    # far below 1 in traces that were sampled or filtered after recording.
    op_coverage: float | None = None
    # Fields of an unexpected type that were converted or ignored, events dropped, and a few
    # examples (diag.analyzers.trace.tolerant); None when the trace decoded as it is.
    repairs: dict | None = None

    def step_of(self, column: str, win: np.ndarray) -> np.ndarray:
        """Each event's row in the step windows `win` (-1 outside them all) for the column
        "cpu", "dev" or "rt": found once per column and windows, as each per-step fact asks
        for it. Read-only.

        Where `win` holds ProfilerSteps stretched over their device work (load.step_windows),
        host events belong to the step whose host span holds them, and device work to the
        step that launched it: a loop that runs ahead of the device launches step k+1 while
        step k's kernels still run."""
        cache = self.__dict__.setdefault("_derived", {})
        key = (column, win.shape, win.tobytes())
        if key not in cache:
            spans = self.host_spans(win)
            if column == "dev" and spans is not win:
                found = iv.window_of(self.dev_ts, win)
                launched, call = self.step_of("rt", win), self.launch_calls()
                hit = np.flatnonzero(call >= 0)
                hit = hit[launched[call[hit]] >= 0]
                found[hit] = launched[call[hit]]
            else:
                found = iv.window_of(getattr(self, f"{column}_ts"), spans)
            found = found.astype(np.int32)
            found.flags.writeable = False
            cache[key] = found
        return cache[key]

    def keep_steps(self, first: int, last: int) -> None:
        """Keep the ProfilerSteps numbered first..last (all of them where none is), before
        any fact is derived from them."""
        inside = [s for s in self.steps if first <= s[0] <= last]
        if inside and "_derived" not in self.__dict__:
            self.steps = inside

    def host_spans(self, win: np.ndarray) -> np.ndarray:
        """The host spans of the steps in `win`: the ProfilerStep spans where `win` stretches
        them over their device work (keep_host_spans), else `win` itself."""
        return self.__dict__.get("_derived", {}).get(("host_spans", win.shape, win.tobytes()), win)

    def host_span(self, lo: float, hi: float) -> tuple[float, float]:
        """The host span of the step window [lo, hi), as host_spans gives it for one window."""
        return self.__dict__.get("_derived", {}).get(("host_span", lo, hi), (lo, hi))

    def keep_host_spans(self, win: np.ndarray, spans: np.ndarray) -> None:
        if np.array_equal(win, spans):
            return
        cache = self.__dict__.setdefault("_derived", {})
        cache[("host_spans", win.shape, win.tobytes())] = spans
        for (lo, hi), (h_lo, h_hi) in zip(win.tolist(), spans.tolist()):
            cache[("host_span", lo, hi)] = (h_lo, h_hi)

    def launch_calls(self) -> np.ndarray:
        """Per device row, the runtime row that launched it (the first with its correlation id;
        -1: none, or no id), found once. Read-only."""
        cache = self.__dict__.setdefault("_derived", {})
        if "launch_calls" not in cache:
            found = np.full(len(self.dev_corr), -1, dtype=np.int64)
            by_corr = np.argsort(self.rt_corr, kind="stable")
            corr = self.rt_corr[by_corr]
            if len(corr):
                k = np.clip(np.searchsorted(corr, self.dev_corr), 0, len(corr) - 1)
                hit = (corr[k] == self.dev_corr) & (self.dev_corr > 0)
                found[hit] = by_corr[k[hit]]
            found.flags.writeable = False
            cache["launch_calls"] = found
        return cache["launch_calls"]

    def launcher_rows(self) -> np.ndarray:
        """Per device row, the CPU row whose External id it carries (the op that launched it;
        -1: none), found once. Read-only."""
        cache = self.__dict__.setdefault("_derived", {})
        if "launchers" not in cache:
            found = index_of(self.cpu_ext, self.dev_ext).astype(np.int32 if len(self.cpu_ext) < 2**31 else np.int64)
            found.flags.writeable = False
            cache["launchers"] = found
        return cache["launchers"]

    def name_of(self, ids) -> list[str]:
        return [self.names[i] for i in np.asarray(ids).tolist()]

    @property
    def has_device(self) -> bool:
        return len(self.dev_ts) > 0


class _Builder:
    def __init__(self):
        self.names: dict[str, int] = {}
        # Per column, a list of per-chunk numpy arrays, concatenated once in build().
        self.dev = {k: [] for k in ("name", "kind", "ts", "dur", "stream", "corr", "bytes", "ext")}
        self.rt = {k: [] for k in ("name", "ts", "dur", "corr", "stream")}
        self.cpu = {k: [] for k in ("name", "kind", "ts", "dur", "tid", "flops", "ext")}
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
        self.ev_idx = [0, None, None]  # count, min, max of Kineto's per-op "Ev Idx"
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
        dev_idx = np.flatnonzero((code >= _C_KERNEL) & (code <= _C_SYNC))
        rt_idx = np.flatnonzero(code == _C_RUNTIME)
        cpu_idx = np.flatnonzero((code >= _C_OP) & (code <= _C_PY))
        if len(dev_idx):
            self._add_device(*_timed(_pick(events, dev_idx), code[dev_idx], self.decode.log))
        if len(rt_idx):
            self._add_runtime(*_timed(_pick(events, rt_idx), None, self.decode.log))
        if len(cpu_idx):
            self._add_cpu(*_timed(_pick(events, cpu_idx), code[cpu_idx], self.decode.log))
        for e in _pick(events, np.flatnonzero(code == _C_GPU_ANN)):
            if 0 <= e.dur <= MAX_EVENT_US and abs(e.ts) <= MAX_ABS_TS_US and "ProfilerStep" in e.name:
                self.gpu_steps.append(e.ts)
        for e in _pick(events, np.flatnonzero(code == _C_INSTANT)):
            a = e.args
            if e.dur < 0 and a.total_allocated is not None and a.device_type not in (0, None):
                d = int(a.device_id or 0)  # device type 0 is the CPU
                self.peak[d] = max(self.peak.get(d, 0.0), float(a.total_allocated))

    def _ids(self, evs, n: int) -> np.ndarray:
        """Name ids; new names are numbered in order of appearance."""
        return _intern(self.names, list(map(_g_name, evs)), n)

    def _add_device(self, evs, code, dur, ts):
        dev = self.dev
        n = len(evs)
        if not n:
            return
        args = list(map(_g_args, evs))
        base = self.n_dev
        dev["name"].append(self._ids(evs, n))
        dev["kind"].append(code - _C_KERNEL)
        dev["ts"].append(ts)
        dev["dur"].append(dur)
        dev["stream"].append(_int_column(args, n))
        dev["corr"].append(np.fromiter(map(_g_corr, args), np.int64, n))
        dev["bytes"].append(np.fromiter(map(_g_bytes, args), np.float64, n))
        dev["ext"].append(_ext_column(args, n))
        for j in _with_collective(args, n):
            self.coll[("dev", base + j)] = _coll_args(args[j])
        self.n_dev += n

    def _add_runtime(self, evs, _code, dur, ts):
        rt = self.rt
        n = len(evs)
        if not n:
            return
        args = list(map(_g_args, evs))
        rt["name"].append(self._ids(evs, n))
        rt["ts"].append(ts)
        rt["dur"].append(dur)
        rt["corr"].append(np.fromiter(map(_g_corr, args), np.int64, n))
        # HIP writes the stream as "0x0", which (like HTA) is not read as a device stream.
        rt["stream"].append(_int_column(args, n))

    def _add_cpu(self, evs, code, dur, ts):
        cpu = self.cpu
        n = len(evs)
        if not n:
            return
        base = self.n_cpu
        ids = self._ids(evs, n)
        args = list(map(_g_args, evs))
        cpu["name"].append(ids)
        cpu["kind"].append(code - _C_OP)
        cpu["ts"].append(ts)
        cpu["dur"].append(dur)
        cpu["tid"].append(_raw_tids(evs, n))
        flops = np.fromiter(map(_g_flops, args), np.float64, n)
        cpu["flops"].append(flops)
        cpu["ext"].append(_ext_column(args, n))
        ei = np.fromiter(map(_g_ev, args), np.int64, n)
        ei = ei[ei >= 0]
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
        for j in [j for j in bandwidth if args[j].input_dims]:
            a = args[j]
            self.bw_shapes[base + j] = (bytes(a.input_dims), bytes(a.input_type) if a.input_type else None)
        extra = set(np.flatnonzero((kinds != 0) & (kinds != 4)).tolist())
        extra.update(np.flatnonzero(~np.isnan(flops)).tolist())
        extra.update(_with_collective(args, n))
        for j in sorted(extra):
            kind = int(kinds[j])
            a = args[j]
            if kind == 1:
                m = _STEP_RE.match(evs[j].name)
                if m and len(m.group(1)) < 19:  # a step number within int64
                    self.steps.append((int(m.group(1)), evs[j].ts, float(dur[j])))
                elif m:
                    self.decode.log().note(f"{evs[j].name[:40]!r}: a step number beyond int64, not a step")
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
    keep = dur >= 0
    odd = dur > MAX_EVENT_US
    ts = np.fromiter(map(_g_ts, evs), np.float64, n)
    odd |= np.abs(ts) > MAX_ABS_TS_US
    odd &= keep
    if odd.any():
        for i in np.flatnonzero(odd)[:3].tolist():
            log().note(f"event {_g_name(evs[i])[:40]!r}: ts {ts[i]:.4g} us, dur {dur[i]:.4g} us is beyond what "
                       "a profiler records, event ignored", event=True)
        log().events += max(0, int(odd.sum()) - 3)
        keep &= ~odd
    if keep.all():
        return evs, code, dur, ts
    idx = np.flatnonzero(keep)
    return _pick(evs, idx), (code[idx] if code is not None else None), dur[idx], ts[idx]


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


def index_of(keys: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where each wanted id sits in `keys` (ids such as External ids; negative ones mean none),
    -1 where absent: through one table indexed by id where the ids are dense, else by binary
    search."""
    pos = np.flatnonzero(keys >= 0)
    if not len(pos) or not len(want):
        return np.full(len(want), -1, dtype=np.int64)
    keys = keys[pos]
    top = int(keys.max())
    if top < 8 * len(keys) + (1 << 20):
        table = np.full(top + 1, -1, dtype=np.int32 if pos[-1] < 2**31 else np.int64)
        table[keys] = pos
        return np.where((want >= 0) & (want <= top), table[np.clip(want, 0, top)], -1)
    ids, first = np.unique(keys, return_index=True)
    at = np.clip(np.searchsorted(ids, want), 0, len(ids) - 1)
    return np.where((ids[at] == want) & (want >= 0), pos[first[at]], -1)

