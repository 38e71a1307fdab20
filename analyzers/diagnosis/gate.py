"""The regression gate of `diag compare BEFORE AFTER --gate`: did AFTER get worse than BEFORE
beyond the runs' own noise, and may the two be compared at all?

Runs are comparable when they have the same world size, the same device kind, the same model
(class and parameter count from the agent's model facts) and the same batch (samples per
step); otherwise the gate says which differ and gives no pass or fail.

Tracked figures, each against its noise band and its limit (`--max-slowdown`, else
`gate_max_slowdown`). The band is the interval (`noise_interval_z`) of the two runs' levels:
each median's robust standard error and each run's own drift (the spread of the medians of
its quarters, steady.level_drift). Drift matters: on a shared machine two runs of the same
code differ by more than their step-to-step scatter says, and about as much as each run's
pace wanders within itself.
- step time: worse when the whole interval of median(after) / median(before) lies above
  1 + limit;
- throughput and MFU: the run's rate, whose interval is the step time's inverted (the same
  work per step, as comparability requires): worse when it lies wholly below 1 - limit;
- each phase (data, host, comm, wait, memory, compute) in milliseconds of a step: worse when
  the whole interval of its growth lies above `limit` of BEFORE's median step, so a phase
  that takes the time another gave back is no regression of the step.
Pure: two runs' diagnoses (their run figures) and analysis documents in, new values out.
"""

from __future__ import annotations

import statistics

from diag.analyzers.analysis_types import Analysis
from diag.analyzers.diagnosis import change
from diag.analyzers.diagnosis.inputs import CLASSES
from diag.analyzers.diagnosis.run_figures import IDENTITY_KEYS, as_level
from diag.analyzers.diagnosis.steady import level_drift, median_standard_error
from diag.diagnosis_document import Diagnosis

GATE_SCHEMA = "diag.gate/1"
PASS, REGRESSION, NOT_COMPARABLE = "pass", "regression", "not_comparable"
EXIT_STATUS = {PASS: 0, REGRESSION: 1, NOT_COMPARABLE: 2}


def _figures(diagnosis: Diagnosis | None) -> dict:
    """A diagnosis's run figures (diagnosis/run_figures.py): identity, step time, throughput."""
    return diagnosis.run_figures if diagnosis is not None else {}


def run_identity(diagnosis: Diagnosis | None) -> dict:
    """What must match for two runs to be compared: world size, device kind, model, batch."""
    ident = _figures(diagnosis).get("identity")
    return dict(ident) if isinstance(ident, dict) else dict.fromkeys(IDENTITY_KEYS)


def differences(before: dict, after: dict) -> list[str]:
    """Why two runs' identities do not allow a comparison (empty: they do). A fact one run
    lacks is no difference: it cannot be checked, and the gate says so in its notes."""
    out = []
    for key, a in before.items():
        b = after.get(key)
        if a is not None and b is not None and a != b:
            out.append(f"{key}: {_shown(a)} before, {_shown(b)} after")
    return out


def _shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def comparison(diag_a: Diagnosis | None, diag_b: Diagnosis | None, tree, scaling: bool = False) -> dict:
    """What `diag compare` and the gate both judge, once, from the two runs' diagnoses: the
    runs' identities, the notes on what neither could check, why they may not be compared
    ("differences"), each run's steady step time, and the step-time change with its one
    interval (None with too few steps, or runs that may not be compared).

    scaling: two world sizes are the point (a scaling study), so the world size and the
    job's batch may differ where the batch per rank does not."""
    ident_a, ident_b = run_identity(diag_a), run_identity(diag_b)
    notes = [f"{k} is not recorded in {'BEFORE' if ident_a[k] is None else 'AFTER'}: not checked"
             for k in ident_a if ident_a[k] is None or ident_b.get(k) is None]
    if scaling:
        per_rank = [{"batch per rank": _per_rank(i["batch"], i["world size"])} for i in (ident_a, ident_b)]
        ident_a, ident_b = ({k: v for k, v in i.items() if k not in ("world size", "batch")} | p
                            for i, p in zip((ident_a, ident_b), per_rank))
    reasons = differences(ident_a, ident_b)
    sa, sb = _figures(diag_a).get("step_time"), _figures(diag_b).get("step_time")
    na, nb = (s["steps"] if s else 0 for s in (sa, sb))
    few = na < change.MIN_STEPS or nb < change.MIN_STEPS
    return {"before": ident_a, "after": ident_b, "notes": notes, "differences": reasons,
            "too_few_steps": (f"too few steps after warm-up to compare ({na} before, {nb} after; "
                              f"at least {change.MIN_STEPS} each)") if few else None,
            "step_times": (sa, sb),
            "step_time": None if few or reasons else change.level_change(as_level(sa), as_level(sb), tree)}


def _per_rank(batch: float | None, world: int | None) -> float | None:
    return batch / world if isinstance(batch, (int, float)) and isinstance(world, int) and world > 0 else None


