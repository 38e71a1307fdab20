"""Borderline verdicts: a deciding measurement within the run's own noise of its threshold.

A verdict rests on means over steps, but the steps themselves scatter: two ranks on two
cores disturb each other, a GC pause lengthens one step. When a node of the decision
path sits closer to its threshold than that scatter, the other branch is as plausible
as the one taken, and picking one would be chance. The noise is taken from the run: the
robust spread of the node's measurement over the rank-steps the verdict rests on
(`steady.robust_sigma`, the one noise estimate of the diagnosis), and never less than
the measurement's resolution (`borderline_resolution` of the threshold), which is all a
whole trace without steps has.

Pure: plain data in and out.
"""

from __future__ import annotations

import math

from diag.analyzers.diagnosis.decision_tree import (
    BOUNDS,
    CLASSES,
    PEER,
    derive,
    evaluate,
    metric_text,
    share_ratios,
)
from diag.analyzers.diagnosis.steady import robust_sigma


def step_values(steps: list[dict]) -> list[dict]:
    """The tree measurements of each of a rank's counted steps (`verdict.counted_steps`): the
    step's own measurements where its analysis gave them, else those of its shares."""
    out = []
    for s in steps:
        m = measurements if isinstance(measurements := s.get("measurements"), dict) else None
        sh = shares if isinstance(shares := s.get("shares"), dict) else None
        if m is None and sh is not None and all(isinstance(sh.get(c), (int, float)) for c in BOUNDS):
            m = {f"{c}_share": float(sh.get(c) or 0.0) for c in CLASSES}
            m.update(share_ratios(sh))
        if m:
            out.append(derive(m))
    return out


def borderline(measurements: dict, path: list[dict], steps: list[dict], tree, bound: str | None,
               force: dict | None = None) -> dict | None:
    """The first node of `path` whose value lies within the steps' noise of its threshold
    and whose other branch leads to another verdict; None when the verdict is clear."""
    if bound not in BOUNDS:
        return None
    for node in path:
        value, threshold = node.get("value"), node.get("threshold")
        if node.get("forced") or not isinstance(value, (int, float)) or not isinstance(threshold, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        scatter = robust_sigma([s.get(node["metric"]) for s in steps])
        # The measurement's own resolution bounds the band from below: a share judged on a
        # whole trace, with no steps to scatter, is no sharper than that.
        band = max(scatter or 0.0, tree.thresholds["borderline_resolution"] * abs(threshold))
        if band <= 0 or abs(value - threshold) > band:
            continue
        other = "no" if node["answer"] == "yes" else "yes"
        alt = evaluate(measurements, tree, {**(force or {}), node["node"]: (other, "within the run's noise")})
        if alt["bound"] in (bound, PEER) or alt["bound"] not in BOUNDS:
            continue
        return {
            "candidates": [bound, alt["bound"]],
            "node": node["node"],
            "metric": node["metric"],
            "value": value,
            "threshold": threshold,
            "noise": band,
            "steps": sum(1 for s in steps if isinstance(s.get(node["metric"]), (int, float))),
            "text": (f"borderline {bound}/{alt['bound']}: {node['metric']} = {metric_text(node['metric'], value)} is "
                     f"within {_band_name(scatter, band)} (±{metric_text(node['metric'], band)}) of its threshold "
                     f"{metric_text(node['metric'], threshold, threshold=True)}, so {alt['bound']}-bound is as "
                     "plausible"),
        }
    return None


def _band_name(scatter: float | None, band: float) -> str:
    return "the steps' own scatter" if scatter and scatter >= band else "its resolution"
