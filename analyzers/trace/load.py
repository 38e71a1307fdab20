"""Streaming loader for Kineto (torch.profiler) Chrome-trace JSON, plain or gzipped.

Why not `json.load` or one DataFrame: a 2M-event trace is ~1 GB of JSON and several GB
as Python dicts. Here the file is decompressed in blocks, the `traceEvents` array is cut
at event boundaries into chunks of a few MB, each chunk is decoded by msgspec into small
typed structs, and the chunk's events are appended to numpy columns per event class
before the next chunk is read.

Where the time goes on a 2M-event trace, and what keeps each part small:
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
import math
import os
import queue
import re
import threading
import zlib
from dataclasses import dataclass, field
from functools import reduce
from itertools import compress, repeat
from operator import attrgetter, is_, is_not, itemgetter, or_
from typing import Any

import msgspec
import numpy as np

from diag.analyzers.trace.roofline import FLOP_OPS
from diag.errors import DiagInputError

try:  # ISA-L's inflate (python-isal) is 2-3x faster than zlib's, with the same interface
    from isal import isal_zlib as _inflate
except ImportError:
    _inflate = zlib
_INFLATE_ERRORS = (zlib.error, _inflate.error)
# python-isal's gzip reader inflates straight into a caller's buffer (no growing output
# buffer, no fresh pages per block); without it, decompressobj blocks are used.
_GzipReader = getattr(_inflate, "_GzipReader", None)

CHUNK_BYTES = 8 << 20
READ_BYTES = 1 << 20

# Category -> code; the codes group event classes so one numpy mask selects each group.
_C_KERNEL, _C_MEMCPY, _C_MEMSET, _C_SYNC, _C_RUNTIME = 1, 2, 3, 4, 5
_C_OP, _C_ANN, _C_PY, _C_GPU_ANN, _C_INSTANT = 6, 7, 8, 9, 10
_CAT_CODE = {
    "kernel": _C_KERNEL, "Kernel": _C_KERNEL, "gpu_memcpy": _C_MEMCPY, "Memcpy": _C_MEMCPY,
    "gpu_memset": _C_MEMSET, "Memset": _C_MEMSET, "cuda_sync": _C_SYNC,
    "cuda_runtime": _C_RUNTIME, "Runtime": _C_RUNTIME, "cuda_driver": _C_RUNTIME, "Driver": _C_RUNTIME,
    "cpu_op": _C_OP, "Operator": _C_OP, "user_annotation": _C_ANN, "python_function": _C_PY,
    "gpu_user_annotation": _C_GPU_ANN, "cpu_instant_event": _C_INSTANT, "": _C_INSTANT,
}
# Event classes of the loader (column groups).
DEVICE_KINDS = {"kernel": 0, "Kernel": 0, "gpu_memcpy": 1, "Memcpy": 1, "gpu_memset": 2, "Memset": 2,
                "cuda_sync": 3}
KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_SYNC = 0, 1, 2, 3
RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver", "Driver"}
# CPU-side events: value is the op kind (0 op, 1 annotation, 2 python function).
CPU_CATS = {"cpu_op": 0, "Operator": 0, "user_annotation": 1, "python_function": 2}
FLOW_CATS = {"ac2g", "fwdbwd", "async", "flow"}

_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")


class Args(msgspec.Struct, forbid_unknown_fields=False, frozen=True, gc=False):
    """The few `args` keys diag reads. Missing numbers default to -1 / NaN, so columns are
    filled by C-level map() calls instead of per-event None checks."""

    stream: Any = -1
    correlation: int = -1
    external_id: int = msgspec.field(default=-1, name="External id")
    external_id_old: int = msgspec.field(default=-1, name="external id")
    flops: float = math.nan
    bytes: float = math.nan
    ev_idx: int = msgspec.field(default=-1, name="Ev Idx")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Concrete Inputs")
    # Collectives (record_param_comms, NCCL kernels with parameters).
    coll_name: str | None = msgspec.field(default=None, name="Collective name")
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_id: Any = msgspec.field(default=None, name="Process Group ID")
    pg_desc: str | None = msgspec.field(default=None, name="Process Group Description")
    group_size: int | None = msgspec.field(default=None, name="Group size")
    in_nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: int | None = msgspec.field(default=None, name="Out msg nelems")
    dtype: str | None = None
    seq: Any = msgspec.field(default=None, name="Seq")
    # Memory instant events.
    total_allocated: float | None = msgspec.field(default=None, name="Total Allocated")
    device_type: int | None = msgspec.field(default=None, name="Device Type")
    device_id: int | None = msgspec.field(default=None, name="Device Id")


NO_ARGS = Args()


class Event(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    # Only what diag reads; "ph" is implied by "dur" (complete events are the timed ones).
    cat: str = ""
    name: str = ""
    tid: Any = 0
    ts: float = 0.0
    dur: float = -1.0
    args: Args = NO_ARGS


# The fast decoding path: one struct type per category, told apart by msgspec from the
# "cat" key (a tagged union), each with only the keys its column group reads. Flow events
# (a third of a trace) decode to empty structs, and the category needs no string and no
# per-event lookup. A chunk holding an event the union does not know (no "cat", an
# unexpected category) is decoded again with `Event`; both paths fill the same columns.
def _args_struct(name: str, keys: list[str]) -> type:
    fields = []
    for f in msgspec.structs.fields(Args):
        if f.name in keys:
            fields.append((f.name, f.type, msgspec.field(default=f.default, name=f.encode_name)))
    return msgspec.defstruct(name, fields, forbid_unknown_fields=False, frozen=True, gc=False)


_COLL_KEYS = ["coll_name", "pg_name", "pg_id", "pg_desc", "group_size", "in_nelems", "out_nelems", "dtype", "seq"]
_DevArgs = _args_struct("DevArgs", ["stream", "correlation", "external_id", "external_id_old", "bytes", *_COLL_KEYS])
_RtArgs = _args_struct("RtArgs", ["stream", "correlation"])
_CpuArgs = _args_struct("CpuArgs", ["external_id", "external_id_old", "flops", "ev_idx", "input_dims", "input_type",
                                    "concrete", *_COLL_KEYS])
_MemArgs = _args_struct("MemArgs", ["total_allocated", "device_type", "device_id"])
_NoArgs = _args_struct("NoArgs", [])
# Categories whose events diag never reads (flow arrows, the profiler's own spans).
_SKIP_CATS = ("ac2g", "fwdbwd", "async", "flow", "Trace", "overhead", "cuda_profiler_range",
              "external_correlation", "collective_comm", "mtia_runtime", "mtia_ccp_events",
              "glow_runtime", "hpu_op", "xpu_runtime", "privateuse1_runtime", "privateuse1_driver")


def _tagged_union():
    fields_of = {
        "dev": ("name", "ts", "dur", _DevArgs), "rt": ("name", "ts", "dur", _RtArgs),
        "cpu": ("name", "tid", "ts", "dur", _CpuArgs), "gpu_ann": ("name", "ts", "dur", _NoArgs),
        "instant": ("dur", _MemArgs),
    }
    group_of = {_C_KERNEL: "dev", _C_MEMCPY: "dev", _C_MEMSET: "dev", _C_SYNC: "dev", _C_RUNTIME: "rt",
                _C_OP: "cpu", _C_ANN: "cpu", _C_PY: "cpu", _C_GPU_ANN: "gpu_ann", _C_INSTANT: "instant"}
    defaults = {"name": (str, ""), "tid": (Any, 0), "ts": (float, 0.0), "dur": (float, -1.0)}
    types, code_of = [], {}
    for k, (cat, code) in enumerate(list(_CAT_CODE.items()) + [(c, 0) for c in _SKIP_CATS]):
        fields = []
        if code:
            *plain, args_type = fields_of[group_of[code]]
            fields = [(f, *defaults[f]) for f in plain] + [("args", args_type, args_type())]
        t = msgspec.defstruct(f"Cat{k}", fields, tag_field="cat", tag=cat, forbid_unknown_fields=False, gc=False)
        types.append(t)
        code_of[t] = code
    return msgspec.json.Decoder(list[reduce(or_, types)]).decode, code_of


_decode_tagged, _CODE_OF_TYPE = _tagged_union()
_g_cat, _g_name, _g_tid, _g_ts, _g_dur, _g_args = (attrgetter(k) for k in ("cat", "name", "tid", "ts", "dur", "args"))
_g_stream, _g_corr, _g_ext, _g_ext_old, _g_flops, _g_bytes, _g_ev, _g_coll = (
    attrgetter(k) for k in ("stream", "correlation", "external_id", "external_id_old", "flops", "bytes", "ev_idx",
                            "coll_name"))


_decode_events = msgspec.json.Decoder(list[Event]).decode
_decode_any = msgspec.json.Decoder().decode


class _Decoder:
    """Decodes chunks on the tagged fast path, falling back to `Event` per chunk; after a
    few fallbacks in a row (a trace of unusual categories) it stays on `Event`."""

    def __init__(self):
        self.misses = 0

    def __call__(self, data) -> tuple[list, np.ndarray]:
        """Events of one JSON array and their category codes (0: not read)."""
        if self.misses < 3:
            try:
                events = _decode_tagged(data)
            except msgspec.ValidationError:  # not a DecodeError: those mean "cut inside a string"
                self.misses += 1
            else:
                self.misses = 0
                n = len(events)
                return events, np.fromiter(map(_CODE_OF_TYPE.__getitem__, map(type, events)), np.int8, n)
        events = _decode_events(data)
        n = len(events)
        return events, np.fromiter(map(_CAT_CODE.get, map(_g_cat, events), repeat(0, n)), np.int8, n)


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
    # Collective parameters, per row of cpu (key ("cpu", i)) or device (("dev", i)).
    coll_args: dict[tuple[str, int], dict] = field(default_factory=dict)
    peak_allocated: dict[int, float] = field(default_factory=dict)  # device id -> bytes
    n_events: int = 0
    # Share of the profiler's host events present ("Ev Idx" numbers them consecutively);
    # far below 1 in traces that were sampled or filtered after recording.
    op_coverage: float | None = None

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
        self.shapes: dict[int, tuple[bytes, bytes | None]] = {}
        self.coll: dict[tuple[str, int], dict] = {}
        self.peak: dict[int, float] = {}
        self.n = 0
        self.n_cpu = 0
        self.n_dev = 0
        # Per name id: 0 plain, 1 ProfilerStep, 2 collective, 3 FLOP op.
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
            self._add_device(*_timed(_pick(events, dev_idx), code[dev_idx]))
        if len(rt_idx):
            self._add_runtime(*_timed(_pick(events, rt_idx), None))
        if len(cpu_idx):
            self._add_cpu(*_timed(_pick(events, cpu_idx), code[cpu_idx]))
        for e in _pick(events, np.flatnonzero(code == _C_GPU_ANN)):
            if e.dur >= 0 and "ProfilerStep" in e.name:
                self.gpu_steps.append(e.ts)
        for e in _pick(events, np.flatnonzero(code == _C_INSTANT)):
            a = e.args
            if e.dur < 0 and a.total_allocated is not None and a.device_type not in (0, None):
                d = int(a.device_id or 0)  # device type 0 is the CPU
                self.peak[d] = max(self.peak.get(d, 0.0), float(a.total_allocated))

    def _ids(self, evs, n: int) -> np.ndarray:
        """Name ids; new names are numbered in order of appearance."""
        return _intern(self.names, list(map(_g_name, evs)), n)

    def _add_device(self, evs, code, dur):
        dev = self.dev
        n = len(evs)
        if not n:
            return
        args = list(map(_g_args, evs))
        base = self.n_dev
        dev["name"].append(self._ids(evs, n))
        dev["kind"].append(code - _C_KERNEL)
        dev["ts"].append(np.fromiter(map(_g_ts, evs), np.float64, n))
        dev["dur"].append(dur)
        dev["stream"].append(_int_column(args, n))
        dev["corr"].append(np.fromiter(map(_g_corr, args), np.int64, n))
        dev["bytes"].append(np.fromiter(map(_g_bytes, args), np.float64, n))
        dev["ext"].append(_ext_column(args, n))
        for j in _with_collective(args, n):
            self.coll[("dev", base + j)] = _coll_args(args[j])
        self.n_dev += n

    def _add_runtime(self, evs, _code, dur):
        rt = self.rt
        n = len(evs)
        if not n:
            return
        args = list(map(_g_args, evs))
        rt["name"].append(self._ids(evs, n))
        rt["ts"].append(np.fromiter(map(_g_ts, evs), np.float64, n))
        rt["dur"].append(dur)
        rt["corr"].append(np.fromiter(map(_g_corr, args), np.int64, n))
        # HIP writes the stream as "0x0", which (like HTA) is not read as a device stream.
        rt["stream"].append(_int_column(args, n))

    def _add_cpu(self, evs, code, dur):
        cpu = self.cpu
        n = len(evs)
        if not n:
            return
        base = self.n_cpu
        ids = self._ids(evs, n)
        args = list(map(_g_args, evs))
        cpu["name"].append(ids)
        cpu["kind"].append(code - _C_OP)
        cpu["ts"].append(np.fromiter(map(_g_ts, evs), np.float64, n))
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
        extra = set(np.flatnonzero(kinds).tolist())
        extra.update(np.flatnonzero(~np.isnan(flops)).tolist())
        extra.update(_with_collective(args, n))
        for j in sorted(extra):
            kind = int(kinds[j])
            a = args[j]
            if kind == 1:
                m = _STEP_RE.match(evs[j].name)
                if m:
                    self.steps.append((int(m.group(1)), evs[j].ts, float(dur[j])))
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
            "steps": self.steps, "gpu_steps": self.gpu_steps, "shapes": self.shapes, "coll": self.coll,
            "peak": self.peak, "ev_idx": self.ev_idx, "n": self.n, "n_dev": self.n_dev, "n_cpu": self.n_cpu,
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

    def _name_list(self) -> list[str]:
        if len(self._names_cache) != len(self.names):
            self._names_cache = list(self.names)  # dict keys in insertion order = id order
        return self._names_cache

    def build(self, source: str, meta: dict) -> Trace:
        f8, i8 = np.float64, np.int64
        d, r, c = self.dev, self.rt, self.cpu
        names = [""] * len(self.names)
        for s, i in self.names.items():
            names[i] = s
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
            coll_args=self.coll,
            peak_allocated=self.peak,
            n_events=self.n,
            op_coverage=_coverage(self.ev_idx),
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
    values = [v for p in parts for v in (p.tolist() if isinstance(p, np.ndarray) else p)]
    return _intern({}, values, len(values))


def _timed(evs: list, code):
    """The complete ("X") events of a group, their codes and durations: events without a
    duration (instant, flow) are dropped."""
    n = len(evs)
    dur = np.fromiter(map(_g_dur, evs), np.float64, n)
    keep = dur >= 0
    if keep.all():
        return evs, code, dur
    idx = np.flatnonzero(keep)
    return _pick(evs, idx), (code[idx] if code is not None else None), dur[idx]


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
    except (TypeError, ValueError):
        return np.fromiter((v if type(v) is int else _int_or(v) for v in map(_g_stream, args)), np.int64, n)


def _ext_column(args: list, n: int) -> np.ndarray:
    """External id (current schema), else "external id" (2021 schema), else -1."""
    new = np.fromiter(map(_g_ext, args), np.int64, n)
    missing = np.flatnonzero(new < 0)
    if len(missing):
        new[missing] = np.fromiter(map(_g_ext_old, _pick(args, missing)), np.int64, len(missing))
    return new


def _int_or(v, default: int = -1) -> int:
    if type(v) is int:
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _special_kind(name: str) -> int:
    if name.startswith("ProfilerStep"):
        return 1
    if _is_comm_host(name):
        return 2
    if name in FLOP_OPS:
        return 3
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


# --- reading --------------------------------------------------------------------------


def _blocks(path: str):
    """Decompressed byte blocks of a .json or .json.gz file (gzip detected by magic)."""
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        if head != b"\x1f\x8b":
            while True:
                b = f.read(READ_BYTES)
                if not b:
                    return
                yield b
        if _GzipReader is not None:
            yield from _reader_blocks(f, path)
            return
        d = _inflate.decompressobj(16 + zlib.MAX_WBITS)
        while True:
            b = f.read(READ_BYTES)
            if not b:
                break
            try:
                out = d.decompress(b)
                if out:
                    yield out
                while d.eof and d.unused_data:  # concatenated gzip members
                    rest = d.unused_data
                    d = _inflate.decompressobj(16 + zlib.MAX_WBITS)
                    out = d.decompress(rest)
                    if out:
                        yield out
            except _INFLATE_ERRORS as exc:
                raise DiagInputError(f"corrupt gzip data ({exc})", source=path) from None
        if not d.eof:
            raise DiagInputError("truncated gzip file (ended before the end-of-stream marker)", source=path)
        tail = d.flush()
        if tail:
            yield tail


_QUEUE_DEPTH = 3


def _reader_blocks(f, path: str):
    """Blocks inflated into a ring of reused buffers. Each block is a memoryview that stays
    valid while the consumer holds it: the reader thread is at most _QUEUE_DEPTH blocks
    ahead of the block in use, and the ring is longer than that."""
    from gzip import BadGzipFile

    reader = _GzipReader(f, READ_BYTES)
    ring = [memoryview(bytearray(READ_BYTES * 8)) for _ in range(_QUEUE_DEPTH + 3)]
    k = 0
    while True:
        out = ring[k % len(ring)]
        k += 1
        try:
            n = reader.readinto(out)
        except EOFError:
            raise DiagInputError("truncated gzip file (ended before the end-of-stream marker)", source=path) from None
        except (BadGzipFile, *_INFLATE_ERRORS) as exc:
            raise DiagInputError(f"corrupt gzip data ({exc})", source=path) from None
        if not n:
            return
        yield out[:n]


def _threaded(gen, depth: int = _QUEUE_DEPTH):
    """Run a block generator in a thread: zlib releases the GIL, so inflating the next
    block overlaps with decoding this one. Errors are re-raised in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(("b", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as exc:  # forwarded, not swallowed
            q.put(("err", exc))

    t = threading.Thread(target=produce, name="diag-trace-reader", daemon=True)
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "b":
                yield item
            elif kind == "err":
                raise item
            else:
                return
    finally:
        stop.set()
        while not q.empty():
            q.get_nowait()
        t.join(timeout=5)


_KEY_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
_SEP_RE = re.compile(rb"\}\s*,\s*\{")
_END_RE = re.compile(rb"\}?\s*\]")


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
    b = _Builder()
    try:
        b.add(*b.decode(b"".join((b"[", data, b"]"))))
    except msgspec.ValidationError as exc:
        return "error", f"not a Kineto trace: bad event ({exc})"
    except msgspec.DecodeError as exc:
        return "error", f"corrupt JSON in traceEvents ({exc})"
    return "ok", b.export()


class _Parallel:
    """Decodes slices in worker processes and merges the parts into the main builder in order."""

    def __init__(self, workers: int, builder: _Builder, path: str):
        import multiprocessing as mp
        from collections import deque
        from concurrent.futures import ProcessPoolExecutor

        # fork is cheap and safe while this process has a single thread; the reader thread
        # starts only after the workers exist (they are forked at the first submit).
        method = "fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods() else "forkserver"
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method))
        self.pending = deque()
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
        b = _Builder()
        if n > 1:
            try:
                par = _Parallel(n, b, path)
            except (OSError, ValueError, RuntimeError):
                par = None  # no worker processes here (sandbox, limits): decode serially
        blocks = _threaded(_blocks(path))
        return _load(path, blocks, b, par)
    except OSError as exc:
        raise DiagInputError(f"cannot read ({exc.strerror or exc})", source=path) from None
    finally:
        if par is not None:
            par.close()
        if was_enabled:
            gc.enable()


