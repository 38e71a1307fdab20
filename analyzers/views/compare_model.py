"""Before/after comparison of two runs (`diag compare RUN_A RUN_B`): pure functions on report models.

Whether the change helped is decided on the job's step times (per step, the slowest
rank's duration), after the warm-up steps, with a noise band:

* the point estimate is the ratio of median step times, after / before;
* the noise band is a 95% bootstrap confidence interval of that ratio (each run's steps
  resampled with replacement, 2,000 times, fixed seed so the report is reproducible);
* the change "helped" when the whole interval lies below 1 - MIN_EFFECT (and "hurt" when
  it lies above 1 + MIN_EFFECT); a point estimate beyond MIN_EFFECT whose interval still
  crosses that band is a "fragile" win or loss: it may be noise; otherwise "no clear change".

Median +/- MAD (median absolute deviation) of each run is shown beside it, so a reader sees
how spread the steps are. Scaling efficiency, when the world sizes differ, comes from
`diag.analyzers.diagnosis.scaling.scaling_efficiency` when the analysis documents are given, and
otherwise from per-rank throughput (samples, tokens or steps per second per rank) at the
larger world size over that at the smaller one.
"""

from __future__ import annotations

import numpy as np

from diag.analyzers.diagnosis.inputs import PHASES
from diag.analyzers.diagnosis.scaling import scaling_efficiency
from diag.errors import DiagInputError

COMPARE_SCHEMA = "diag.compare/1"
MIN_EFFECT = 0.01  # changes under 1% of step time are not called wins or losses
BOOTSTRAP = 2000
SEED = 20240611
MAX_WARMUP = 20


