"""Micro-batches per optimizer step under DDP: how many forward passes each traced step runs
for each optimizer step it takes.

A loop that accumulates gradients over k micro-batches runs k forward and backward passes
per `optimizer.step()`. Outside `ddp.no_sync()`, DDP's reducer all-reduces the gradients
after every one of those backward passes, so k - 1 of the k all-reduces send sums that the
last one would have sent anyway. DDP marks each forward with a `DistributedDataParallel.forward`
annotation and torch.optim each step with `Optimizer.step#<Class>.step`; both are counted on
the host, per traced step. Pure.
"""

from __future__ import annotations

import numpy as np

from diag.analyzers.trace.columns import Trace
from diag.analyzers.trace.optimizer import STEP_RE

DDP_FORWARD = "DistributedDataParallel.forward"


def ddp_passes(trace: Trace, win: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per window, (DDP forward passes, optimizer steps); None where no traced step ran a
    DDP forward."""
    fwd_ids = [i for i, name in enumerate(trace.names) if name == DDP_FORWARD]
    opt_ids = [i for i, name in enumerate(trace.names) if STEP_RE.match(name)]
    if not len(win) or not fwd_ids:
        return None
    k = trace.step_of("cpu", win)
    inside = k >= 0

    def per_window(ids: list[int]) -> np.ndarray:
        hit = inside & np.isin(trace.cpu_name, ids) if ids else np.zeros(len(k), dtype=bool)
        return np.bincount(k[hit], minlength=len(win)).astype(np.float64)

    forwards = per_window(fwd_ids)
    return (forwards, per_window(opt_ids)) if forwards.any() else None


def accumulation_facts(passes: tuple[np.ndarray, np.ndarray] | None) -> dict | None:
    """{"forwards_per_step", "optimizer_steps_per_step"} over the traced steps; None without
    DDP forwards."""
    if passes is None:
        return None
    forwards, steps = passes
    n = len(forwards)
    return {"forwards_per_step": round(float(forwards.sum()) / n, 3),
            "optimizer_steps_per_step": round(float(steps.sum()) / n, 3)}


def redundant_share(passes: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """Per window, the share of its gradient all-reduces that `no_sync()` on all but the last
    micro-batch of each optimizer step would leave out: 1 - steps / forwards where a window
    runs more forwards than optimizer steps (and at least one step), else 0."""
    if passes is None:
        return None
    forwards, steps = passes
    share = np.zeros(len(forwards))
    ok = (steps >= 1) & (forwards > steps)
    share[ok] = 1.0 - steps[ok] / forwards[ok]
    return share if share.any() else None