def gate(doc_a: Analysis, diag_a: Diagnosis, doc_b: Analysis, diag_b: Diagnosis, tree,
         max_slowdown: float | None = None) -> dict:
    """The gate's result ("pass", "regression", "not_comparable"), its exit status, the reasons,
    the figures with their bands, and notes on what could not be checked: the two runs'
    diagnoses, and their analysis documents for the phases of their steps."""
    th = tree.thresholds
    limit = float(th["gate_max_slowdown"] if max_slowdown is None else max_slowdown)
    c = comparison(diag_a, diag_b, tree)
    out = {"schema": GATE_SCHEMA, "limit": limit, "before": c["before"], "after": c["after"], "notes": c["notes"],
           "figures": []}
    reasons = c["differences"] + ([c["too_few_steps"]] if c["too_few_steps"] else [])
    if reasons:
        return {**out, "result": NOT_COMPARABLE, "exit_status": EXIT_STATUS[NOT_COMPARABLE], "reasons": reasons,
                "summary": "diag gate: NOT COMPARABLE: " + "; ".join(reasons)}
    z = float(th["noise_interval_z"])
    sa, sb = c["step_times"]
    st = c["step_time"]
    ratio, lo, hi = st["ratio"], st["ci_low"], st["ci_high"]
    base_ms = sa["median_ms"]
    figures = [_figure("step time", "ms", base_ms, sb["median_ms"], ratio, lo, hi, limit, higher_is_worse=True)]
    for key, name in (("samples_per_s", "throughput"), ("tokens_per_s", "throughput (tokens)"), ("mfu", "MFU")):
        a, b = ((_figures(d).get("throughput") or {}).get(key) for d in (diag_a, diag_b))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
            figures.append(_figure(name, "/s" if key != "mfu" else "", a, b, b / a, 1 / hi, 1 / lo, limit,
                                   higher_is_worse=False))
    figures += _phase_figures(doc_a, doc_b, base_ms, limit, z)
    worse = [f for f in figures if f["worse"]]
    result = REGRESSION if worse else PASS
    head = (f"step time {figures[0]['change']:+.1%} (noise band {figures[0]['band'][0]:+.1%} to "
            f"{figures[0]['band'][1]:+.1%}, limit +{limit:.0%})")
    summary = (f"diag gate: REGRESSION: {', '.join(_worse_text(f) for f in worse)}" if worse
               else f"diag gate: PASS: {head}; no tracked figure worse beyond its noise")
    return {**out, "result": result, "exit_status": EXIT_STATUS[result], "reasons": [_worse_text(f) for f in worse],
            "figures": figures, "summary": summary}


def _figure(name, unit, before, after, ratio, lo, hi, limit, higher_is_worse: bool) -> dict:
    worse = lo > 1 + limit if higher_is_worse else hi < 1 - limit
    return {"name": name, "unit": unit, "before": before, "after": after, "change": ratio - 1,
            "band": [lo - 1, hi - 1], "limit": limit if higher_is_worse else -limit, "worse": bool(worse)}


def _worse_text(f: dict) -> str:
    return (f"{f['name']} {f['change']:+.1%} (noise band {f['band'][0]:+.1%} to {f['band'][1]:+.1%}, "
            f"limit {f['limit']:+.0%})")


def _phase_ms(doc: Analysis) -> dict[str, list[float]]:
    """Per phase, its milliseconds in each analysed rank-step."""
    out: dict[str, list[float]] = {p: [] for p in CLASSES}
    for r in doc.ranks:
        for s in r.facts.steps:
            shares, dur = s.get("shares"), s.get("duration_ms")
            if isinstance(shares, dict) and isinstance(dur, (int, float)) and dur > 0:
                for p in CLASSES:
                    if isinstance(shares.get(p), (int, float)):
                        out[p].append(float(shares[p]) * dur)
    return out


def _phase_figures(doc_a, doc_b, base_ms: float, limit: float, z: float) -> list[dict]:
    """Each phase's growth in ms per step, against `limit` of BEFORE's median step."""
    pa, pb = _phase_ms(doc_a), _phase_ms(doc_b)
    out = []
    for p in CLASSES:
        a, b = pa[p], pb[p]
        if len(a) < change.MIN_STEPS or len(b) < change.MIN_STEPS:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        se = ((median_standard_error(a) or 0.0) ** 2 + (median_standard_error(b) or 0.0) ** 2
              + ((level_drift(a) or 0.0) * ma) ** 2 + ((level_drift(b) or 0.0) * mb) ** 2) ** 0.5
        grow, half = (mb - ma) / base_ms, z * se / base_ms
        out.append({"name": f"{p} phase", "unit": "ms", "before": ma, "after": mb, "change": grow,
                    "band": [grow - half, grow + half], "limit": limit, "worse": bool(grow - half > limit),
                    "relative_to": "BEFORE's median step"})
    return out


def graded_prediction(doc_a: Analysis | None, diag_a: Diagnosis | None, doc_b: Analysis | None, diag_b: Diagnosis | None,
                      applied: str | None, tree) -> dict | None:
    """The prediction made on A, graded against B: refused between runs that train different
    jobs; else the DataLoader change both runs recorded, where there is one; else the what-if
    change named (`applied`, a ceiling); None where nothing was named or recorded."""
    if doc_a is not None and doc_b is not None:
        differ = differences(run_identity(diag_a), run_identity(diag_b))
        if differ:
            return {"change": applied, "kind": "refused", "error": None,
                    "text": "No prediction graded: the runs do not train the same job (" + "; ".join(differ) + ")."}
        if applied is None:
            found = change.loader_check(doc_a, doc_b, tree)
            if found is not None:
                return found
    return change.prediction_check(_what_if(diag_a), _what_if(diag_b), applied)


def _what_if(diagnosis: Diagnosis | None) -> list[dict]:
    changes = diagnosis.what_if.get("changes") if diagnosis is not None else None
    return [e for e in changes or [] if isinstance(e, dict)]
