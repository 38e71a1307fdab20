"""The dependency graph of a GPU trace's steps, as arrays (after Daydream, USENIX ATC 2020).

One graph per profiled step (its ProfilerStep window on the host):
- the **host chain**: the runtime calls that launch device work or wait for it, in time
  order, and the gaps between them (the host's own work: Python, framework, data
  loading). Polling calls (cudaEventQuery, cudaStreamQuery) are left out: other threads
  (the NCCL watchdog) issue them, and they neither launch nor wait;
- the **device nodes**: kernels, copies and sets launched by the chain's calls (matched
  by correlation id), each after its stream predecessor, its launch call, and where
  neither explains its start, the device op on another stream that ended just before
  (a cudaStreamWaitEvent the trace does not record as an edge);
- **synchronisation**: a call that blocks waits for the device op, launched before it,
  whose end it returned after: the named ones (cuda/hipDeviceSynchronize, Stream- and
  EventSynchronize, cudaMemcpy), and any other call that returned within RETURN_US of the
  end of such an op (a copy to pageable memory, which cudaMemcpyAsync performs
  synchronously; a launch into a full launch queue, which returns when a slot frees).
  A device-wide synchronise waits for every node launched before it, so hidden work
  (an all-reduce beside a GEMM) holds it up once the work it hid behind gets faster.
Cross-rank edges (a collective ends when the last rank arrives) are not in this graph:
the job's what-if (`job.py`) couples the ranks through their measured waits.
What the edges do not explain (launch latency, queueing behind work of the previous step)
stays as fixed slack, so replaying the graph with the measured durations gives back the
measured times.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace import event_classes as ec

POLLING_RE = re.compile(r"(?:cuda|hip)(?:Event|Stream)Query$")
DEVICE_SYNC_RE = re.compile(r"(?:cuda|hip)DeviceSynchronize$")  # waits for all device work
BLOCKING_RE = re.compile(r"(?:cuda|hip)(?:Device|Stream|Event)Synchronize$|^(?:cuda|hip)Memcpy(?:DtoH|2D)?$")
RETURN_US = 50.0  # a call this soon after a device op's end returned because of it
BLOCK_MIN_US = 20.0  # shorter calls are not examined for blocking (launches take ~5 us)
# The host's and the device's clocks in a trace agree to this: a synchronous copy from pageable
# memory is seen ending up to 16 us after the call that made it returned (H200, CUDA 13).
CLOCK_SKEW_US = 25.0
XDEP_MIN_US = 5.0  # a start this much after its launch and stream predecessor looks for another cause
# Device node classes (the step-time classes a device op belongs to).
DEV_CLASS = {ec.COMM: "comm", ec.MEMCPY: "memory", ec.BANDWIDTH: "memory", ec.COMPUTE: "compute",
             ec.OTHER: "compute"}


@dataclass
class StepGraph:
    step: int
    lo: float
    hi: float
    # host chain, in time order
    h_start: np.ndarray
    h_end: np.ndarray
    h_gap_data: np.ndarray  # of the gap before each call, the part spent in DataLoader spans
    h_wait_on: np.ndarray  # device node a blocking call waited for, or -1
    h_wait_all: np.ndarray  # a device-wide synchronise: it waits for every node launched before it
    tail_data: float  # of the gap after the last call, the part in DataLoader spans
    # device nodes
    d_start: np.ndarray
    d_end: np.ndarray
    d_cls: list  # "comm" | "memory" | "compute"
    d_launch: np.ndarray  # host chain index; -1: launched before the step
    d_pred: np.ndarray  # device node before it on its stream, or -1
    d_xdep: np.ndarray  # device node on another stream it waited for, or -1
    # Where the host's part of the step ends: `hi`, except in a step stretched over device
    # work that outlasted its host span (load.step_windows), which ends with that work.
    host_hi: float | None = None
    window_lo: float | None = None  # where the step's window begins (lo may be earlier: its host part)
    # The replay's per-node constants as lists (whatif.replay), made on its first replay.
    prepped: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def n_host(self) -> int:
        return len(self.h_start)

    @property
    def host_end(self) -> float:
        """Where the host's part of the step ends."""
        return self.hi if self.host_hi is None else self.host_hi

    def last_own_device_node(self) -> int:
        """In a step that ends with its own device work (stretched past its host part), the
        device node it launched that ended last; -1 otherwise."""
        if self.host_end >= self.hi:
            return -1
        own = np.flatnonzero(self.d_launch >= 0)
        if not len(own):
            return -1
        j = int(own[np.argmax(self.d_end[own])])
        return j if self.d_end[j] > self.host_end else -1


