"""Did a change help? Two runs' step times against their own noise, the scaling between two
world sizes, and the prediction made on the first run checked against the second.

Step times are the job's (per step, the slowest rank's), warm-up left out by the one rule of
`steady`. The change "helped" when the whole interval of the ratio of median step times
(after / before) lies below 1 - `change_min_effect`, and "hurt" when it lies above
1 + `change_min_effect`; a point estimate beyond that margin whose interval still crosses
it is a "fragile" win or loss; otherwise "no clear change".
"""

from __future__ import annotations

from typing import Any, cast

from diag.analyzers.analysis_types import Analysis
from diag.analyzers.diagnosis.inputs import recorded_loader
from diag.analyzers.diagnosis.loader_model import batch_is_cpu_work, cpus_per_rank, expectation, loader_rates
from diag.analyzers.diagnosis.steady import interval_level, level, levels_ratio_interval
from diag.analyzers.numbers import percent

RESULTS = ("helped", "hurt", "fragile_win", "fragile_loss", "no_change")
MIN_STEPS = 3  # after warm-up, in each run


def step_time_change(before_s: list[float], after_s: list[float], tree) -> dict | None:
    """The judgement of two runs' steady step times; None with fewer than MIN_STEPS in either."""
    return level_change(level(before_s), level(after_s), tree)


def level_change(before: dict | None, after: dict | None, tree) -> dict | None:
    """The judgement of two runs' levels (steady.level); None with fewer than MIN_STEPS in either."""
    if not before or not after or before["steps"] < MIN_STEPS or after["steps"] < MIN_STEPS:
        return None
    th = tree.thresholds
    # The interval of two runs' levels (each median's error and each run's own drift): the
    # one interval of compare and of the gate.
    ratio, lo, hi = levels_ratio_interval(before, after, th["noise_interval_z"])
    kind = verdict_of_change(ratio, lo, hi, th["change_min_effect"])
    return {
        "ratio": ratio, "ci_low": lo, "ci_high": hi, "change": ratio - 1, "result": kind,
        "statement": statement(kind, ratio, lo, hi, before["steps"], after["steps"],
                               interval_level(th["noise_interval_z"])),
        "method": f"ratio of median step times with the interval of both runs' levels: each median's robust "
                  f"standard error and each run's drift (z = {th['noise_interval_z']:g}); changes under "
                  f"{th['change_min_effect']:.0%} are not called wins",
    }


def verdict_change(before: str | None, after: str | None, comparable: bool = True) -> dict:
    """The two runs' verdicts side by side, and what may be read into a difference: nothing
    between runs that train different jobs."""
    if before == after:
        text = f"The verdict is unchanged: {before}-bound in both runs." if before else "Neither run has a verdict."
    elif before and after and not comparable:
        text = (f"The verdicts differ ({before}-bound before, {after}-bound after), but the runs train different "
                "jobs: no change is read into it.")
    elif before and after:
        text = (f"The verdict changed from {before}-bound to {after}-bound: the change removed the old bottleneck "
                f"and {after} is now what limits the step.")
    else:
        text = f"Only one run has a verdict ({before or after}-bound)."
    return {"before": before, "after": after, "changed": before != after, "text": text}


def verdict_of_change(ratio: float, lo: float, hi: float, min_effect: float) -> str:
    if hi < 1 - min_effect:
        return "helped"
    if lo > 1 + min_effect:
        return "hurt"
    if ratio < 1 - min_effect:
        return "fragile_win"
    if ratio > 1 + min_effect:
        return "fragile_loss"
    return "no_change"


def statement(kind: str, ratio: float, lo: float, hi: float, n_a: int, n_b: int, level: float = 0.95) -> str:
    """The plain sentence a reader takes away; `level` is the interval's (0.95: 95%)."""
    change = ratio - 1
    band = (f"{level:.0%} interval of the step-time change: {percent(lo - 1, 1, signed=True)} to "
            f"{percent(hi - 1, 1, signed=True)}")
    basis = f"median of {n_b} steps after against {n_a} before, warm-up steps left out"
    if kind == "helped":
        return (f"The change helped: steps are {percent(-change, 1)} faster ({1 / ratio:.2f}x), "
                f"well outside the noise ({band}; {basis}).")
    if kind == "hurt":
        return (f"The change made training slower: steps are {percent(change, 1)} slower, "
                f"outside the noise ({band}; {basis}).")
    if kind == "fragile_win":
        return (f"Steps look {percent(-change, 1)} faster, but the gain is within the noise ({band}; {basis}): "
                "treat it as fragile and measure longer runs before relying on it.")
    if kind == "fragile_loss":
        return (f"Steps look {percent(change, 1)} slower, but the difference is within the noise ({band}; {basis}): "
                "it may not be real; measure longer runs.")
    return f"No clear change: step time moved {percent(change, 1, signed=True)} ({band}; {basis})."


