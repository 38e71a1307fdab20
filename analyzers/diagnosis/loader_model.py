"""What a DataLoader's worker count does to a step, from rates the run measured.

A loader without workers produces each batch on the training thread, inside the step: its
data wait is the time one batch takes to read and collate, and the process's CPU time during
that wait says whether producing it is CPU work or a wait on something else (storage, the
network). With k workers the batches are made in parallel with the step, so in steady state

    step(k) = max(rest of the step, batch time / k, CPU work per step / CPUs of the rank)

the first term being the step with the input fully hidden (the ceiling), the second the
workers' pace, the third what the rank's CPUs can do when the workers' CPU work and the
training process's own share them. Reads that wait use no CPU, so their workers are not
bounded by the CPU count; CPU-bound reads are (one CPU stays with the training process).
A loader that already has workers and still keeps the step waiting is rate-limited by
them: each worker takes about k times the step to make a batch.

The worker count named is the fewest that hides the input with `loader_worker_headroom`
to spare, within what the machine allows; the prediction is for that count, with its
range from the run's own step scatter and `loader_model_margin`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from diag.analyzers.diagnosis.steady import robust_sigma, warmup_steps


@dataclass(frozen=True)
class LoaderRates:
    """One rank's measured loader figures, medians over its steady untraced steps (ms)."""
    step_ms: float  # the step as measured
    wait_ms: float  # its data wait
    rest_ms: float  # the step less its data wait: what the step costs with the input hidden
    batch_ms: float  # one worker's time to make one batch
    batch_cpu_ms: float | None  # of it, CPU time (None: not measured)
    rest_cpu_ms: float | None  # the process's CPU time in the rest of the step
    rest_sigma_ms: float  # the step-to-step scatter of the rest of the step
    steps: int  # how many steps these rest on


@dataclass(frozen=True)
class WorkerPlan:
    workers: int  # the count to set
    hides: bool  # whether that count hides the input (else the most the machine allows)
    cpu_bound: bool  # producing a batch is CPU work
    cap: int  # the most workers the rank's CPUs allow for these reads
    expected_ms: float  # the step predicted with `workers`
    low_ms: float  # the range the measured step should fall in
    high_ms: float
    ceiling_ms: float  # the step with the input fully hidden
    limit: str  # what sets expected_ms: "rest", "workers" or "cpus"


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def loader_rates(steps: list, workers: int, thresholds: dict) -> LoaderRates | None:
    """The rates of one rank from its analysed steps (data_wait_ms, duration_ms and, where the
    agent measured them, cpu_ms and data_cpu_ms); None with fewer than three usable steps.
    Traced steps are left out (the profiler slows the step's own work), unless no other is
    left; so is warm-up, which holds the workers' start and the first batches."""
    rows = [s for s in steps if isinstance(s, dict) and _num(s.get("duration_ms")) and
            _num(s.get("data_wait_ms")) is not None]
    rows = rows[warmup_steps(len(rows), thresholds):]
    plain = [s for s in rows if s.get("evidence") != "trace"]
    rows = plain if len(plain) >= 3 else rows
    if len(rows) < 3:
        return None
    dur = [_num(s["duration_ms"]) for s in rows]
    wait = [min(_num(s["data_wait_ms"]), d) for s, d in zip(rows, dur)]
    rest = [d - w for d, w in zip(dur, wait)]
    step_ms, wait_ms, rest_ms = statistics.median(dur), statistics.median(wait), statistics.median(rest)
    cpu_rows = [(_num(s.get("data_cpu_ms")), _num(s.get("cpu_ms"))) for s in rows]
    cpu_rows = [(wc, c) for wc, c in cpu_rows if wc is not None and c is not None]
    batch_cpu = rest_cpu = None
    if len(cpu_rows) >= 3:
        batch_cpu = statistics.median(wc for wc, _ in cpu_rows)
        rest_cpu = statistics.median(max(c - wc, 0.0) for wc, c in cpu_rows)
    if workers > 0:
        # Workers that keep the step waiting set its pace: each makes a batch in k steps.
        batch_ms, batch_cpu = step_ms * workers, None
    else:
        batch_ms = wait_ms
    return LoaderRates(step_ms=step_ms, wait_ms=wait_ms, rest_ms=rest_ms, batch_ms=batch_ms, batch_cpu_ms=batch_cpu,
                       rest_cpu_ms=rest_cpu, rest_sigma_ms=robust_sigma(rest) or 0.0, steps=len(rows))


def predicted_step(rates: LoaderRates, workers: int, cpus: int | None) -> tuple[float, str]:
    """(the steady step with `workers` workers, what sets it)."""
    terms = [(rates.rest_ms, "rest"), (rates.batch_ms / max(workers, 1), "workers")]
    if cpus and rates.batch_cpu_ms is not None and rates.rest_cpu_ms is not None:
        terms.append(((rates.rest_cpu_ms + rates.batch_cpu_ms) / cpus, "cpus"))
    return max(terms)


def plan_workers(rates: LoaderRates, cpus_per_rank: int | None, thresholds: dict,
                 cpu_bound: bool | None = None) -> WorkerPlan:
    """The worker count to name and the step it gives; `cpu_bound` says whether making a batch
    is CPU work where something else measured it (the workers' sampled CPU use), else the
    CPU time of the waits tells."""
    if cpu_bound is None:
        # Unmeasured CPU use is taken as CPU work: the bound that can not overpromise.
        cpu_bound = rates.batch_cpu_ms is None or rates.batch_ms <= 0 or \
            rates.batch_cpu_ms >= thresholds["loader_cpu_bound_share"] * rates.batch_ms
    cap = max(1, cpus_per_rank - 1) if cpu_bound and cpus_per_rank else int(thresholds["loader_max_workers"])
    needed = max(1, math.ceil(thresholds["loader_worker_headroom"] * rates.batch_ms / max(rates.rest_ms, 1e-6)))
    workers = min(needed, cap)
    expected, limit = predicted_step(rates, workers, cpus_per_rank)
    ceiling = rates.rest_ms
    spread = 2.0 * rates.rest_sigma_ms
    return WorkerPlan(workers=workers, hides=needed <= cap, cpu_bound=cpu_bound, cap=cap, expected_ms=expected,
                      low_ms=max(ceiling - spread, 0.0),
                      high_ms=expected * (1.0 + thresholds["loader_model_margin"]) + spread,
                      ceiling_ms=ceiling, limit=limit)