def _in_spans(lo: np.ndarray, hi: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Length of each [lo, hi) inside the (normalized) spans; an empty range when hi < lo
    (calls of other threads overlapping in the chain)."""
    return iv.measure_in_windows(spans, np.column_stack([lo, np.maximum(lo, hi)]))


class _TraceIndex(NamedTuple):
    """What every step's graph of one trace looks up."""
    trace: Any  # a diag.analyzers.trace.columns.Trace (the what-if imports no trace module)
    blocking: np.ndarray  # per runtime call: it blocks the host
    corr_index: tuple  # (device rows sorted by correlation id, their sorted ids)
    dev_classes: np.ndarray
    data_spans: np.ndarray


def step_graphs(trace, dev_classes: np.ndarray, data_spans: np.ndarray, windows) -> list[StepGraph]:
    """The graph of each step window [(step, lo, hi), ...] of a trace with device activity."""
    names = trace.names
    keep_name = np.array([not POLLING_RE.search(n) for n in names], dtype=bool) if names else np.zeros(0, bool)
    block_name = np.array([bool(BLOCKING_RE.search(n)) for n in names], dtype=bool) if names else np.zeros(0, bool)
    all_name = np.array([bool(DEVICE_SYNC_RE.search(n)) for n in names], dtype=bool) if names else np.zeros(0, bool)
    # Device rows by correlation id, sorted once: a step looks up its calls' rows by bisection.
    by_corr = np.argsort(trace.dev_corr, kind="stable")
    corr_sorted = trace.dev_corr[by_corr]
    launches = np.isin(trace.rt_corr, trace.dev_corr)
    blocking = block_name[trace.rt_name] if len(trace.rt_name) else np.zeros(0, bool)
    chain_mask = (keep_name[trace.rt_name] if len(trace.rt_name) else np.zeros(0, bool)) & (launches | blocking)
    index = _TraceIndex(trace, blocking, (by_corr, corr_sorted), dev_classes, data_spans)
    out = []
    for step, lo, hi in windows:
        # A step stretched over its device work holds the calls of its own host span, which
        # may begin while the device still runs the step before.
        h_lo, h_hi = trace.host_span(lo, hi)
        sel = np.flatnonzero(chain_mask & (trace.rt_ts >= h_lo) & (trace.rt_ts < h_hi))
        sel = sel[np.argsort(trace.rt_ts[sel], kind="stable")]
        wait_all = all_name[trace.rt_name[sel]] if len(sel) else np.zeros(0, bool)
        g = _one_step(index, step, min(lo, h_lo), hi, sel, wait_all, min(hi, h_hi))
        g.window_lo = float(lo)
        out.append(g)
    return out


def _one_step(index: _TraceIndex, step, lo, hi, sel, wait_all, host_hi) -> StepGraph:
    """The graph of one step [lo, hi) whose host part ends at host_hi: `sel` its host chain's
    runtime calls in time order, `wait_all` which of them wait for all device work."""
    trace, blocking, corr_index, dev_classes, data_spans = index
    h_start = trace.rt_ts[sel].astype(float)
    h_end = np.minimum(h_start + trace.rt_dur[sel], host_hi)
    prev_end = np.concatenate(([lo], h_end[:-1]))[: len(h_start)]
    h_gap_data = _in_spans(prev_end, h_start, data_spans)
    tail_data = float(_in_spans(np.array([h_end[-1] if len(h_end) else lo]), np.array([host_hi]),
                                data_spans)[0])
    # Device nodes launched by the chain's calls (every device row with a call's correlation id),
    # and those still running from earlier steps' launches (a queue the step's own launches wait
    # behind): launch -1, ready at the step's start.
    by_corr, corr_sorted = corr_index
    corr = trace.rt_corr[sel]
    first = np.searchsorted(corr_sorted, corr, side="left")
    count = np.searchsorted(corr_sorted, corr, side="right") - first
    launch = np.repeat(np.arange(len(sel), dtype=np.int64), count)
    dev_rows = by_corr[np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))]
    running = np.flatnonzero((trace.dev_ts < hi) & (trace.dev_ts + trace.dev_dur > lo))
    earlier = running[~np.isin(running, dev_rows)]  # every launch inside the step is in the chain
    dev_rows = np.concatenate([dev_rows, earlier]).astype(np.int64)
    launch = np.concatenate([launch, np.full(len(earlier), -1, dtype=np.int64)])
    order = np.argsort(trace.dev_ts[dev_rows], kind="stable") if len(dev_rows) else np.zeros(0, np.int64)
    dev_rows, launch = dev_rows[order], launch[order]
    d_start = trace.dev_ts[dev_rows].astype(float)
    d_end = d_start + trace.dev_dur[dev_rows]
    streams = trace.dev_stream[dev_rows]
    d_pred = np.full(len(dev_rows), -1, dtype=np.int64)
    last: dict[int, int] = {}
    for j, s in enumerate(streams.tolist()):
        d_pred[j] = last.get(s, -1)
        last[s] = j
    launch_end = np.where(launch >= 0, h_end[np.maximum(launch, 0)] if len(h_end) else lo, lo)
    d_xdep = _cross_stream(d_start, d_end, streams, d_pred, launch_end)
    h_wait_on = _blocking_waits(sel, blocking, h_start, h_end, launch, d_end)
    # A call that waited for its own copy spans it: where the device's clock puts the copy a
    # little outside the call (CLOCK_SKEW_US), the copy is taken to lie within it.
    own = np.flatnonzero(h_wait_on >= 0)
    own = own[launch[h_wait_on[own]] == own]
    nodes = h_wait_on[own]
    d_start[nodes] = np.clip(d_start[nodes], h_start[own], h_end[own])
    d_end[nodes] = np.clip(d_end[nodes], d_start[nodes], h_end[own])
    return StepGraph(step, float(lo), float(hi), h_start, h_end, h_gap_data, h_wait_on, wait_all, tail_data,
                     d_start, d_end, [DEV_CLASS.get(int(c), "compute") for c in dev_classes[dev_rows].tolist()],
                     launch, d_pred, d_xdep, host_hi)


