"""Time on the training thread outside every op: Python the job runs between its ops.

The training thread (the one holding the ProfilerSteps) is busy in an op, in a runtime call,
in the DataLoader's spans, or right after an op of CPU work (freeing its tensors:
host_device.cpu_work_ops counts that time as the work's); a stretch in which another thread
runs ops is the thread waiting on it (the autograd engine runs the backward pass on its own
threads). What is left of its step span is the interpreter running the job's own code
between ops: a few microseconds between two ops is dispatch, but
a stretch of `min_gap_us` or more with no op is work of its own (a preprocessing pipeline in
NumPy, PIL or pure Python, a tokenizer, logging), during which nothing is launched. Where
the window recorded Python stacks (`with_stack=True`), each stretch is put down to the
innermost frame of the job's own code that holds most of it (call_sites decides what is the
job's). Per traced step; pure.
"""

from __future__ import annotations

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.call_sites import FRAME_RE, OP_KIND, PY_KIND, is_jobs
from diag.analyzers.trace.columns import Trace
from diag.analyzers.trace.host_device import cpu_work_ops, loader_spans, training_thread

TOP_FRAMES = 3


def python_gaps(trace: Trace, win: np.ndarray, min_gap_us: float, min_coverage: float) -> np.ndarray:
    """The stretches (an interval set) of the training thread's step spans outside every op,
    runtime call, other thread's op and DataLoader span, each `min_gap_us` or longer; empty
    where the trace lost host events (an op whose calls were dropped would look like a gap)."""
    if not len(win) or (trace.op_coverage is not None and trace.op_coverage < min_coverage):
        return iv.EMPTY
    thread = training_thread(trace)
    if thread is None:
        return iv.EMPTY
    ops = trace.cpu_kind == OP_KIND
    mine, others = np.flatnonzero(ops & (trace.cpu_tid == thread)), np.flatnonzero(ops & (trace.cpu_tid != thread))
    # The time right after an op of CPU work is that work's (host_device.cpu_work_ops).
    work, _, after = cpu_work_ops(trace, win, min_coverage)
    ends = trace.cpu_ts[work] + trace.cpu_dur[work]
    busy = iv.union(iv.from_arrays(trace.cpu_ts[mine], trace.cpu_ts[mine] + trace.cpu_dur[mine]),
                    iv.from_arrays(trace.rt_ts, trace.rt_ts + trace.rt_dur), loader_spans(trace, thread),
                    iv.from_arrays(ends, ends + after))
    gaps = iv.subtract(iv.normalize(trace.host_spans(win)), busy)
    if not len(gaps):
        return gaps
    gaps = gaps[gaps[:, 1] - gaps[:, 0] >= min_gap_us]
    # A stretch in which another thread ran ops is the training thread waiting on it (the
    # backward pass, and the hand-over to and from its thread), not Python of its own.
    other = iv.from_arrays(trace.cpu_ts[others], trace.cpu_ts[others] + trace.cpu_dur[others])
    return gaps[iv.measure_in_windows(other, gaps) == 0] if len(other) and len(gaps) else gaps


def gap_us_per_window(trace: Trace, win: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """The gaps' time in each step's host span (µs)."""
    return iv.measure_in_windows(gaps, trace.host_spans(win)) if len(gaps) else np.zeros(len(win))


def python_gap_facts(trace: Trace, win: np.ndarray, gaps: np.ndarray) -> dict | None:
    """{"ms_per_step", "stretches_per_step", "longest_ms", "frames"}: the training thread's
    time outside every op in the stretches `python_gaps` found, and the job's frames that hold
    it (with stacks: {"name", "file", "line", "function", "ms_per_step"}); None without any."""
    if not len(gaps):
        return None
    n = len(win)
    per = gap_us_per_window(trace, win, gaps)
    return {"ms_per_step": round(float(per.sum()) / 1e3 / n, 4),
            "stretches_per_step": round(len(gaps) / n, 2),
            "longest_ms": round(float(np.max(gaps[:, 1] - gaps[:, 0])) / 1e3, 4),
            "frames": _frames(trace, gaps, n)}


def _frames(trace: Trace, gaps: np.ndarray, n: int) -> list[dict]:
    """The job's frames holding the gaps, most time first: for each gap, the innermost of the
    job's frames on the training thread that overlaps at least half of it."""
    thread = training_thread(trace)
    py = np.flatnonzero((trace.cpu_kind == PY_KIND) & (trace.cpu_tid == thread))
    if not len(py):
        return []
    jobs = {nid for nid in np.unique(trace.cpu_name[py]).tolist() if is_jobs(trace.names[nid])}
    py = py[np.isin(trace.cpu_name[py], list(jobs))]
    start, end = trace.cpu_ts[py], trace.cpu_ts[py] + trace.cpu_dur[py]
    held: dict[int, float] = {}
    for lo, hi in gaps.tolist():
        overlap = np.minimum(end, hi) - np.maximum(start, lo)
        ok = np.flatnonzero(overlap >= 0.5 * (hi - lo))
        if not len(ok):
            continue
        j = ok[np.argmin(trace.cpu_dur[py[ok]])]
        nid = int(trace.cpu_name[py[j]])
        held[nid] = held.get(nid, 0.0) + float(hi - lo)
    out = []
    for nid, us in sorted(held.items(), key=lambda kv: -kv[1])[:TOP_FRAMES]:
        m = FRAME_RE.match(trace.names[nid])
        if m is None:  # every frame was selected by this pattern
            continue
        out.append({"name": trace.names[nid], "file": m["file"], "line": int(m["line"]), "function": m["function"],
                    "ms_per_step": round(us / 1e3 / n, 4)})
    return out