def _load(path: str, blocks, b: _Builder, par: _Parallel | None = None) -> Trace:
    buf = bytearray()
    head = None  # bytes before the traceEvents array
    it = iter(blocks)
    for blk in it:
        buf += blk
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
        if eof:
            break
        blk = next(it, None)
        if blk is None:
            eof = True
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
    meta = _parse_meta(path, head, tail)
    if b.n == 0:
        raise DiagInputError("trace has no events", source=path)
    if b.n_dev == 0 and b.n_cpu == 0:
        raise DiagInputError("trace has no CPU or device activity events", source=path)
    return b.build(path, meta)


_DIRECT_WINDOW = 64 << 10


def _decode_direct(buf: bytearray, blk: bytes, b: _Builder) -> bytearray | None:
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
        events, codes = b.decode(data)
    except msgspec.DecodeError:  # ValidationError included: the general path reports it
        return None
    del data
    b.add(events, codes)
    return bytearray(blk[last.end() - 1:])


def _decode_chunks(path: str, buf: bytearray, b: _Builder, final: bool, par: _Parallel | None = None):
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
        while True:
            m = _SEP_RE.search(buf, pos)
            if m is None:
                if not final:
                    return start, None
                return _decode_last(path, buf, start, b)
            try:
                b.add(*b.decode(_framed(buf, start, m.start() + 1)))
            except msgspec.ValidationError as exc:
                raise DiagInputError(f"not a Kineto trace: bad event ({exc})", source=path) from None
            except msgspec.DecodeError:
                pos = m.end()
                continue
            break
        start = m.end() - 1  # the '{' of the next event