def _cross_stream(d_start, d_end, streams, d_pred, launch_end) -> np.ndarray:
    """For each device node whose start neither its launch nor its stream predecessor explains,
    the node on another stream that ended last before it started."""
    n = len(d_start)
    xdep = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return xdep
    pred_end = np.where(d_pred >= 0, d_end[np.maximum(d_pred, 0)], -np.inf)
    ready = np.maximum(launch_end, pred_end)
    late = np.flatnonzero(d_start - ready > XDEP_MIN_US)
    if not len(late):
        return xdep
    by_end = np.argsort(d_end, kind="stable")
    ends = d_end[by_end]
    for j in late.tolist():
        i = int(np.searchsorted(ends, d_start[j], side="right")) - 1
        while i >= 0 and streams[by_end[i]] == streams[j]:
            i -= 1
        if i >= 0 and ends[i] > ready[j]:
            xdep[j] = by_end[i]
    return xdep


def _blocking_waits(sel, blocking, h_start, h_end, launch, d_end) -> np.ndarray:
    """For each call that blocked, the device node launched before it whose end it returned after."""
    wait_on = np.full(len(sel), -1, dtype=np.int64)
    if not len(launch):
        return wait_on
    named = blocking[sel]
    for i in np.flatnonzero(named | (h_end - h_start > BLOCK_MIN_US)).tolist():
        ended = (d_end <= h_end[i]) | ((launch == i) & (d_end <= h_end[i] + CLOCK_SKEW_US))
        cand = np.flatnonzero((launch <= i) & ended & (d_end > h_start[i]))
        if not len(cand):
            continue
        a = cand[np.argmax(d_end[cand])]
        if named[i] or h_end[i] - d_end[a] <= max(RETURN_US, 0.05 * (h_end[i] - h_start[i])):
            wait_on[i] = a
    return wait_on
