"""GPU-time breakdown with HolisticTraceAnalysis (HTA 0.5.0) definitions, for cross-checking.

HTA's definitions, restated (no HTA code is used):
- Device events are trace events with an integer `args.stream` >= 0 and a `correlation`
  >= 0 (kernels, memcpy, memset; a HIP runtime call whose stream is "0x0" is not one).
- Window: when the trace holds at least two distinct ProfilerStep names, only device
  events launched by a host event (matched by correlation id) that started before the
  last ProfilerStep started are kept; the ProfilerStep events considered are all
  non-device events whose name contains "ProfilerStep" (GPU-side annotations included).
  There is no lower bound: work launched before the first step counts. With fewer than
  two steps the whole trace is used.
- Kernel types: communication = name matches `^nccl.*Kernel` (so both ncclKernel_* and
  ncclDevKernel_*); memory = `^Memcpy`, `^Memset` or `^dma`; computation = none of
  `^nccl.*Kernel`, `.*Memcpy`, `^Memset`, `.*Sync`; anything else is "other".
- Over the span from the first kept device event's start to the last one's end:
  idle = span - union(all), compute = union(computation), non-compute = the rest.
- Comm/compute overlap = |union(comp) ∩ union(comm)| / |union(comm)|.
- Kernel-type split: exclusive time of each combination of COMP, COMM, MEM (other
  kernels excluded), as a share of their union.
All interval arithmetic goes through `diag.analyzers.intervals`.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.load import Trace

_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEM = re.compile(r"^(?:Memcpy|Memset|dma)")
_HTA_NOT_COMPUTE = re.compile(r"^(?:nccl.*Kernel|.*Memcpy|Memset|.*Sync)")
COMP, COMM, MEM, OTHER = "COMP", "COMM", "MEM", "OTHER"


def hta_kernel_type(name: str) -> str:
    if _HTA_COMM.match(name):
        return COMM
    if _HTA_MEM.match(name):
        return MEM
    if not _HTA_NOT_COMPUTE.match(name):
        return COMP
    return OTHER


def hta_device_mask(trace: Trace) -> np.ndarray:
    """Device events HTA analyses: in its window and with stream/correlation ids."""
    mask = (trace.dev_stream >= 0) & (trace.dev_corr >= 0)
    step_names = {s[0] for s in trace.steps}
    starts = [s[1] for s in trace.steps] + trace.gpu_step_ts.tolist()
    if len(step_names) >= 2 and starts:
        last_start = max(starts)
        launched = np.sort(trace.rt_corr[(trace.rt_ts < last_start) & (trace.rt_corr >= 0)])
        mask &= _member(trace.dev_corr, launched)
    return mask


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """values in sorted_set, by binary search (np.isin hashes, which is slower here)."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    k = np.clip(np.searchsorted(sorted_set, values), 0, len(sorted_set) - 1)
    return sorted_set[k] == values


def _fractional(trace: Trace) -> bool:
    """HTA's parser sees float timestamps (and rounds them) when any ts has a fraction."""
    return any(bool(len(a)) and bool(np.any(a != np.floor(a))) for a in (trace.dev_ts, trace.rt_ts, trace.cpu_ts))


def _types(trace: Trace, sel: np.ndarray) -> np.ndarray:
    per_name = np.array([hta_kernel_type(n) for n in trace.names], dtype=object)
    return per_name[trace.dev_name[sel]] if len(trace.names) else np.zeros(0, dtype=object)


def breakdown(trace: Trace) -> dict | None:
    """{"idle_pct", "compute_pct", "non_compute_pct", "comm_compute_overlap_pct",
    "kernel_type_split", "span_us"}; None when the trace has no device events."""
    sel = np.flatnonzero(hta_device_mask(trace))
    # Device events on a runtime row (HTA counts them too when they carry a stream).
    rsel = np.flatnonzero((trace.rt_stream >= 0) & (trace.rt_corr >= 0))
    if not len(sel) and not len(rsel):
        return None
    ts = np.r_[trace.dev_ts[sel], trace.rt_ts[rsel]]
    end = ts + np.r_[trace.dev_dur[sel], trace.rt_dur[rsel]]
    if _fractional(trace):
        # HTA rounds sub-microsecond timestamps inwards: start up, end down.
        ts, end = np.ceil(ts), np.floor(end)
    types = np.r_[_types(trace, sel), np.array([hta_kernel_type(trace.names[i]) for i in trace.rt_name[rsel]],
                                                dtype=object)]
    every = iv.from_arrays(ts, end)
    if not len(every):
        return None
    span = float(every[-1, 1] - every[0, 0])
    comp = iv.from_arrays(ts[types == COMP], end[types == COMP])
    comm = iv.from_arrays(ts[types == COMM], end[types == COMM])
    mem = iv.from_arrays(ts[types == MEM], end[types == MEM])
    busy = iv.total(every)
    compute = iv.total(comp)
    comm_total = iv.total(comm)
    comp_comm = iv.intersect(comp, comm)
    overlap = iv.total(comp_comm)
    pct = (lambda x: round(100.0 * x / span, 2)) if span > 0 else (lambda x: 0.0)
    return {
        "idle_pct": pct(span - busy),
        "compute_pct": pct(compute),
        "non_compute_pct": pct(busy - compute),
        "comm_compute_overlap_pct": round(100.0 * overlap / comm_total, 2) if comm_total > 0 else None,
        "kernel_type_split": _split(comp, comm, mem, comp_comm),
        "span_us": span,
        "definition": "HTA 0.5.0",
    }


def _split(comp, comm, mem, comp_comm=None) -> dict:
    """Exclusive time of each combination of COMP/COMM/MEM as % of their union.

    Each part is built from two-set differences and intersections (nine sweeps, the
    memory set being the small one); the parts are the same sets whichever way they are
    combined, so the figures do not depend on the order of operations.
    """
    comp_or_comm = iv.union(comp, comm)
    total = iv.total(iv.union(comp_or_comm, mem))
    if total <= 0:
        return {}
    both = iv.intersect(comp, comm) if comp_comm is None else comp_comm
    comp_only = iv.subtract(comp, comm)
    comm_only = iv.subtract(comm, comp)
    parts = [
        (COMP, iv.subtract(comp_only, mem)),
        (COMM, iv.subtract(comm_only, mem)),
        (f"{COMP}∩{COMM}", iv.subtract(both, mem)),
        (MEM, iv.subtract(mem, comp_or_comm)),
        (f"{COMP}∩{MEM}", iv.intersect(comp_only, mem)),
        (f"{COMM}∩{MEM}", iv.intersect(comm_only, mem)),
        (f"{COMP}∩{COMM}∩{MEM}", iv.intersect(both, mem)),
    ]
    out = {}
    for name, part in parts:
        t = iv.total(part)
        if t > 0:
            out[name] = round(100.0 * t / total, 1)
    return out