def _framed(buf: bytearray, lo: int, hi: int, close: bool = True) -> bytes:
    """buf[lo:hi] inside brackets, as one JSON array, in a single copy."""
    with memoryview(buf) as mv:
        return b"".join((b"[", mv[lo:hi], b"]" if close else b""))


def _unescaped_quotes(buf, lo: int, hi: int) -> int:
    """Number of string delimiters in buf[lo:hi] (quotes not escaped by a backslash)."""
    n = buf.count(b'"', lo, hi)
    i = buf.find(b'\\"', lo, hi)
    while i >= 0:
        q = i + 1
        k, j = 0, i
        while j >= lo and buf[j] == 0x5C:
            k += 1
            j -= 1
        if k % 2:
            n -= 1
        i = buf.find(b'\\"', q, hi)
    return n


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


def _decode_final(path: str, buf: bytearray, start: int, b: _Builder):
    """The rest of the array: events up to the last real boundary, then the last event."""
    cands = [m.start() + 1 for m in _SEP_RE.finditer(buf, start)]
    for end in reversed(cands):
        try:
            b.add(*b.decode(_framed(buf, start, end)))
        except msgspec.ValidationError as exc:
            raise DiagInputError(f"not a Kineto trace: bad event ({exc})", source=path) from None
        except msgspec.DecodeError:
            continue
        start = end
        while buf[start] in b" \t\r\n,":
            start += 1
        break
    return _decode_last(path, buf, start, b)


