"""Chains of elementwise ops: the runs that a fused kernel would do in one pass over memory.

On each thread, the outermost compute and memory-class ops (an aten::linear, not the addmm
inside it; the aten::mul inside an autograd node) are taken in time order; a chain is a run
of at least MIN_CHAIN memory-class ops with no compute op between them. Each op of a chain
reads and writes whole tensors that the next op reads again: a fused kernel (torch.compile,
a fused norm or optimizer) reads the inputs once.

Chains are grouped by their ops' names (the first MAX_NAMES, and the length). An op's time is
its kernels' device time where the trace has kernels (linked by External id), else its own
CPU time. Per traced step; pure.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace.columns import Trace

MIN_CHAIN = 3
MAX_NAMES = 8
TOP_CHAINS = 3


def _outermost(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """The rows not nested inside another of `rows` on the same thread, in (thread, time) order."""
    order = rows[np.lexsort((-trace.cpu_dur[rows], trace.cpu_ts[rows], trace.cpu_tid[rows]))]
    if not len(order):
        return order
    ts, end, tid = trace.cpu_ts[order], trace.cpu_ts[order] + trace.cpu_dur[order], trace.cpu_tid[order]
    # Shift each thread past the one before, so that one running maximum serves all threads.
    first = np.r_[True, tid[1:] != tid[:-1]]
    span = float(end.max() - ts.min()) + 1.0
    shift = (np.cumsum(first) - 1) * span
    reach = np.maximum.accumulate(end + shift)
    nested = np.r_[False, (ts + shift)[1:] < reach[:-1]]
    return order[~nested]


def _op_time_us(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Each op's kernels' device time where the trace has kernels, else its CPU time."""
    if not len(trace.dev_ts):
        return trace.cpu_dur[rows]
    known = trace.dev_ext >= 0
    ext, inverse = np.unique(trace.dev_ext[known], return_inverse=True)
    by_ext = np.bincount(inverse, weights=trace.dev_dur[known], minlength=len(ext))
    want = trace.cpu_ext[rows]
    at = np.clip(np.searchsorted(ext, want), 0, max(len(ext) - 1, 0))
    hit = (len(ext) > 0) & (ext[at] == want) if len(ext) else np.zeros(len(want), dtype=bool)
    return np.where(hit, by_ext[at] if len(ext) else 0.0, 0.0)


def elementwise_chains(trace: Trace, win: np.ndarray) -> tuple[list[dict], np.ndarray | None]:
    """The most time-consuming chains, {"name" (the ops with arrows), "ops", "length",
    "per_step", "ms_per_step"}; and per window, what fusing the first would save (µs): its
    time less its longest op's, the one pass over memory a fused kernel still makes."""
    n = len(win)
    if not n or not len(trace.cpu_ts):
        return [], None
    k = np.searchsorted(win[:, 0], trace.cpu_ts, side="right") - 1
    inside = (k >= 0) & (trace.cpu_ts < win[np.maximum(k, 0), 1]) & (trace.cpu_kind == 0)
    rows = np.flatnonzero(inside)
    if not len(rows):
        return [], None
    cls = {nid: ec.cpu_op_class(trace.names[nid]) for nid in np.unique(trace.cpu_name[rows]).tolist()}
    memory_ids = [nid for nid, c in cls.items() if c == ec.CPU_MEMORY]
    math_ids = memory_ids + [nid for nid, c in cls.items() if c == ec.CPU_COMPUTE]
    outer = _outermost(trace, rows[np.isin(trace.cpu_name[rows], math_ids)])
    if not len(outer):
        return [], None
    times = _op_time_us(trace, outer)
    window, tids = k[outer], trace.cpu_tid[outer]
    memory = np.isin(trace.cpu_name[outer], memory_ids)
    # A run of memory ops ends at a compute op, another thread or another window.
    breaks = ~memory | np.r_[True, (tids[1:] != tids[:-1]) | (window[1:] != window[:-1])]
    run_id = np.cumsum(breaks)
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0.0, np.zeros(n)])
    ids = run_id[memory]
    idx = np.flatnonzero(memory)
    if len(idx):
        bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1], True])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            if b - a < MIN_CHAIN:
                continue
            run = idx[a:b]
            names = tuple(trace.names[nid] for nid in trace.cpu_name[outer[run[:MAX_NAMES]]].tolist())
            g = groups[(names, b - a)]
            t = float(times[run].sum())
            g[0] += 1
            g[1] += t
            # Fused, the chain still makes its longest op's pass over memory.
            g[2][window[run[0]]] += t - float(times[run].max())
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:TOP_CHAINS]
    if not top:
        return [], None
    first_saving = top[0][1][2]
    return [{"name": " → ".join(names) + (f" → … ({length} ops)" if length > len(names) else ""),
             "ops": list(names), "length": length, "per_step": round(count / n, 3),
             "ms_per_step": round(total / 1e3 / n, 4)} for (names, length), (count, total, _) in top], first_saving
