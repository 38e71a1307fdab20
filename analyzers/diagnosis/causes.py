"""Causes: what in the job's own objects makes a phase slow, in the names the job uses.

A verdict names a class (data, host, ...); a cause names what to change: this DataLoader's
`num_workers=0`. Each rule is an object that says which phase it explains, detects itself
in the facts and returns its evidence (the numbers and names it found) and an action that
quotes them. The phase's recommendation leads with the causes found; the gain stays the
phase's, predicted by replaying the traced steps without that phase's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diag.analyzers.diagnosis.context import JobContext


@dataclass(frozen=True)
class CauseRule:
    id: str
    phase: str  # the class whose time it explains (decision_tree.CLASSES)
    detect: Callable[[JobContext], dict | None]  # -> {"text", "action", "evidence"} or None
    supersedes: tuple[str, ...] = ()  # the verdict's generic fixes (by their start) its action replaces


def _loaders(ctx: JobContext) -> dict[int, dict]:
    """The DataLoader settings each rank's agent recorded (rank -> settings)."""
    out = {}
    for rank, merged in ctx.ranks.items():
        loader = (merged.get("analysis") or {}).get("loader")
        if isinstance(loader, dict) and isinstance(loader.get("num_workers"), int):
            out[rank] = loader
    return out


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _no_loader_workers(ctx: JobContext) -> dict | None:
    """The DataLoader loads in the training process: num_workers=0."""
    loaders = _loaders(ctx)
    idle = sorted(r for r, ld in loaders.items() if ld["num_workers"] == 0)
    if not idle:
        return None
    ld = loaders[idle[0]]
    cpus, local = ld.get("cpus"), ld.get("local_ranks") or 1
    per_rank = cpus // local if isinstance(cpus, int) and cpus > 0 else None
    # One CPU per rank stays with the training process itself.
    start = max(1, per_rank - 1) if per_rank else None
    where = f"{ld['class']} over {ld['dataset']}"
    sizing = (f"start at num_workers={start} ({cpus} CPUs for {local} local rank{'s' if local > 1 else ''}, one "
              f"left to the training process)" if start else "start at the number of CPU cores per rank")
    return {
        "text": f"The {where} has num_workers=0 on {_ranks(idle)}: every batch is read and collated on the "
                "training thread, inside the step.",
        "action": f"Give the {where} worker processes: {sizing}, with persistent_workers=True so that they "
                  "outlive each epoch.",
        "evidence": {"ranks": idle, "loader": ld},
    }


# Ops that bring a tensor's value to the host, and the call in the job's code that makes each:
# on a GPU every one waits for the device to reach it.
SYNC_OPS = {
    "aten::item": ".item()",
    "aten::is_nonzero": "bool(tensor) or `if tensor:`",
    "aten::nonzero": "nonzero() or boolean-mask indexing",
    "aten::equal": "torch.equal()",
}


def _traced_steps(analysis: dict) -> int:
    return sum(1 for s in analysis.get("steps") or [] if isinstance(s, dict) and s.get("evidence") == "trace")


def _host_sync_points(ctx: JobContext) -> dict | None:
    """Ops that pull values to the host, at `sync_points_per_step` calls per traced step or more."""
    minimum = ctx.tree.thresholds["sync_points_per_step"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        traced = _traced_steps(analysis)
        ops = [o for o in analysis.get("top_ops") or [] if isinstance(o, dict) and o.get("name") in SYNC_OPS]
        calls = sum(int(o.get("count") or 0) for o in ops) / traced if traced else 0.0
        if calls >= minimum:
            found[rank] = (sorted(ops, key=lambda o: -int(o.get("count") or 0)), traced, calls)
    if not found:
        return None
    ops, traced, calls = found[min(found)]
    listed = ", ".join(f"{o['name']} {o['count'] / traced:.0f} times ({float(o.get('time_ms') or 0) / traced:.2f} ms)"
                       for o in ops)
    first = ops[0]["name"]
    return {
        "text": f"Per traced step on {_ranks(sorted(found))}, {listed}: {calls:.0f} values pulled to the host "
                "one at a time, each a wait for the device on a GPU.",
        "action": f"Keep the values on the device: replace the per-element {SYNC_OPS[first]} in the step with "
                  "tensor operations (sum, a mask, where, argmax) and read one result per step, or every N steps "
                  "for logging.",
        "evidence": {"ranks": sorted(found), "per_step": round(calls, 1), "traced_steps": traced,
                     "ops": [{"name": o["name"], "count": o["count"], "time_ms": o.get("time_ms")} for o in ops]},
    }


RULES: tuple[CauseRule, ...] = (
    CauseRule("data_loader_no_workers", "data", _no_loader_workers, supersedes=("Raise DataLoader num_workers",)),
    CauseRule("host_sync_points", "host", _host_sync_points, supersedes=("Remove synchronisation points",)),
)


def causes(ctx: JobContext) -> list[dict]:
    """The causes found, each with its rule's id and phase, in rule order: only for a phase that
    bounds the job or takes at least `recommendation_min_share` of its steps (a DataLoader
    without workers is no cause of a compute-bound job's time)."""
    shares = ctx.shares or {}
    minimum = ctx.tree.thresholds["recommendation_min_share"]
    out = []
    for rule in RULES:
        if rule.phase != ctx.bound and not (shares.get(rule.phase) or 0.0) >= minimum:
            continue
        found = rule.detect(ctx)
        if found:
            out.append({"id": rule.id, "phase": rule.phase, "supersedes": list(rule.supersedes), **found})
    return out