def _decode_last(path: str, buf: bytearray, start: int, b: _Builder):
    """The last events and the array's closing bracket; returns the tail's start."""
    for m in _END_RE.finditer(buf, start):
        close = m.end()
        try:
            b.add(*b.decode(_framed(buf, start, close, close=False)))
        except msgspec.ValidationError as exc:
            raise DiagInputError(f"not a Kineto trace: bad event ({exc})", source=path) from None
        except msgspec.DecodeError:
            continue
        return len(buf), close
    raise DiagInputError("truncated or corrupt JSON in traceEvents", source=path)


def _parse_meta(path: str, head: bytes, tail: bytes) -> dict:
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
    try:
        meta = _decode_any(b"{" + b",".join(parts) + b"}")
    except msgspec.DecodeError as exc:
        raise DiagInputError(f"corrupt JSON outside traceEvents ({exc})", source=path) from None
    if not isinstance(meta, dict):
        raise DiagInputError("not a Kineto trace", source=path)
    return meta


def _not_a_trace(path: str, data: bytes):
    s = data.lstrip()
    if not s:
        raise DiagInputError("empty file", source=path)
    try:
        doc = _decode_any(s)
    except msgspec.DecodeError as exc:
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
    """(step, start, end) per ProfilerStep; without steps the whole trace is one window."""
    if trace.steps:
        out = []
        for num, ts, dur in trace.steps:
            out.append((num, ts, ts + dur))
        return out
    lo, hi = [], []
    for ts, dur in ((trace.dev_ts, trace.dev_dur), (trace.cpu_ts, trace.cpu_dur), (trace.rt_ts, trace.rt_dur)):
        if len(ts):
            lo.append(ts.min())
            hi.append((ts + dur).max())
    if not lo:
        return []
    return [(None, float(min(lo)), float(max(hi)))]
