"""A trace's attributed timeline: each event's class (compute, bandwidth-bound, comm, ...),
the priority-ordered layers every microsecond of a step is given to (`attribution`), the
FLOP-carrying ops and their rates, and each step's record with the tree's measurements.
What `analysis.facts_of_loaded` reads its facts from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.analysis_types import TraceStepFacts
from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace import roofline
from diag.analyzers.trace.attribution import (
    BOUNDS,
    CPU_ORDER,
    GPU_ORDER,
    HOST_OVERHEAD_US,
    attribute,
    normalize_shares,
)
from diag.analyzers.trace.devices import Device
from diag.analyzers.trace.load import Trace, window_array


@dataclass(frozen=True)
class Timeline:
    """A trace's steps and every event in its class, attributed: what each fact reads."""
    windows: list  # (step number, start µs, end µs)
    win: np.ndarray
    on_device: bool
    device: Device | None
    op_info: Ops
    classes: np.ndarray | None  # each device event's class (None on a CPU timeline)
    layers: dict
    busy: dict
    order: tuple
    att: dict


def attributed_timeline(trace: Trace, windows: list, on_device: bool, device) -> Timeline:
    win = window_array(windows)
    op_info = flop_ops(trace, device)
    if on_device:
        classes = _device_classes(trace, op_info, device)
        layers, busy = _device_layers(trace, classes)
        order = GPU_ORDER
    else:
        classes = None
        layers, busy = _cpu_layers(trace, op_info, device)
        order = CPU_ORDER
    return Timeline(windows, win, on_device, device, op_info, classes, layers, busy, order,
                     attribute(layers, order, win))


@dataclass(frozen=True)
class Rates:
    """Memory-vs-compute device (or CPU) time, work and achieved bandwidth, per window."""
    mem_t: np.ndarray
    comp_t: np.ndarray
    peak_frac: np.ndarray | None
    flops: np.ndarray | None
    bw_bytes: np.ndarray | None
    bw_time: np.ndarray | None

    def measurements(self, shares: dict, k: int | None, dur: float, device) -> dict:
        """The tree's measurements of window `k` (None: of the whole rank, over `dur`)."""
        mem, comp = (self.mem_t.sum(), self.comp_t.sum()) if k is None else (self.mem_t[k], self.comp_t[k])
        return _measurements(shares, mem, comp, dur, self.peak_frac, k, self.bw_bytes, self.bw_time, device)


def window_rates(trace: Trace, tl: Timeline) -> Rates:
    bw_bytes, bw_time = _bandwidth_in_windows(trace, tl.classes, tl.op_info, tl.win) if tl.on_device else (None, None)
    return Rates(iv.measure_in_windows(tl.busy["memory"], tl.win), iv.measure_in_windows(tl.busy["compute"], tl.win),
                  _peak_work_in_windows(trace, tl.op_info, tl.win, tl.device),
                  _flops_in_windows(trace, tl.op_info, tl.win), bw_bytes, bw_time)


def step_records(tl: Timeline, rates: Rates) -> tuple[list[TraceStepFacts], dict, float]:
    """(each traced step's record, the rank's shares, the traced time in µs)."""
    steps: list[TraceStepFacts] = []
    totals = {b: 0.0 for b in BOUNDS}
    for k, (num, lo, hi) in enumerate(tl.windows):
        dur = hi - lo
        shares = tl.att["shares"][k]
        for b in BOUNDS:
            totals[b] += tl.att["us"][b][k]
        steps.append({
            "step": num,
            "start_us": lo,
            "duration_ms": dur / 1e3,
            "shares": shares,
            "evidence": "trace",
            "measurements": rates.measurements(shares, k, dur, tl.device),
            # Executed FLOPs of the step's ops (from their shapes), for measured rates (diag plan --run).
            "flops": float(rates.flops[k]) if rates.flops is not None else None,
        })
    total_time = float(np.sum(tl.win[:, 1] - tl.win[:, 0]))
    return steps, normalize_shares(totals, total_time), total_time


# --- classification ---------------------------------------------------------------------


class Ops:
    """FLOP-carrying CPU ops: rows, FLOPs, bytes, intensity, peak dtype, top-level mask, and
    each op's top-level op (its index)."""

    def __init__(self, rows, flops, nbytes, ai, dtype, top, ext_to_row, owner):
        self.rows, self.flops, self.bytes, self.ai, self.dtype, self.top = rows, flops, nbytes, ai, dtype, top
        self.ext_to_row, self.owner = ext_to_row, owner


