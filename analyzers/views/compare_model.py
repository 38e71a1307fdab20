"""Before/after comparison of two runs (`diag compare RUN_A RUN_B`): the page model, from two
report models.

Whether the change helped, how good the scaling is and how the prediction fared are the
diagnosis layer's judgements (`diag.analyzers.diagnosis.change`, `.scaling`); this module
lays them out beside the two runs' figures: each run's median step and its spread (median
absolute deviation), the phase table in shares and milliseconds, throughput.
"""

from __future__ import annotations

from typing import Any

from diag.analyzers.analysis_types import Analysis
from diag.analyzers.diagnosis import change, gate
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.inputs import CLASSES
from diag.analyzers.diagnosis.scaling import scaling_efficiency, scaling_from_rates
from diag.errors import DiagInputError

COMPARE_SCHEMA = "diag.compare/1"


def compare(model_a: dict, model_b: dict, doc_a: Analysis | None = None, doc_b: Analysis | None = None,
            tree=None, applied: str | None = None) -> dict:
    """The comparison model of run A (before) and run B (after)."""
    tree = tree or load_tree()
    diag_a, diag_b = model_a.get("diagnosis"), model_b.get("diagnosis")
    worlds = {(m.get("run") or {}).get("world_size") for m in (model_a, model_b)}
    judged = gate.comparison(diag_a, diag_b, tree, scaling=len(worlds - {None}) == 2)
    runs = [_run_summary(m, st) for m, st in zip((model_a, model_b), judged["step_times"])]
    out: dict = {"schema": COMPARE_SCHEMA, "before": runs[0], "after": runs[1], "missing": [],
                 "comparable": not judged["differences"], "differences": judged["differences"]}
    out["step_time"] = judged["step_time"]
    if judged["differences"]:
        out["missing"].append("Not comparable: the runs train different jobs (" + "; ".join(judged["differences"])
                              + "); no change is read from their step times.")
    elif out["step_time"] is None:
        out["missing"].append(f"Too few steps to compare step times (at least {change.MIN_STEPS} after warm-up "
                              "in each run).")
    out["phases"] = _phase_changes(model_a, model_b)
    out["verdict_change"] = change.verdict_change(model_a.get("bound"), model_b.get("bound"), out["comparable"])
    out["throughput"] = _throughput_change(model_a, model_b)
    out["scaling"] = _scaling(model_a, model_b, doc_a, doc_b, tree)
    out["prediction"] = gate.graded_prediction(doc_a, diag_a, doc_b, diag_b, applied, tree)
    out["headline"] = _headline(out)
    return out


def _run_summary(model: dict, step: dict | None) -> dict:
    """A run beside the other: its steady step time as the diagnosis states it (run_figures)."""
    run = model.get("run") or {}
    step = step or {}
    return {
        "name": run.get("name"), "path": run.get("path"), "world_size": run.get("world_size"),
        "bound": model.get("bound"), "headline": (model.get("headline") or {}).get("text"),
        "confidence": (model.get("confidence") or {}).get("level"),
        "steps": int(step.get("steps") or 0),
        **{k: step.get(k) for k in ("median_ms", "mad_ms", "p10_ms", "p90_ms")},
        "shares": model.get("phase_shares"),
        "throughput": model.get("throughput") or {},
        "missing": [m["what"] for m in model.get("missing") or []],
    }


def _phase_changes(a: dict, b: dict) -> list[dict] | None:
    sa, sb = a.get("phase_shares"), b.get("phase_shares")
    ma, mb = (a.get("step_stats") or {}).get("median_ms"), (b.get("step_stats") or {}).get("median_ms")
    if not sa or not sb:
        return None
    rows = []
    for p in CLASSES:
        # A run analysed before the wait split has no "wait": its waiting is inside comm.
        before, after = sa.get(p) or 0.0, sb.get(p) or 0.0
        row: dict[str, Any] = {"phase": p, "before": before, "after": after, "delta": after - before}
        if ma and mb:
            # Milliseconds of a median step spent in the phase: shows where the time was won or lost.
            row["before_ms"], row["after_ms"] = before * ma, after * mb
            row["delta_ms"] = row["after_ms"] - row["before_ms"]
        rows.append(row)
    return rows


def _throughput_change(a: dict, b: dict) -> dict:
    ta, tb = a.get("throughput") or {}, b.get("throughput") or {}
    out = {}
    for key in ("samples_per_s", "tokens_per_s", "steps_per_s", "mfu"):
        x, y = ta.get(key), tb.get(key)
        if x is not None or y is not None:
            out[key] = {"before": x, "after": y, "ratio": (y / x) if x and y else None}
    return out


def _per_rank_rate(model: dict) -> tuple[float | None, str]:
    thr = model.get("throughput") or {}
    world = (model.get("run") or {}).get("world_size") or 1
    for key, unit in (("samples_per_s", "samples"), ("tokens_per_s", "tokens"), ("steps_per_s", "steps")):
        if thr.get(key):
            return thr[key] / world if unit != "steps" else thr[key], unit
    return None, "steps"


def _scaling(a: dict, b: dict, doc_a, doc_b, tree) -> dict | None:
    wa, wb = (a.get("run") or {}).get("world_size"), (b.get("run") or {}).get("world_size")
    if not wa or not wb or wa == wb:
        return None
    r = None
    if doc_a and doc_b:
        try:
            r = {**scaling_efficiency(doc_a, doc_b, tree=tree),
                 "source": "diag.analyzers.diagnosis.scaling.scaling_efficiency"}
        except DiagInputError:  # the documents cannot be compared this way: the report models can
            r = None
    if r is None:
        (ra, ua), (rb, ub) = _per_rank_rate(a), _per_rank_rate(b)
        if ua != ub:  # different units: steps per second (the same per-rank batch assumed)
            ra, rb, ua = (a.get("throughput") or {}).get("steps_per_s"), (b.get("throughput") or {}).get("steps_per_s"), \
                "steps"
        if not ra or not rb:
            return None
        r = {**scaling_from_rates(wa, ra, wb, rb, ua, tree), "source": "report models"}
    small, large = r["smaller"]["world_size"], r["larger"]["world_size"]
    return {"efficiency": r["efficiency"], "basis": r["basis"], "smaller": small, "larger": large,
            "speedup": r.get("speedup"), "ideal_speedup": r.get("ideal_speedup"), "findings": r.get("findings") or [],
            "source": r["source"], **change.scaling_rating(r["efficiency"], small, large, r["basis"], tree)}


def _headline(c: dict) -> str:
    parts = []
    if c.get("step_time"):
        parts.append(c["step_time"]["statement"])
    elif c.get("differences"):
        parts.append(c["missing"][0])
    else:
        parts.append("Step times could not be compared.")
    parts.append(c["verdict_change"]["text"])
    if c.get("scaling"):
        parts.append(c["scaling"]["text"])
    return " ".join(parts)