def warmup_cut(n: int) -> int:
    """Steps left out at the start: the first 10%, at most MAX_WARMUP, none for very short runs."""
    return 0 if n < 10 else min(MAX_WARMUP, n // 10)


def step_times(model: dict) -> np.ndarray:
    t = np.asarray([x for x in model.get("step_times_s") or [] if x and x > 0], dtype=float)
    return t[warmup_cut(len(t)):]


def _mad(x: np.ndarray) -> float:
    return float(np.median(np.abs(x - np.median(x)))) if len(x) else float("nan")


def noise_band(before: np.ndarray, after: np.ndarray, n: int = BOOTSTRAP, seed: int = SEED,
               level: float = 0.95) -> tuple[float, float, float]:
    """(ratio of medians after/before, CI low, CI high) by bootstrap resampling of both runs."""
    ratio = float(np.median(after) / np.median(before))
    rng = np.random.default_rng(seed)
    # Resample in chunks to bound memory on long runs.
    lows, out = (1 - level) / 2, []
    chunk = max(1, 4_000_000 // max(len(before), len(after)))
    done = 0
    while done < n:
        k = min(chunk, n - done)
        b = np.median(before[rng.integers(0, len(before), (k, len(before)))], axis=1)
        a = np.median(after[rng.integers(0, len(after), (k, len(after)))], axis=1)
        out.append(a / b)
        done += k
    r = np.concatenate(out)
    return ratio, float(np.quantile(r, lows)), float(np.quantile(r, 1 - lows))


def verdict_of_change(ratio: float, lo: float, hi: float) -> str:
    if hi < 1 - MIN_EFFECT:
        return "helped"
    if lo > 1 + MIN_EFFECT:
        return "hurt"
    if ratio < 1 - MIN_EFFECT:
        return "fragile_win"
    if ratio > 1 + MIN_EFFECT:
        return "fragile_loss"
    return "no_change"


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%"


def statement(kind: str, ratio: float, lo: float, hi: float, n_a: int, n_b: int) -> str:
    """The plain sentence a reader takes away."""
    change = ratio - 1
    band = f"95% interval of the step-time change: {_pct(lo - 1, True)} to {_pct(hi - 1, True)}"
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


def compare(model_a: dict, model_b: dict, doc_a: dict | None = None, doc_b: dict | None = None,
            tree=None, applied: str | None = None) -> dict:
    """The comparison model of run A (before) and run B (after)."""
    ta, tb = step_times(model_a), step_times(model_b)
    runs = [_run_summary(model_a, ta), _run_summary(model_b, tb)]
    out: dict = {"schema": COMPARE_SCHEMA, "before": runs[0], "after": runs[1], "missing": []}
    if len(ta) >= 3 and len(tb) >= 3:
        ratio, lo, hi = noise_band(ta, tb)
        kind = verdict_of_change(ratio, lo, hi)
        out["step_time"] = {
            "ratio": ratio, "ci_low": lo, "ci_high": hi, "change": ratio - 1, "result": kind,
            "statement": statement(kind, ratio, lo, hi, len(ta), len(tb)),
            "method": f"bootstrap 95% CI of the ratio of median step times ({BOOTSTRAP} resamples); "
                      f"changes under {MIN_EFFECT:.0%} are not called wins",
        }
    else:
        out["step_time"] = None
        out["missing"].append("Too few steps to compare step times (at least 3 after warm-up in each run).")
    out["phases"] = _phase_changes(model_a, model_b)
    out["verdict_change"] = _verdict_change(model_a, model_b)
    out["throughput"] = _throughput_change(model_a, model_b)
    out["scaling"] = _scaling(model_a, model_b, doc_a, doc_b, tree)
    out["prediction"] = prediction_check(model_a, model_b, out["phases"], applied)
    out["headline"] = _headline(out)
    return out


def prediction_check(model_a: dict, model_b: dict, phases, applied: str | None) -> dict | None:
    """The prediction made on BEFORE for the change applied, beside the step AFTER measured.

    The change is the one named, or else the one that fixes the phase whose time fell the
    most (ms per median step). Both sides are the job's profiled steps, the basis of every
    prediction; a run with none has no prediction (BEFORE) or no comparable measurement (AFTER)."""
    changes = {e["change"]: e for e in (model_a.get("what_if") or {}).get("changes") or []}
    after = (model_b.get("what_if") or {}).get("changes") or []
    inferred = applied is None
    if inferred:
        fell = sorted((r for r in phases or [] if r.get("delta_ms") is not None), key=lambda r: r["delta_ms"])
        if not fell or fell[0]["delta_ms"] >= 0:
            return None
        cls = fell[0]["phase"]
        fixing = [e for e in changes.values() if e.get("fixes") == cls]
        if not fixing:
            return None
        applied = max(fixing, key=lambda e: e.get("speedup") or 0.0)["change"]
    e = changes.get(applied)
    out = {"change": applied, "inferred": inferred, "description": e["description"] if e else None,
           "baseline_step_ms": e["baseline_step_ms"] if e else None,
           "predicted_step_ms": e.get("predicted_step_ms") if e else None,
           "measured_step_ms": after[0]["baseline_step_ms"] if after else None, "error": None}
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


def _run_summary(model: dict, t: np.ndarray) -> dict:
    run = model.get("run") or {}
    return {
        "name": run.get("name"), "path": run.get("path"), "world_size": run.get("world_size"),
        "bound": model.get("bound"), "headline": (model.get("headline") or {}).get("text"),
        "confidence": (model.get("confidence") or {}).get("level"),
        "steps": int(len(t)),
        "median_ms": float(np.median(t)) * 1000 if len(t) else None,
        "mad_ms": _mad(t) * 1000 if len(t) else None,
        "p10_ms": float(np.percentile(t, 10)) * 1000 if len(t) else None,
        "p90_ms": float(np.percentile(t, 90)) * 1000 if len(t) else None,
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
    for p in PHASES:
        # A run analysed before the wait split has no "wait": its waiting is inside comm.
        before, after = sa.get(p) or 0.0, sb.get(p) or 0.0
        row = {"phase": p, "before": before, "after": after, "delta": after - before}
        if ma and mb:
            # Milliseconds of a median step spent in the phase: shows where the time was won or lost.
            row["before_ms"], row["after_ms"] = before * ma, after * mb
            row["delta_ms"] = row["after_ms"] - row["before_ms"]
        rows.append(row)
    return rows


def _verdict_change(a: dict, b: dict) -> dict:
    ba, bb = a.get("bound"), b.get("bound")
    if ba == bb:
        text = f"The verdict is unchanged: {ba}-bound in both runs." if ba else "Neither run has a verdict."
    elif ba and bb:
        text = (f"The verdict changed from {ba}-bound to {bb}-bound: the change removed the old bottleneck "
                f"and {bb} is now what limits the step.")
    else:
        text = f"Only one run has a verdict ({ba or bb}-bound)."
    return {"before": ba, "after": bb, "changed": ba != bb, "text": text}


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
    if doc_a and doc_b:
        try:
            r = scaling_efficiency(doc_a, doc_b, tree=tree)
        except DiagInputError:  # the documents cannot be compared this way: the report models below can
            r = None
        if r is not None:
            return {"efficiency": r["efficiency"], "basis": r["basis"], "smaller": r["smaller"]["world_size"],
                    "larger": r["larger"]["world_size"], "speedup": r.get("speedup"),
                    "ideal_speedup": r.get("ideal_speedup"), "findings": r.get("findings") or [],
                    "source": "diag.analyzers.diagnosis.scaling.scaling_efficiency",
                    "text": _scaling_text(r["efficiency"], r["smaller"]["world_size"],
                                          r["larger"]["world_size"], r["basis"])}
    (ra, ua), (rb, ub) = _per_rank_rate(a), _per_rank_rate(b)
    if ra is None or rb is None:
        return None
    if ua != ub:
        # Different units: fall back to steps per second (same per-rank batch assumed).
        ra, rb = (a.get("throughput") or {}).get("steps_per_s"), (b.get("throughput") or {}).get("steps_per_s")
        ua = "steps"
        if not ra or not rb:
            return None
    small, large = ((wa, ra), (wb, rb)) if wa < wb else ((wb, rb), (wa, ra))
    eff = large[1] / small[1]
    basis = f"{ua} per second per rank" + (" (assumes the same per-rank batch in both runs)" if ua == "steps" else "")
    return {"efficiency": eff, "basis": basis, "smaller": small[0], "larger": large[0],
            "speedup": eff * large[0] / small[0], "ideal_speedup": large[0] / small[0], "findings": [],
            "source": "report models", "text": _scaling_text(eff, small[0], large[0], basis)}


def _scaling_text(eff: float, small: int, large: int, basis: str) -> str:
    verdict = "good" if eff >= 0.9 else "acceptable" if eff >= 0.7 else "poor: adding ranks buys less than it costs"
    return (f"Scaling efficiency from {small} to {large} ranks is {eff:.0%} ({basis}); {verdict}. "
            f"Ideal would be 100%: {large / small:.2g}x the ranks giving {large / small:.2g}x the throughput.")


def _headline(c: dict) -> str:
    parts = []
    if c.get("step_time"):
        parts.append(c["step_time"]["statement"])
    else:
        parts.append("Step times could not be compared.")
    parts.append(c["verdict_change"]["text"])
    if c.get("scaling"):
        parts.append(c["scaling"]["text"])
    return " ".join(parts)