def flop_ops(trace: Trace, device) -> Ops:
    """Ops with FLOPs: the trace's "flops" arg where written, else derived from shapes."""
    cand = set(np.flatnonzero(np.isfinite(trace.cpu_flops) & (trace.cpu_flops > 0)).tolist()) | set(trace.shapes)
    rows = np.array(sorted(cand), dtype=np.int64)
    flops = np.full(len(rows), np.nan)
    nbytes = np.full(len(rows), np.nan)
    dtypes = []
    for j, r in enumerate(rows.tolist()):
        f = trace.cpu_flops[r]
        sh = trace.shapes.get(r)
        if sh is None:
            flops[j] = f
            dtypes.append("fp32")
            continue
        name = trace.names[trace.cpu_name[r]]
        dims, types = roofline.parse_shapes(sh[0], sh[1])
        concrete = roofline.parse_shapes(sh[2], None)[0] if len(sh) > 2 and sh[2] else []
        est = roofline.estimate_flops(name, dims, concrete)
        out_numel = None
        if est is not None:
            out_numel = est[1]
            if not (np.isfinite(f) and f > 0):
                f = est[0]
        flops[j] = f
        b = roofline.op_bytes(name, dims, types, out_numel)
        nbytes[j] = b if b else np.nan
        dtypes.append(roofline.op_dtype(types))
    keep = np.isfinite(flops) & (flops > 0)
    rows, flops, nbytes = rows[keep], flops[keep], nbytes[keep]
    dtypes = [d for d, k in zip(dtypes, keep.tolist()) if k]
    with np.errstate(divide="ignore", invalid="ignore"):
        ai = flops / nbytes
    # Top-level FLOP ops: not nested inside another FLOP op of the same thread (no double count).
    # Each op's top-level op (itself where it is one): the op a matmul inside a linear counts for.
    top = np.ones(len(rows), dtype=bool)
    owner = np.arange(len(rows), dtype=np.int64)
    if len(rows) > 1:
        ts, end, tid = trace.cpu_ts[rows], trace.cpu_ts[rows] + trace.cpu_dur[rows], trace.cpu_tid[rows]
        order = np.lexsort((-(end - ts), ts, tid))
        reach_start, reach_end, reach_tid, reach = -np.inf, -np.inf, -1, -1
        for o in order.tolist():
            if tid[o] == reach_tid and end[o] <= reach_end and ts[o] >= reach_start:
                top[o] = False
                owner[o] = reach
                continue
            reach_start, reach_end, reach_tid, reach = ts[o], end[o], tid[o], o
    ext = trace.cpu_ext[rows]
    ext_to_row = {int(e): j for j, e in enumerate(ext.tolist()) if e >= 0}
    return Ops(rows, flops, nbytes, ai, dtypes, top, ext_to_row, owner)


def _device_classes(trace: Trace, ops: Ops, device) -> np.ndarray:
    cls = ec.device_classes(trace.names, trace.dev_name, trace.dev_kind)
    if device is None or not len(ops.rows):
        return cls
    # Roofline: kernels launched by an op with known intensity follow the knee, not the name.
    work = np.flatnonzero((cls == ec.COMPUTE) | (cls == ec.BANDWIDTH))
    for i in work.tolist():
        j = ops.ext_to_row.get(int(trace.dev_ext[i]))
        if j is None or not np.isfinite(ops.ai[j]):
            continue
        hit = roofline.is_compute_bound(float(ops.ai[j]), device.knee(ops.dtype[j]))
        if hit is not None:
            cls[i] = ec.COMPUTE if hit else ec.BANDWIDTH
    return cls


def _device_layers(trace: Trace, cls: np.ndarray):
    ts, end = trace.dev_ts, trace.dev_ts + trace.dev_dur

    def layer(mask):
        return iv.from_arrays(ts[mask], end[mask])

    compute = layer(cls == ec.COMPUTE)
    memory = layer((cls == ec.BANDWIDTH) | (cls == ec.MEMCPY))
    comm = layer(cls == ec.COMM)
    data = _data_spans(trace)
    return ({"compute": compute, "memory": memory, "comm": comm, "data": data},
            {"compute": compute, "memory": memory})


def name_mask(trace: Trace, ids: np.ndarray, pred) -> np.ndarray:
    per_name = np.array([bool(pred(n)) for n in trace.names], dtype=bool) if trace.names else np.zeros(0, bool)
    return per_name[ids] if len(ids) else np.zeros(0, dtype=bool)


def _data_spans(trace: Trace) -> np.ndarray:
    m = name_mask(trace, trace.cpu_name, ec.is_data_annotation)
    return iv.from_arrays(trace.cpu_ts[m], trace.cpu_ts[m] + trace.cpu_dur[m])


