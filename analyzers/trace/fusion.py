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


def _unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(key, axis=0, return_inverse=True) through one 64-bit hash per row (a sort of
    numbers, several times faster than one of rows), checked: a collision falls back."""
    mult = np.uint64(0x9E3779B97F4A7C15)
    h = np.zeros(len(key), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in key.T:
            h = (h ^ col.astype(np.uint64)) * mult
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    uniq = key[first]
    if not np.array_equal(uniq[inverse], key):
        uniq, inverse = np.unique(key, axis=0, return_inverse=True)
    return uniq, inverse.reshape(-1)


def _op_time_us(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Each op's kernels' device time where the trace has kernels, else its CPU time."""
    if not len(trace.dev_ts):
        return trace.cpu_dur[rows]
    at = np.full(len(trace.cpu_ts), -1, dtype=np.int64)
    at[rows] = np.arange(len(rows))
    launcher = trace.launcher_rows()
    op = np.where(launcher >= 0, at[np.maximum(launcher, 0)], -1)
    hit = op >= 0
    return np.bincount(op[hit], weights=trace.dev_dur[hit], minlength=len(rows))


def elementwise_chains(trace: Trace, win: np.ndarray) -> tuple[list[dict], np.ndarray | None]:
    """The most time-consuming chains, {"name" (the ops with arrows), "ops", "length",
    "per_step", "ms_per_step"}; and per window, what fusing the first would save (µs): its
    time less its longest op's, the one pass over memory a fused kernel still makes."""
    n = len(win)
    if not n or not len(trace.cpu_ts):
        return [], None
    k = trace.step_of("cpu", win)
    rows = np.flatnonzero((k >= 0) & (trace.cpu_kind == 0))
    if not len(rows):
        return [], None
    present = np.flatnonzero(np.bincount(trace.cpu_name[rows], minlength=len(trace.names)))
    cls = {nid: ec.cpu_op_class(trace.names[nid]) for nid in present.tolist()}
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
    idx = np.flatnonzero(memory)
    if not len(idx):
        return [], None
    ids = run_id[idx]
    bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1], True])
    starts, lengths = bounds[:-1], np.diff(bounds)
    keep = lengths >= MIN_CHAIN
    if not keep.any():
        return [], None
    starts, lengths = starts[keep], lengths[keep]
    t_mem = times[idx]
    total = np.add.reduceat(t_mem, bounds[:-1])[keep]
    longest = np.maximum.reduceat(t_mem, bounds[:-1])[keep]
    # A chain's key: its first MAX_NAMES op names (padded) and its length.
    names_mem = trace.cpu_name[outer[idx]]
    offs = np.arange(MAX_NAMES)
    at = starts[:, None] + offs[None, :]
    key = np.where(offs[None, :] < lengths[:, None], names_mem[np.minimum(at, len(idx) - 1)], -1)
    key = np.column_stack([key, lengths])
    uniq, inverse = _unique_rows(key)
    count = np.bincount(inverse, minlength=len(uniq))
    time_by = np.bincount(inverse, weights=total, minlength=len(uniq))
    groups = {}
    for g in np.argsort(-time_by, kind="stable")[:TOP_CHAINS].tolist():
        length = int(uniq[g, -1])
        names = tuple(trace.names[nid] for nid in uniq[g, :MAX_NAMES].tolist() if nid >= 0)
        mine = inverse == g
        # Fused, the chain still makes its longest op's pass over memory.
        saving = np.bincount(window[idx[starts[mine]]], weights=(total - longest)[mine], minlength=n)
        groups[(names, length)] = [int(count[g]), float(time_by[g]), saving]
    top = list(groups.items())
    first_saving = top[0][1][2]
    return [{"name": " → ".join(names) + (f" → … ({length} ops)" if length > len(names) else ""),
             "ops": list(names), "length": length, "per_step": round(count / n, 3),
             "ms_per_step": round(total / 1e3 / n, 4)} for (names, length), (count, total, _) in top], first_saving
