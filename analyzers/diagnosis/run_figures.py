"""What a run is and how fast it went, as the diagnosis states it once for every consumer
(the report, `diag compare` and its gate): the run's identity (what must match for two runs
to be compared), its steady step time as a level (steady.level: what a comparison with
another run needs), and its throughput.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import numpy as np

from diag.analyzers.analysis_types import RankFacts
from diag.analyzers.diagnosis.inputs import Ranks, Steps, mean, num, recorded_model
from diag.analyzers.diagnosis.steady import level
from diag.analyzers.diagnosis.verdict import measured_steps


def run_figures(ranks: Ranks, job: Steps, world: int | None) -> dict:
    """{"identity", "step_time", "throughput"} of the job's merged ranks and its steps."""
    return {"identity": identity(ranks, world), "step_time": step_time(steady_durations(ranks, job)),
            "throughput": throughput(ranks, job)}


def steady_durations(ranks: Ranks, job: Steps) -> list[float]:
    """The job's step times (s) from the first step every rank's measurements count: the one
    warm-up cut, the verdict's own (verdict.measured_steps)."""
    firsts = [f for f in (measured_steps(r.facts)["first"] for r in ranks.values()) if f is not None]
    keep = ~np.isnan(job.dur) & (job.dur > 0)
    if firsts:
        keep &= job.step >= max(firsts)
    return [float(x) for x in job.dur[keep]]


# What must match for two runs to be compared.
IDENTITY_KEYS = ("world size", "device", "model", "batch")


def identity(ranks: Ranks, world: int | None) -> dict:
    """The run's IDENTITY_KEYS: world size, device kind, model, batch."""
    facts = next((m for r in ranks.values() if (m := recorded_model(r.facts)) is not None), None) or {}
    kinds = sorted({str(r.device) for r in ranks.values() if r.device})
    return {
        "world size": world,
        "device": ", ".join(kinds) or None,
        "model": f"{facts['class']} with {facts['params']:,} parameters" if facts.get("class") and
        isinstance(facts.get("params"), int) and not isinstance(facts.get("params"), bool) else None,
        "batch": _batch([r.facts for r in ranks.values()]),
    }


def _batch(ranks: list[RankFacts]) -> float | None:
    """Samples per step, summed over ranks (the median of each rank's recorded steps)."""
    per_rank = []
    for facts in ranks:
        steps: list[Mapping[str, object]] = list(facts.steps)  # a trace's steps count no samples
        samples = [num(s.get("samples")) for s in steps]
        samples = [x for x in samples if x is not None and x > 0]
        if samples:
            per_rank.append(statistics.median(samples))
    return sum(per_rank) if per_rank else None


def step_time(steady_s: list[float]) -> dict | None:
    """The steady steps' level (steady.level, in ms) and their spread; None without any."""
    ms = [t * 1e3 for t in steady_s]
    lv = level(ms)
    if lv is None:
        return None
    arr = np.asarray(ms)
    med = lv.pop("median")
    return {**lv, "median_ms": med, "mad_ms": float(np.median(np.abs(arr - med))),
            "p10_ms": float(np.percentile(arr, 10)), "p90_ms": float(np.percentile(arr, 90))}


def as_level(step: dict | None) -> dict | None:
    """A run's step_time figure as the level steady.levels_ratio_interval reads."""
    return None if not step else {"steps": step["steps"], "median": step["median_ms"],
                                  "relative_se": step["relative_se"], "drift": step["drift"]}


def throughput(ranks: Ranks, job: Steps) -> dict:
    """Job throughput: units summed over ranks per step, over the job's (slowest rank's) step time."""
    m = ~np.isnan(job.dur)
    out: dict[str, float | None] = {"steps_per_s": None, "samples_per_s": None, "tokens_per_s": None, "mfu": None}
    if not m.any():
        return out
    total = float(job.dur[m].sum())
    out["steps_per_s"] = int(m.sum()) / total
    for key, col in (("samples_per_s", job.samples[m]), ("tokens_per_s", job.tokens[m])):
        if np.nansum(col) > 0:
            out[key] = float(np.nansum(col)) / total
    mfu = job.mfu[m & ~np.isnan(job.mfu)]
    if len(mfu):
        out["mfu"] = float(mfu.mean())
    else:
        out["mfu"] = mean([v for v in (num(r.facts.mfu) for r in ranks.values()) if v is not None])
    return out
