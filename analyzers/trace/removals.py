"""What each cause's change removes from its part of the step, window by window.

A cause's what-if (a `remove` entry of the decision tree's [[what_if]] table) takes away
exactly the time its cause costs: the replay (`diag.analyzers.whatif.rank`) scales the part
that time lies in so that this much of it is gone, step by step, and the graph then says what
that is worth to the step. Each measure here is (part, µs removed per window, µs of that
part per window), the part's total counted as the replay counts it: device ops' durations on
a device timeline, the exclusively attributed time on a CPU one. Pure.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.analysis_types import ALL_REDUCE_RE, PAGEABLE_HTOD_RE, SYNC_OP_NAMES
from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace import host_device
from diag.analyzers.trace import python_gaps as py_gaps
from diag.analyzers.trace.columns import Trace

# A device op's class, as the replay's parts group them (whatif.graph.DEV_CLASS).
_DEVICE_PART = {"comm": (ec.COMM,), "memory": (ec.MEMCPY, ec.BANDWIDTH), "compute": (ec.COMPUTE, ec.OTHER)}
LOOP_GAP_OPS = 2.0  # a gap between two sync ops up to this many times the longer is a loop's body
COMPRESSED_BYTES = 0.5  # the bf16 compression hook sends fp32 gradients in half the bytes


def _device_part_us(trace: Trace, win: np.ndarray, classes: np.ndarray, part: str) -> np.ndarray:
    k = trace.step_of("dev", win)
    sel = (k >= 0) & np.isin(classes, _DEVICE_PART[part])
    return np.bincount(k[sel], weights=trace.dev_dur[sel], minlength=len(win))


def _part_us(trace, win, classes, att, layers, part: str) -> np.ndarray:
    if classes is not None:
        return _device_part_us(trace, win, classes, part)
    if part == "comm":  # the CPU chain scales all communication, hidden or not
        return iv.measure_in_windows(layers.get("comm", iv.EMPTY), win)
    return np.asarray(att["us"][part], dtype=np.float64)


def _value_loops(spans: np.ndarray, launches: np.ndarray) -> np.ndarray:
    """The sync ops' spans (sorted, disjoint) with each run of them that is one loop over values
    merged into one span: consecutive ops with no kernel launched between them and a gap of at
    most LOOP_GAP_OPS times the longer op (the loop's body: indexing the next value, Python).
    Keeping the values on the device removes the whole loop, body and all."""
    if len(spans) < 2:
        return spans
    gap_lo, gap_hi = spans[:-1, 1], spans[1:, 0]
    longer = np.maximum(spans[:-1, 1] - spans[:-1, 0], spans[1:, 1] - spans[1:, 0])
    launched = np.searchsorted(launches, gap_hi) > np.searchsorted(launches, gap_lo, side="right")
    joined = (gap_hi - gap_lo <= LOOP_GAP_OPS * longer) & ~launched
    first = np.concatenate([[True], ~joined])  # where a loop starts
    starts = spans[first, 0]
    ends = spans[np.concatenate([~joined, [True]]), 1]
    return iv.from_arrays(starts, ends)


def _sync_ops_host_us(trace: Trace, win: np.ndarray, att, calls_kept: bool = False) -> np.ndarray:
    """The host time attributed inside the ops that pull values to the host (their own and
    their children's, where it is host time), and on a device inside the loops over values they
    form (_value_loops), per step: each counts in the step whose host span holds it. With
    `calls_kept`, less the runtime calls' own time, which a step's graph holds apart from its
    host gaps."""
    ids = [i for i, name in enumerate(trace.names) if name in SYNC_OP_NAMES]
    sel = (trace.cpu_kind == 0) & np.isin(trace.cpu_name, ids)
    spans = iv.from_arrays(trace.cpu_ts[sel], trace.cpu_ts[sel] + trace.cpu_dur[sel])
    if calls_kept and len(spans):
        launch = host_device.launch_mask(trace)
        spans = _value_loops(spans, np.sort(trace.rt_ts[launch]))
    host = iv.intersect(spans, att["parts"].get("host", iv.EMPTY))
    if calls_kept and len(trace.rt_ts):
        host = iv.subtract(host, iv.from_arrays(trace.rt_ts, trace.rt_ts + trace.rt_dur))
    if not len(spans):
        return np.zeros(len(win))
    step = iv.window_of(spans[:, 0], trace.host_spans(win))
    per_span = iv.measure_in_windows(host, spans)
    ok = step >= 0
    return np.bincount(step[ok], weights=per_span[ok], minlength=len(win)).astype(np.float64)


def _pageable_copies_us(trace: Trace, win: np.ndarray) -> np.ndarray:
    """Per window, the device time of the host-to-device copies from pageable memory."""
    ids = [i for i, name in enumerate(trace.names) if PAGEABLE_HTOD_RE.search(name)]
    k = trace.step_of("dev", win)
    sel = (k >= 0) & np.isin(trace.dev_name, ids) if ids else np.zeros(len(k), bool)
    return np.bincount(k[sel], weights=trace.dev_dur[sel], minlength=len(win)).astype(np.float64)


def _top_collective_us(records: list[dict], win: np.ndarray, name_re: re.Pattern | None = None
                       ) -> np.ndarray | None:
    """Per window, the duration of the collective (name, process group) exposing the most time,
    of those whose name `name_re` matches where given."""
    exposed: dict[tuple, float] = {}
    for r in records:
        if name_re is not None and not name_re.search(str(r["name"])):
            continue
        exposed[(r["name"], r.get("pg"))] = exposed.get((r["name"], r.get("pg")), 0.0) + sum(
            b - a for a, b in r.get("exposed") or [] if b > a)
    if not exposed:
        return None
    top = max(exposed, key=exposed.__getitem__)
    mine = [r for r in records if (r["name"], r.get("pg")) == top]
    k = iv.window_of(np.array([r["ts_us"] for r in mine], dtype=np.float64), win)
    dur = np.array([float(r.get("dur_us") or 0.0) for r in mine])
    return np.bincount(k[k >= 0], weights=dur[k >= 0], minlength=len(win))


def per_window(trace: Trace, win: np.ndarray, classes, att, layers, chain_saving, math_saving,
               collectives: list[dict], matrix_saving=None, traffic_saving=None, host_calls: bool = True,
               cpu_work_coverage: float = 1.0, python_gaps: np.ndarray = iv.EMPTY,
               redundant_reduce: np.ndarray | None = None) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    """{measure: (part, µs removed, µs of the part)} per window, for the measures this trace
    gives (the CPU work's, the Python gaps' and the allocator calls' only where `host_calls`;
    the CPU work's only on traces holding `cpu_work_coverage` of the host events; the gaps
    are the stretches python_gaps.python_gaps found; `redundant_reduce` the share of each
    window's gradient all-reduces that no_sync() would leave out, accumulation.redundant_share)."""
    out = {}

    def add(name: str, part: str, removed) -> None:
        if removed is not None and np.any(removed > 0):
            out[name] = (part, np.asarray(removed, dtype=np.float64), _part_us(trace, win, classes, att, layers, part))

    add("elementwise_chain", "memory", chain_saving)
    add("fp32_math", "compute", math_saving)
    add("half_precision_matrix_ops", "compute", matrix_saving)
    add("slow_bandwidth_kernels", "memory", traffic_saving)
    if classes is None:
        add("host_sync_points", "host", _sync_ops_host_us(trace, win, att))
    else:
        # On a device an op that pulls a value costs its waits, which the graph's edges hold,
        # and the host's time around its calls while the device idles, removed here. That host
        # time lies between the chain's calls, which only each step's graph totals.
        removed = _sync_ops_host_us(trace, win, att, calls_kept=True)
        if np.any(removed > 0):
            out["host_sync_points"] = ("host", removed, None)
    if classes is not None and host_calls:  # both lie in the host's time between the chain's calls
        rows, host_us, after_us = host_device.cpu_work_ops(trace, win, cpu_work_coverage,
                                                           att["parts"].get("host", iv.EMPTY))
        k = trace.step_of("cpu", win)[rows]
        removed = np.bincount(k[k >= 0], weights=(host_us + after_us)[k >= 0], minlength=len(win)).astype(np.float64)
        if np.any(removed > 0):
            out["cpu_work"] = ("host", removed, None)
        removed = py_gaps.gap_us_per_window(trace, win, python_gaps)
        if np.any(removed > 0):
            out["python_gaps"] = ("host", removed, None)
        alloc = np.flatnonzero(host_device.allocator_mask(trace))
        k = trace.step_of("rt", win)[alloc]
        removed = np.bincount(k[k >= 0], weights=trace.rt_dur[alloc][k >= 0], minlength=len(win))
        if np.any(removed > 0):
            out["allocator_calls"] = ("host", removed, None)
    if classes is not None:
        add("pageable_copies", "memory", _pageable_copies_us(trace, win))
    top = _top_collective_us(collectives, win)
    add("exposed_collective", "comm", None if top is None else COMPRESSED_BYTES * top)
    if redundant_reduce is not None:
        reduce = _top_collective_us(collectives, win, ALL_REDUCE_RE)
        add("accumulated_all_reduce", "comm", None if reduce is None else redundant_reduce * reduce)
    return out