def _cpu_layers(trace: Trace, ops: Ops, device):
    """Layers of a CPU-only trace: the host's own ops are the execution timeline."""
    names = trace.names
    per_name = np.array([ec.cpu_op_class(n) for n in names], dtype=object) if names else np.zeros(0, object)
    cls = per_name[trace.cpu_name] if len(trace.cpu_name) else np.zeros(0, object)
    is_op = trace.cpu_kind != 2  # python functions never execute work themselves
    ts, end = trace.cpu_ts, trace.cpu_ts + trace.cpu_dur
    # Roofline overrides the name for ops with recorded FLOPs and shapes.
    if device is not None and len(ops.rows):
        cls = cls.copy()
        for j, r in enumerate(ops.rows.tolist()):
            if np.isfinite(ops.ai[j]) and cls[r] in (ec.CPU_COMPUTE, ec.CPU_MEMORY):
                hit = roofline.is_compute_bound(float(ops.ai[j]), device.knee(ops.dtype[j]))
                if hit is not None:
                    cls[r] = ec.CPU_COMPUTE if hit else ec.CPU_MEMORY
    big = trace.cpu_dur >= HOST_OVERHEAD_US
    compute_m = is_op & (cls == ec.CPU_COMPUTE) & big
    # Spans at any nesting level: an elementwise op's own children (scalar wrapping,
    # allocation) are part of its cost; a matmul nested inside still wins by priority.
    memory_m = is_op & (cls == ec.CPU_MEMORY) & big
    comm_m = is_op & (cls == ec.CPU_COMM)
    data_m = cls == ec.CPU_DATA
    layers = {
        "data": iv.from_arrays(ts[data_m], end[data_m]),
        "compute": iv.from_arrays(ts[compute_m], end[compute_m]),
        "memory": iv.from_arrays(ts[memory_m], end[memory_m]),
        "comm": iv.from_arrays(ts[comm_m], end[comm_m]),
    }
    return layers, {"compute": layers["compute"], "memory": layers["memory"]}


# --- measurements ------------------------------------------------------------------------


def _measurements(shares, mem_t, comp_t, dur, peak_frac_w, k, bw_bytes, bw_time, device) -> dict:
    m = {f"{b}_share": shares[b] for b in BOUNDS}
    if comp_t > 0:
        m["memory_to_compute"] = float(mem_t / comp_t)
    elif mem_t > 0:
        m["memory_to_compute"] = float("inf")
    if peak_frac_w is not None and dur > 0:
        v = peak_frac_w[k] if k is not None else peak_frac_w.sum()
        if v > 0:
            m["mfu"] = float(v / dur)
    if bw_bytes is not None and device is not None and device.mem_bw:
        b = bw_bytes[k] if k is not None else bw_bytes.sum()
        t = bw_time[k] if k is not None else bw_time.sum()
        if t > 0 and b > 0:
            m["achieved_bw_frac"] = float(b / (t * 1e-6) / device.mem_bw)
    return m


def _peak_work_in_windows(trace: Trace, ops: Ops, win: np.ndarray, device):
    """Per window: microseconds the ops' FLOPs would take at the device's peak for their dtype.

    Divided by the window's length this is the MFU. Only top-level FLOP ops count, so a
    linear layer is not counted again through the addmm inside it.
    """
    if device is None or not len(ops.rows):
        return None
    rows = ops.rows[ops.top]
    if not len(rows):
        return None
    peaks = np.array([device.peak_flops(d) or np.nan for d in np.asarray(ops.dtype, dtype=object)[ops.top]])
    out = _sum_in_windows(trace, rows, ops.flops[ops.top] / peaks * 1e6, win)
    return out if np.any(out > 0) else None


def _flops_in_windows(trace: Trace, ops: Ops, win: np.ndarray) -> np.ndarray | None:
    """FLOPs of the top-level FLOP ops that start in each window (None when no op has any)."""
    if not len(ops.rows) or not ops.top.any():
        return None
    return _sum_in_windows(trace, ops.rows[ops.top], ops.flops[ops.top], win)


def _sum_in_windows(trace: Trace, rows: np.ndarray, values: np.ndarray, win: np.ndarray) -> np.ndarray:
    k = trace.step_of("cpu", win)[rows]
    ok = (k >= 0) & np.isfinite(values)
    return np.bincount(k[ok], weights=values[ok], minlength=len(win)).astype(np.float64)


def _bandwidth_in_windows(trace: Trace, cls: np.ndarray, ops: Ops, win: np.ndarray):
    """Bytes and time of bandwidth-bound device work whose bytes are known, per window."""
    nbytes = trace.dev_bytes.copy()
    if len(ops.rows):
        for i in np.flatnonzero(cls == ec.BANDWIDTH).tolist():
            j = ops.ext_to_row.get(int(trace.dev_ext[i]))
            if j is not None and np.isfinite(ops.bytes[j]):
                nbytes[i] = ops.bytes[j]
    known = np.isfinite(nbytes) & ((cls == ec.BANDWIDTH) | (cls == ec.MEMCPY)) & (trace.dev_dur > 0)
    if not known.any():
        return None, None
    dur, b = trace.dev_dur[known], nbytes[known]
    k = trace.step_of("dev", win)[known]
    ok = k >= 0
    bb = np.bincount(k[ok], weights=b[ok], minlength=len(win))
    tt = np.bincount(k[ok], weights=dur[ok], minlength=len(win))
    return bb, tt
