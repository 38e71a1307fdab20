"""Causes: what in the job's own objects makes a phase slow, in the names the job uses.

A verdict names a class (data, host, ...); a cause names what to change: this DataLoader's
`num_workers=0`. Each rule is an object that says which phase it explains, detects itself
in the facts and returns its evidence (the numbers and names it found) and an action that
quotes them. The phase's recommendation leads with the causes found; the gain stays the
phase's, predicted by replaying the traced steps without that phase's work.

The rules come in families, a module each: the input pipeline (`loader`), the host
(`host`), compute (`compute`), memory (`memory`) and communication (`comm`); what they share
is in `common`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from diag.analyzers.diagnosis import action_models
from diag.analyzers.diagnosis.causes import comm, compute, host, loader, memory
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import device_events_missing
from diag.analyzers.diagnosis.recommendations import cause_gain


@dataclass(frozen=True)
class CauseRule:
    id: str
    phase: str  # the class whose time it explains (decision_tree.CLASSES)
    detect: Callable[[JobContext], dict | None]  # -> {"text", "action", "evidence"} or None
    supersedes: tuple[str, ...] = ()  # the verdict's generic fixes (by their start) its action replaces
    device: bool = True  # it reads the trace's device work (kernels, their ops' time): never on a trace without it
    also: tuple[str, ...] = ()  # other classes its time can land in (a blocking copy: data or host)
    change: str | None = None  # the [[what_if]] change that removes exactly this cause (a detector's
    # own "change" overrides it, where what the cause allows depends on the evidence)
    # The prediction for the cause's action, from its evidence and the ceiling (action_models);
    # a detector may give its own ("expect") instead.
    model: Callable[[JobContext, dict, dict | None], dict | None] | None = None


RULES: tuple[CauseRule, ...] = (
    # The loader's settings and waits and the count of sync ops are the host's own facts.
    CauseRule("data_loader_no_workers", "data", loader.no_loader_workers, supersedes=("Raise DataLoader num_workers",),
              change="no_data_wait", device=False),
    CauseRule("data_loader_workers", "data", loader.loader_workers, supersedes=("Raise DataLoader num_workers",),
              change="no_data_wait", device=False),
    CauseRule("host_sync_points", "host", host.host_sync_points, supersedes=("Remove synchronisation points",),
              change="no_sync_points", device=False, model=action_models.removal("the values kept on the device")),
    # The copy's device time is what the replay removes (the call that waits for it returns as
    # early); pinning it is modelled as that time at the pinned rate.
    CauseRule("pageable_copies", "data", host.pageable_copies, supersedes=("Set pin_memory=True",),
              also=("host", "memory"), change="no_pageable_copies", model=action_models.pinned_copies),
    CauseRule("cpu_work_on_training_thread", "host", host.cpu_work, change="no_cpu_work_on_thread",
              model=action_models.removal("the work moved off the training thread")),
    CauseRule("python_on_training_thread", "host", host.python_gaps, change="no_python_gaps",
              supersedes=("Capture the step with CUDA graphs",),
              model=action_models.removal("the Python moved off the training thread")),
    CauseRule("launch_bound", "host", host.launch_bound, supersedes=("Capture the step with CUDA graphs",),
              change="no_launch_cost"),
    CauseRule("allocator_calls", "host", host.allocator_calls, change="no_allocator_calls",
              model=action_models.removal("no allocation in the driver inside the loop")),
    CauseRule("fp32_math", "compute", compute.fp32_math, supersedes=("Use lower precision",), change="tensor_core_math",
              model=action_models.autocast),
    # Its change is the detector's: bf16 replayed only on a CPU that may have bf16 units.
    CauseRule("matrix_ops", "compute", compute.matrix_ops, change="half_precision_matrix_ops"),
    CauseRule("elementwise_chain", "memory", memory.elementwise_chain, supersedes=("Fuse elementwise chains",),
              change="fuse_elementwise_chain"),
    # What a fused update saves is its passes over memory and its launches, which the trace does
    # not measure apart: no change of its own.
    CauseRule("optimizer_step", "memory", memory.optimizer_step, also=("host",)),
    CauseRule("bandwidth_kernels", "memory", memory.bandwidth_kernels),
    CauseRule("exposed_collectives", "comm", comm.exposed_collectives,
              supersedes=("Accumulate gradients", "Tune DDP bucket_cap_mb", "Compress gradients"),
              change="compressed_collective", model=action_models.collective),
)


def causes(ctx: JobContext) -> list[dict]:
    """The causes found, each with its rule's id and the phase it explains, the bounding phase's
    first, then by the gain their own changes predict: only
    for a phase that bounds the job or takes at least `recommendation_min_share` of its steps (a
    DataLoader without workers is no cause of a compute-bound job's time). A rule whose time can
    land in several phases explains the bounding one, else the first large enough."""
    shares = ctx.shares or {}
    minimum = ctx.tree.thresholds["recommendation_min_share"]
    seeing = _with_device_events(ctx)
    out = []
    for rule in RULES:
        phases = (rule.phase, *rule.also)
        # Compute time is the work itself: a cause of it only where it bounds the job.
        phase = ctx.bound if ctx.bound in phases else next(
            (p for p in phases if p != "compute" and (shares.get(p) or 0.0) >= minimum), None)
        if phase is None:
            continue
        found = rule.detect(seeing if rule.device else ctx)
        if found:
            # The action's own prediction where the rule models it ("expect"), and the ceiling:
            # the replay with the cause's time gone entirely.
            expect = found.pop("expect", None)
            pred = _prediction(ctx, found.pop("change", rule.change))
            if expect is None and rule.model is not None:
                expect = rule.model(ctx, found["evidence"], pred)
            out.append({"id": rule.id, "phase": phase, "supersedes": list(rule.supersedes), **found,
                        "what_if": pred, "expected": expect, "gain": cause_gain(expect, pred)})
    # The bounding phase's causes first, then the larger predicted gains.
    return sorted(out, key=lambda c: (c["phase"] != ctx.bound, -_speedup(c)))


def _with_device_events(ctx: JobContext):
    """The context without the ranks whose traces lack their GPU's device events: their op
    times are the host's launches, on which no cause about the device's work may rest."""
    ranks = {k: r for k, r in ctx.ranks.items() if not device_events_missing(r.facts)}
    return ctx if len(ranks) == len(ctx.ranks) else dataclasses.replace(ctx, ranks=ranks)


def _speedup(cause: dict) -> float:
    """What a cause's action is predicted to win, else its ceiling (1.0: nothing predicted)."""
    e = cause.get("expected")
    if e and e.get("expected_step_ms"):
        return e["baseline_step_ms"] / e["expected_step_ms"]
    return (cause.get("what_if") or {}).get("speedup") or 1.0


def _prediction(ctx: JobContext, change: str | None) -> dict | None:
    """The job's what-if entry of the change that removes the cause (None: the rule has none)."""
    if change is None:
        return None
    entry = next((e for e in ctx.job.what_if if isinstance(e, dict) and e.get("change") == change), None)
    if entry is None:
        return {"change": change, "predicted_step_ms": None, "speedup": None,
                "note": "the change was not replayed on these steps"}
    return {k: entry.get(k) for k in ("change", "description", "baseline_step_ms", "predicted_step_ms", "speedup",
                                      "note") if k in entry}
