"""Whether each collective starts after its step's backward pass has ended; and how FSDP
overlaps its all-gathers.

A gradient all-reduce can hide behind the backward pass only while backward still runs: one
that starts after it (a manual all_reduce after loss.backward(), DDP's last bucket, or one
bucket holding every gradient) has nothing left to overlap with. The backward pass of a step
is its autograd nodes (`autograd::engine::evaluate_function: ...` spans) on the host; on a
device trace, the kernels those nodes' ops launched (linked by External id). Pure: marks the
collective records with `after_backward` (None where the step ran no backward).

FSDP labels its work: FSDP2 (`fully_shard`) records `FSDP::pre_forward (<module>)` per unit
and `FSDP::forward_prefetch for <module>` / `FSDP::backward_prefetch for <module>` where it
issues a unit's all-gather ahead of its use (backward by default, forward only when set);
FSDP1 records `FullyShardedDataParallel._pre_forward` and kin.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.columns import Trace

BACKWARD_PREFIX = "autograd::engine::evaluate_function"
OP_KIND = 0


def _step_of(ts: np.ndarray, win: np.ndarray) -> np.ndarray:
    """The last window that began at or before each timestamp (device work runs after the
    host-side step that launched it), or -1."""
    return np.searchsorted(win[:, 0], ts, side="right") - 1


def backward_end(trace: Trace, win: np.ndarray, on_device: bool) -> np.ndarray:
    """Per window, when its backward pass ended (NaN where it ran none)."""
    out = np.full(len(win), np.nan)
    ids = [i for i, name in enumerate(trace.names) if name.startswith(BACKWARD_PREFIX)]
    rows = np.flatnonzero((trace.cpu_kind == OP_KIND) & np.isin(trace.cpu_name, ids))
    if not len(rows) or not len(win):
        return out
    if on_device:
        # The device work whose launching op ran inside a backward node, on that node's thread.
        launcher = trace.launcher_rows()
        dev = np.flatnonzero(launcher >= 0)
        op = launcher[dev]
        dev, op = dev[trace.cpu_kind[op] == OP_KIND], op[trace.cpu_kind[op] == OP_KIND]
        inside = np.zeros(len(dev), dtype=bool)
        for tid in np.unique(trace.cpu_tid[rows]).tolist():
            mine = rows[trace.cpu_tid[rows] == tid]
            spans = iv.from_arrays(trace.cpu_ts[mine], trace.cpu_ts[mine] + trace.cpu_dur[mine])
            on_thread = trace.cpu_tid[op] == tid
            inside[on_thread] = iv.window_of(trace.cpu_ts[op[on_thread]], spans) >= 0
        kern = dev[inside]
        ends, steps = trace.dev_ts[kern] + trace.dev_dur[kern], _step_of(trace.dev_ts[kern], win)
    else:
        ends, steps = trace.cpu_ts[rows] + trace.cpu_dur[rows], iv.window_of(trace.cpu_ts[rows], win)
    ok = steps >= 0
    np.fmax.at(out, steps[ok], ends[ok])
    return out


def mark_after_backward(records: list[dict], trace: Trace, win: np.ndarray, on_device: bool) -> list[dict]:
    """The records, each with `after_backward`: True where it starts once its step's backward
    pass has ended, False where it starts before, None where the step ran no backward."""
    if not records:
        return records
    end = backward_end(trace, win, on_device)
    steps = _step_of(np.array([r["ts_us"] for r in records], dtype=np.float64), win)
    for rec, k in zip(records, steps.tolist()):
        rec["after_backward"] = None if k < 0 or np.isnan(end[k]) else bool(rec["ts_us"] >= end[k])
    return records


FSDP2_UNIT = re.compile(r"^FSDP::pre_forward \((.*)\)$")
FSDP2_PREFETCH = re.compile(r"^FSDP::(forward|backward)_prefetch for ")
FSDP1_PREFIX = "FullyShardedDataParallel."


def fsdp_facts(trace: Trace, win: np.ndarray) -> dict | None:
    """{"version": 1 or 2, "units", "forward_prefetches_per_step", "backward_prefetches_per_step"}
    from the labels FSDP records in the traced steps (prefetches: FSDP2 only); None without FSDP."""
    n = len(win)
    names = trace.names
    fsdp1 = [i for i, name in enumerate(names) if name.startswith(FSDP1_PREFIX)]
    units = {i: m.group(1) for i, name in enumerate(names) if (m := FSDP2_UNIT.match(name))}
    prefetch = {i: m.group(1) for i, name in enumerate(names) if (m := FSDP2_PREFETCH.match(name))}
    if not n or not (fsdp1 or units or prefetch):
        return None
    k = trace.step_of("cpu", win)
    counts = np.bincount(trace.cpu_name[k >= 0], minlength=len(names))
    if not units and not prefetch:
        return {"version": 1, "units": None, "forward_prefetches_per_step": None,
                "backward_prefetches_per_step": None} if counts[fsdp1].sum() else None
    per = {"forward": 0, "backward": 0}
    for i, kind in prefetch.items():
        per[kind] += int(counts[i])
    return {"version": 2, "units": sum(1 for i in units if counts[i]),
            "forward_prefetches_per_step": round(per["forward"] / n, 2),
            "backward_prefetches_per_step": round(per["backward"] / n, 2)}
