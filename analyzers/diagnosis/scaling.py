"""Scaling efficiency between two runs of one job at different world sizes.

A judgement on two analysis documents (schema diag.analysis/1), so it lives with the
diagnosis: `diag compare` quotes it, and the advisory rule low_scaling_efficiency of the
decision tree decides whether it is low.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import cast

from diag.analyzers.analysis_types import Analysis
from diag.analyzers.diagnosis.decision_tree import advise, load_tree
from diag.errors import DiagInputError


def _job_throughput(doc: Analysis) -> dict:
    ranks = [r.facts for r in doc.ranks]
    sizes = [size for r in ranks if isinstance(size := r.world_size, int)]
    world = doc.job.world_size or (max(sizes) if sizes else None) or len(ranks) or None
    # The job moves at its slowest rank: per step number, the longest duration of any rank.
    per_step: dict = defaultdict(float)
    units: dict = defaultdict(float)
    unit = None
    for r in ranks:
        for s in r.steps:
            d = s.get("duration_ms")
            if not isinstance(d, (int, float)) or d <= 0:
                continue
            key = s.get("step")
            per_step[key] = max(per_step[key], float(d))
            for u in ("tokens", "samples"):  # a run's steps count them; a trace's count neither
                n = cast(dict, s).get(u)
                if isinstance(n, (int, float)) and n > 0:
                    unit = unit or u
                    if u == unit:
                        units[key] += float(n)
                    break
    if not per_step:
        raise DiagInputError("analysis document has no step durations to compute throughput from")
    step_ms = float(statistics.median(per_step.values()))
    if unit and units:
        # units summed over the ranks present in a step; per rank per second.
        present = max(1, len(ranks))
        per_rank = (
            statistics.median(units[k] / per_step[k] for k in units if per_step.get(k)) * 1000.0 / present
        )
    else:
        unit = "steps"
        per_rank = 1000.0 / step_ms
    return {"world_size": world, "step_ms": round(step_ms, 3), "throughput_per_rank": per_rank, "unit": unit}


def scaling_efficiency(run_a_doc: Analysis, run_b_doc: Analysis, tree=None) -> dict:
    """Per-rank throughput at the larger world size over that at the smaller one.

    With samples or tokens per step in both documents, throughput counts them; else it
    counts steps, which assumes the same per-rank batch in both runs (weak scaling, the
    usual data-parallel setting). The advisory rule low_scaling_efficiency applies.
    """
    if tree is None:
        tree = load_tree()
    a, b = _job_throughput(run_a_doc), _job_throughput(run_b_doc)
    if not a["world_size"] or not b["world_size"]:
        raise DiagInputError("cannot tell the world size of both runs")
    if a["world_size"] == b["world_size"]:
        raise DiagInputError(
            f"both runs have world size {a['world_size']}; scaling needs two different sizes"
        )
    small, large = sorted((a, b), key=lambda x: x["world_size"])
    unit = small["unit"] if small["unit"] == large["unit"] else "steps"
    if unit == "steps" and (small["unit"] != "steps" or large["unit"] != "steps"):
        small = {**small, "unit": "steps", "throughput_per_rank": 1000.0 / small["step_ms"]}
        large = {**large, "unit": "steps", "throughput_per_rank": 1000.0 / large["step_ms"]}
    eff = large["throughput_per_rank"] / small["throughput_per_rank"]
    ideal = large["world_size"] / small["world_size"]
    findings = [f for f in advise({"scaling_efficiency": eff}, tree) if f["id"] == "low_scaling_efficiency"]
    return {
        "efficiency": round(eff, 4),
        "unit": unit,
        "basis": f"{unit} per second per rank"
        + (" (assumes the same per-rank batch in both runs)" if unit == "steps" else ""),
        "smaller": small,
        "larger": large,
        "ideal_speedup": round(ideal, 4),
        "speedup": round(eff * ideal, 4),
        "findings": findings,
    }


def scaling_from_rates(world_a: int, rate_a: float, world_b: int, rate_b: float, unit: str, tree=None) -> dict:
    """Scaling efficiency from two runs' per-rank throughput (samples, tokens or steps per
    second per rank), when their analysis documents cannot give it; the same shape as
    `scaling_efficiency`."""
    tree = tree or load_tree()
    (ws, rs), (wl, rl) = sorted(((world_a, rate_a), (world_b, rate_b)))
    eff = rl / rs
    findings = [f for f in advise({"scaling_efficiency": eff}, tree) if f["id"] == "low_scaling_efficiency"]
    return {
        "efficiency": eff,
        "unit": unit,
        "basis": f"{unit} per second per rank" + (" (assumes the same per-rank batch in both runs)"
                                                   if unit == "steps" else ""),
        "smaller": {"world_size": ws, "throughput_per_rank": rs, "unit": unit},
        "larger": {"world_size": wl, "throughput_per_rank": rl, "unit": unit},
        "ideal_speedup": wl / ws,
        "speedup": eff * wl / ws,
        "findings": findings,
    }
