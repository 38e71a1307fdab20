"""The event schema of Kineto traces, as msgspec decodes it.

Category codes group event classes so that one numpy mask selects each group; a tagged
union keyed on "cat" gives each category a struct holding only the keys its columns
need, and flow events (a third of a trace) decode to empty structs. Both trace schemas
(the current one and the 2021 one) map onto the same codes.
"""

from __future__ import annotations

import math
import re
from functools import reduce
from itertools import repeat
from operator import attrgetter, or_
from types import GenericAlias
from typing import Annotated, Any

import msgspec
import numpy as np

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
KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_SYNC = 0, 1, 2, 3
RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver", "Driver"}
# CPU-side events: value is the op kind (0 op, 1 annotation, 2 python function).
CPU_CATS = {"cpu_op": 0, "Operator": 0, "user_annotation": 1, "python_function": 2}

_STEP_RE = re.compile(r"ProfilerStep\s*#\s*(\d+)")


# Integers the columns hold (int64): one outside that range is a damaged field, repaired by
# the tolerant path like any other of the wrong type. Timestamps and durations are finite.
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Finite = Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]


class Args(msgspec.Struct, forbid_unknown_fields=False, frozen=True, gc=False):
    """The few `args` keys diag reads. Missing numbers default to -1 / NaN, so columns are
    filled by C-level map() calls instead of per-event None checks."""

    stream: Any = -1
    correlation: I64 = -1
    external_id: I64 = msgspec.field(default=-1, name="External id")
    external_id_old: I64 = msgspec.field(default=-1, name="external id")
    flops: float = math.nan
    bytes: float = math.nan
    ev_idx: I64 = msgspec.field(default=-1, name="Ev Idx")
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Concrete Inputs")
    # Collectives (record_param_comms, NCCL kernels with parameters).
    coll_name: str | None = msgspec.field(default=None, name="Collective name")
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_id: Any = msgspec.field(default=None, name="Process Group ID")
    pg_desc: str | None = msgspec.field(default=None, name="Process Group Description")
    group_size: I64 | None = msgspec.field(default=None, name="Group size")
    in_nelems: I64 | None = msgspec.field(default=None, name="In msg nelems")
    out_nelems: I64 | None = msgspec.field(default=None, name="Out msg nelems")
    dtype: str | None = None
    seq: Any = msgspec.field(default=None, name="Seq")
    # Memory instant events.
    total_allocated: float | None = msgspec.field(default=None, name="Total Allocated")
    device_type: I64 | None = msgspec.field(default=None, name="Device Type")
    device_id: I64 | None = msgspec.field(default=None, name="Device Id")


NO_ARGS = Args()


class Event(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    # Only what diag reads; "ph" is implied by "dur" (complete events are the timed ones).
    cat: str = ""
    name: str = ""
    tid: Any = 0
    ts: Finite = 0.0
    dur: Finite = -1.0
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
    fields_of: dict[str, tuple[Any, ...]] = {
        "dev": ("name", "ts", "dur", _DevArgs), "rt": ("name", "ts", "dur", _RtArgs),
        "cpu": ("name", "tid", "ts", "dur", _CpuArgs), "gpu_ann": ("name", "ts", "dur", _NoArgs),
        "instant": ("dur", _MemArgs),
    }
    group_of = {_C_KERNEL: "dev", _C_MEMCPY: "dev", _C_MEMSET: "dev", _C_SYNC: "dev", _C_RUNTIME: "rt",
                _C_OP: "cpu", _C_ANN: "cpu", _C_PY: "cpu", _C_GPU_ANN: "gpu_ann", _C_INSTANT: "instant"}
    defaults: dict[str, tuple[Any, Any]] = {"name": (str, ""), "tid": (Any, 0), "ts": (Finite, 0.0), "dur": (Finite, -1.0)}
    types, code_of = [], {}
    for k, (cat, code) in enumerate(list(_CAT_CODE.items()) + [(c, 0) for c in _SKIP_CATS]):
        fields: list[tuple[str, Any, Any]] = []
        if code:
            *plain, args_type = fields_of[group_of[code]]
            fields = [(f, *defaults[f]) for f in plain] + [("args", args_type, args_type())]
        t = msgspec.defstruct(f"Cat{k}", fields, tag_field="cat", tag=cat, forbid_unknown_fields=False, gc=False)
        types.append(t)
        code_of[t] = code
    return msgspec.json.Decoder(GenericAlias(list, (reduce(or_, types),))).decode, code_of


_decode_tagged, _CODE_OF_TYPE = _tagged_union()
_g_cat, _g_name, _g_tid, _g_ts, _g_dur, _g_args = (attrgetter(k) for k in ("cat", "name", "tid", "ts", "dur", "args"))
_g_stream, _g_corr, _g_ext, _g_ext_old, _g_flops, _g_bytes, _g_ev, _g_coll = (
    attrgetter(k) for k in ("stream", "correlation", "external_id", "external_id_old", "flops", "bytes", "ev_idx",
                            "coll_name"))


_decode_events = msgspec.json.Decoder(list[Event]).decode
_decode_any = msgspec.json.Decoder().decode
# msgspec decodes nested values recursively: JSON nested deeper than the interpreter's
# recursion limit (1,000 by default, less the caller's frames) is refused with this.
TOO_DEEP = "JSON is malformed: nested too deep"


class _Decoder:
    """Decodes chunks on the tagged fast path, falling back to `Event` per chunk; after a
    few fallbacks in a row (a trace of unusual categories) it stays on `Event`. A chunk
    that `Event` rejects too (a field of an unexpected type) is decoded field by field by
    `diag.analyzers.trace.tolerant`, which counts what it changed in `repairs`."""

    def __init__(self):
        self.misses = 0
        self.seen = 0  # events decoded so far: the index of the next chunk's first event
        self.repairs = None  # a tolerant.Repairs once a chunk needed one

    def log(self):
        """The repair log, created at the first repair."""
        if self.repairs is None:
            from diag.analyzers.trace.tolerant import Repairs

            self.repairs = Repairs()
        return self.repairs

    def repairs_done(self) -> dict | None:
        """What was repaired, as plain data; None when nothing was."""
        return self.repairs.export() if self.repairs is not None else None

    def __call__(self, data) -> tuple[list, np.ndarray]:
        """Events of one JSON array and their category codes (0: not read)."""
        try:
            return self._decode(data)
        except UnicodeDecodeError:  # a damaged string: the same as any other damage
            raise msgspec.DecodeError("JSON is malformed: invalid UTF-8") from None
        except RecursionError:  # nesting no event has: damage, like any other
            raise msgspec.DecodeError(TOO_DEEP) from None

    def _decode(self, data) -> tuple[list, np.ndarray]:
        if self.misses < 3:
            try:
                events = _decode_tagged(data)
            except msgspec.ValidationError:  # not a DecodeError: those mean "cut inside a string"
                self.misses += 1
            else:
                self.misses = 0
                n = len(events)
                self.seen += n
                return events, np.fromiter(map(_CODE_OF_TYPE.__getitem__, map(type, events)), np.int8, n)
        try:
            events = _decode_events(data)
        except msgspec.ValidationError:
            from diag.analyzers.trace import tolerant

            events = tolerant.decode_tolerant(data, self.seen, self.log())
        n = len(events)
        self.seen += n
        return events, np.fromiter(map(_CAT_CODE.get, map(_g_cat, events), repeat(0, n)), np.int8, n)