def scaling_rating(efficiency: float, small: int, large: int, basis: str, tree) -> dict:
    """How good a scaling efficiency is, by `scaling_good` and `scaling_efficiency`, in a sentence."""
    th = tree.thresholds
    if efficiency >= th["scaling_good"]:
        rating, words = "good", "good"
    elif efficiency >= th["scaling_efficiency"]:
        rating, words = "acceptable", "acceptable"
    else:
        rating, words = "poor", "poor: adding ranks buys less than it costs"
    return {"rating": rating,
            "text": (f"Scaling efficiency from {small} to {large} ranks is {efficiency:.0%} ({basis}); {words}. "
                     f"Ideal would be 100%: {large / small:.2g}x the ranks giving {large / small:.2g}x the "
                     "throughput.")}


def prediction_check(changes_before: list[dict], changes_after: list[dict], applied: str | None) -> dict | None:
    """The prediction made on BEFORE for the what-if change named (`--applied`), beside the step
    AFTER measured; None where none is named: a phase that fell is no evidence that a change
    was made. A what-if change removes a part of the step entirely, so what it checks is the
    ceiling. Both sides are the job's profiled steps, the basis of every such prediction; a run
    with none has no prediction (BEFORE) or no comparable measurement (AFTER)."""
    if applied is None:
        return None
    e = {c["change"]: c for c in changes_before}.get(applied)
    out: dict[str, Any] = {"change": applied, "kind": "ceiling", "inferred": False, "description": e["description"] if e else None,
           "baseline_step_ms": e["baseline_step_ms"] if e else None,
           "predicted_step_ms": e.get("predicted_step_ms") if e else None,
           "measured_step_ms": changes_after[0]["baseline_step_ms"] if changes_after else None, "error": None}
    how = "as given"
    if out["predicted_step_ms"] is None:
        why = (e or {}).get("note") or "BEFORE has no profiled steps to replay"
        out["text"] = f"No prediction for {applied} ({how}) to check: {why}."
    elif out["measured_step_ms"] is None:
        out["text"] = (f"diag predicted {out['predicted_step_ms']:.1f} ms per step for {applied} ({how}), but AFTER "
                       "has no profiled steps to measure it against.")
    else:
        out["error"] = (out["predicted_step_ms"] - out["measured_step_ms"]) / out["measured_step_ms"]
        out["text"] = (f"Prediction check, {applied} ({how}): diag predicted {out['predicted_step_ms']:.1f} ms per "
                       f"step from BEFORE's {out['baseline_step_ms']:.1f} ms; AFTER measured "
                       f"{out['measured_step_ms']:.1f} ms, an error of {out['error']:+.1%} (profiled steps, the "
                       "slowest rank's step, median).")
    return out


def _loaders(doc: Analysis) -> dict[int, dict]:
    """Each rank's recorded DataLoader settings (rank -> settings)."""
    return {cast(int, r.rank): loader for r in doc.ranks
            if (loader := recorded_loader(r.facts)) is not None and isinstance(loader.get("num_workers"), int)}


def _rank_steps(doc: Analysis) -> dict[int, list]:
    return {cast(int, r.rank): list(r.facts.steps) for r in doc.ranks}


def loader_check(doc_a: Analysis, doc_b: Analysis, tree) -> dict | None:
    """The step the loader model expected for the worker count AFTER ran, from BEFORE's rates,
    graded against AFTER's measured step; None where the two runs' recorded DataLoader settings
    do not differ in num_workers (no change is inferred without that record)."""
    la, lb = _loaders(doc_a), _loaders(doc_b)
    rank = min(set(la) & set(lb), default=None)
    if rank is None or la[rank]["num_workers"] == lb[rank]["num_workers"]:
        return None
    th = tree.thresholds
    before, after = la[rank]["num_workers"], lb[rank]["num_workers"]
    what = f"num_workers {before} -> {after}"
    rates = loader_rates(_rank_steps(doc_a).get(rank, []), before, th)
    measured = [m.step_ms for r in lb if (m := loader_rates(_rank_steps(doc_b).get(r, []), after, th))]
    out: dict[str, Any] = {"change": what, "kind": "action", "inferred": False, "source": "the runs' recorded DataLoader settings",
           "expected_step_ms": None, "low_ms": None, "high_ms": None, "baseline_step_ms": None,
           "measured_step_ms": max(measured) if measured else None, "error": None, "within_range": None}
    if rates is None or not measured:
        out["text"] = f"No prediction for {what} to check: too few steps were timed in {'BEFORE' if rates is None else 'AFTER'}."
        return out
    expected, low, high, _ = expectation(rates, after, cpus_per_rank(la[rank]), th, batch_is_cpu_work(rates, th),
                                         la[rank].get("cpus"))
    m = out["measured_step_ms"]
    out.update(expected_step_ms=expected, low_ms=low, high_ms=high, baseline_step_ms=rates.step_ms,
               error=(expected - m) / m, within_range=low <= m <= high)
    out["text"] = (f"Prediction check, {what} (from the runs' recorded DataLoader settings): diag expected "
                   f"{expected:.1f} ms per step (within {low:.1f} to {high:.1f} ms) from BEFORE's {rates.step_ms:.1f} ms; "
                   f"AFTER measured {m:.1f} ms, an error of {out['error']:+.1%}, "
                   f"{'within' if out['within_range'] else 'outside'} the predicted range (steps outside profiler "
                   "windows, after warm-up, the slowest rank's median).")
    return out
