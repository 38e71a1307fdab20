"""Did a change help? Two runs' step times against their own noise, the scaling between two
world sizes, and the prediction made on the first run checked against the second.

Step times are the job's (per step, the slowest rank's), warm-up left out by the one rule of
`steady`. The change "helped" when the whole interval of the ratio of median step times
(after / before) lies below 1 - `change_min_effect`, and "hurt" when it lies above
1 + `change_min_effect`; a point estimate beyond that margin whose interval still crosses
it is a "fragile" win or loss; otherwise "no clear change".
"""

from __future__ import annotations

from diag.analyzers.diagnosis.steady import interval_level, median_ratio_interval, warmup_steps

RESULTS = ("helped", "hurt", "fragile_win", "fragile_loss", "no_change")
MIN_STEPS = 3  # after warm-up, in each run


def steady_steps(step_times_s: list, tree) -> list[float]:
    """A run's step times, positive ones only, warm-up left out."""
    t = [float(x) for x in step_times_s if isinstance(x, (int, float)) and x > 0]
    return t[warmup_steps(len(t), tree.thresholds):]


def step_time_change(before_s: list[float], after_s: list[float], tree) -> dict | None:
    """The judgement of two runs' steady step times; None with fewer than MIN_STEPS in either."""
    if len(before_s) < MIN_STEPS or len(after_s) < MIN_STEPS:
        return None
    th = tree.thresholds
    ratio, lo, hi = median_ratio_interval(before_s, after_s, th["noise_interval_z"])
    kind = verdict_of_change(ratio, lo, hi, th["change_min_effect"])
    return {
        "ratio": ratio, "ci_low": lo, "ci_high": hi, "change": ratio - 1, "result": kind,
        "statement": statement(kind, ratio, lo, hi, len(before_s), len(after_s),
                               interval_level(th["noise_interval_z"])),
        "method": f"ratio of median step times with the interval of both medians' robust standard errors "
                  f"(z = {th['noise_interval_z']:g}); changes under {th['change_min_effect']:.0%} are not "
                  "called wins",
    }


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


def _pct(x: float, signed: bool = False) -> str:
    return f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%"


def statement(kind: str, ratio: float, lo: float, hi: float, n_a: int, n_b: int, level: float = 0.95) -> str:
    """The plain sentence a reader takes away; `level` is the interval's (0.95: 95%)."""
    change = ratio - 1
    band = f"{level:.0%} interval of the step-time change: {_pct(lo - 1, True)} to {_pct(hi - 1, True)}"
    basis = f"median of {n_b} steps after against {n_a} before, warm-up steps left out"
    if kind == "helped":
        return (f"The change helped: steps are {_pct(-change)} faster ({1 / ratio:.2f}x), "
                f"well outside the noise ({band}; {basis}).")
    if kind == "hurt":
        return (f"The change made training slower: steps are {_pct(change)} slower, "
                f"outside the noise ({band}; {basis}).")
    if kind == "fragile_win":
        return (f"Steps look {_pct(-change)} faster, but the gain is within the noise ({band}; {basis}): "
                "treat it as fragile and measure longer runs before relying on it.")
    if kind == "fragile_loss":
        return (f"Steps look {_pct(change)} slower, but the difference is within the noise ({band}; {basis}): "
                "it may not be real; measure longer runs.")
    return f"No clear change: step time moved {_pct(change, True)} ({band}; {basis})."


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


def prediction_check(changes_before: list[dict], changes_after: list[dict], phases, applied: str | None) -> dict | None:
    """The prediction made on BEFORE for the change applied, beside the step AFTER measured.

    The change is the one named, or else the one that fixes the phase whose time fell the
    most (ms per median step). Both sides are the job's profiled steps, the basis of every
    prediction; a run with none has no prediction (BEFORE) or no comparable measurement (AFTER)."""
    changes = {e["change"]: e for e in changes_before}
    inferred = applied is None
    if inferred:
        fell = sorted((r for r in phases or [] if r.get("delta_ms") is not None), key=lambda r: r["delta_ms"])
        if not fell or fell[0]["delta_ms"] >= 0:
            return None
        fixing = [e for e in changes.values() if e.get("fixes") == fell[0]["phase"]]
        if not fixing:
            return None
        applied = max(fixing, key=lambda e: e.get("speedup") or 0.0)["change"]
    e = changes.get(applied)
    out = {"change": applied, "inferred": inferred, "description": e["description"] if e else None,
           "baseline_step_ms": e["baseline_step_ms"] if e else None,
           "predicted_step_ms": e.get("predicted_step_ms") if e else None,
           "measured_step_ms": changes_after[0]["baseline_step_ms"] if changes_after else None, "error": None}
    how = "inferred from the phase that fell the most" if inferred else "as given"
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
