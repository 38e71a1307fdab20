"""What a DataLoader's worker count does to a step, from rates the run measured.

A loader without workers produces each batch on the training thread, inside the step: its
data wait is the time one batch takes to read and collate, and the process's CPU time during
that wait says whether producing it is CPU work or a wait on something else (storage, the
network). With k workers the batches are made in parallel with the step, so in steady state

    step(k) = max(rest of the step, batch time / k, CPU work per step / CPUs of the rank)

the first term being the step with the input fully hidden (the ceiling), the second the
workers' pace, the third what the rank's CPUs can do when the workers' CPU work and the
training process's own share them. Taking each batch from a worker costs the training
process `loader_handover_ms` that a run without workers did not spend. A thread runs slower
as the other CPUs get busy wherever CPUs share a core or a host (hyperthreads, a VM's vCPUs:
two busy processes each ran 1.45x slower than one alone on the 2-vCPU machine the fix bank
ran on): each thread's CPU work is stretched in proportion to how busy the others are, by
`cpu_shared_throughput` when all are. Reads that wait use no CPU, so their workers are not
bounded by the CPU count; CPU-bound reads are (one CPU stays with the training process).
A loader that already has workers and still keeps the step waiting is rate-limited by
them: each worker takes about k times the step to make a batch.

The worker count named is the fewest that hides the input with `loader_worker_headroom`
to spare, within what the machine allows; the prediction is for that count, with its range:
`loader_model_margin` above it, and on both sides how far the median of the rest of the
step may land in another run (its 95% interval and the run's own drift).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from diag.analyzers.diagnosis.steady import level_drift, median_half_width, warmup_steps
from diag.analyzers.numbers import finite as _num


@dataclass(frozen=True)
class LoaderRates:
    """One rank's measured loader figures, medians over its steady untraced steps (ms)."""
    step_ms: float  # the step as measured
    wait_ms: float  # its data wait
    rest_ms: float  # the step less its data wait: what the step costs with the input hidden
    batch_ms: float  # one worker's time to make one batch
    batch_cpu_ms: float | None  # of it, CPU time (None: not measured)
    rest_cpu_ms: float | None  # the process's CPU time in the rest of the step
    rest_spread_ms: float  # how far the rest of the step's median may land in another run: its 95%
    # interval, widened by the run's own drift (steady.median_half_width, steady.level_drift)
    steps: int  # how many steps these rest on
    workers: int = 0  # the workers the run had (0: batches made in the training process)


@dataclass(frozen=True)
class WorkerPlan:
    workers: int  # the count to set
    needed: int  # the count that hides the input with `loader_worker_headroom` to spare
    hides: bool  # whether that count hides the input (else the most the machine allows)
    cpu_bound: bool  # producing a batch is CPU work
    cap: int  # the most workers the rank's CPUs allow for these reads
    expected_ms: float  # the step predicted with `workers`
    low_ms: float  # the range the measured step should fall in
    high_ms: float
    ceiling_ms: float  # the step with the input fully hidden
    limit: str  # what sets expected_ms: "rest", "workers" or "cpus"


def loader_rates(steps: list, workers: int, thresholds: dict, workers_cpu: float | None = None) -> LoaderRates | None:
    """The rates of one rank from its analysed steps (data_wait_ms, duration_ms and, where the
    agent measured them, cpu_ms and data_cpu_ms); None with fewer than three usable steps.
    `workers_cpu`: the CPUs the run's workers used (its samples), for a loader with workers.
    Traced steps are left out (the profiler slows the step's own work), unless no other is
    left; so is warm-up, which holds the workers' start and the first batches."""
    measured = [(s, _num(s.get("duration_ms")), _num(s.get("data_wait_ms"))) for s in steps if isinstance(s, dict)]
    rows = [(s, d, w) for s, d, w in measured if d and w is not None]
    rows = rows[warmup_steps(len(rows), thresholds):]
    plain = [row for row in rows if row[0].get("evidence") != "trace"]
    rows = plain if len(plain) >= 3 else rows
    if len(rows) < 3:
        return None
    dur = [d for _, d, _ in rows]
    wait = [min(w, d) for _, d, w in rows]
    rest = [d - w for d, w in zip(dur, wait)]
    step_ms, wait_ms, rest_ms = statistics.median(dur), statistics.median(wait), statistics.median(rest)
    cpu_read = [(_num(s.get("data_cpu_ms")), _num(s.get("cpu_ms"))) for s, _, _ in rows]
    cpu_rows = [(wc, c) for wc, c in cpu_read if wc is not None and c is not None]
    batch_cpu = rest_cpu = None
    if len(cpu_rows) >= 3:
        batch_cpu = statistics.median(wc for wc, _ in cpu_rows)
        rest_cpu = statistics.median(max(c - wc, 0.0) for wc, c in cpu_rows)
    if workers > 0:
        # Workers that keep the step waiting set its pace: each makes a batch in k steps, and
        # their CPU time per batch is what they use while the step consumes one.
        batch_ms = step_ms * workers
        batch_cpu = workers_cpu * step_ms if workers_cpu is not None else None
    else:
        batch_ms = wait_ms
    return LoaderRates(step_ms=step_ms, wait_ms=wait_ms, rest_ms=rest_ms, batch_ms=batch_ms, batch_cpu_ms=batch_cpu,
                       rest_cpu_ms=rest_cpu, rest_spread_ms=_spread(rest, rest_ms), steps=len(rows), workers=workers)


def _spread(values: list[float], median: float) -> float:
    return (median_half_width(values) or 0.0) + (level_drift(values) or 0.0) * median


def predicted_step(rates: LoaderRates, workers: int, cpus: float | None, cpu_bound: bool = False,
                   thread_speed: float = 1.0, handover_ms: float = 0.0) -> tuple[float, str]:
    """(the steady step with `workers` workers, what sets it), each busy thread running at
    `thread_speed` of its speed alone (1.0: the CPUs run in parallel at full speed), on `cpus`
    CPUs' worth of time (what other processes leave of the rank's CPUs)."""
    slow = 1.0 / thread_speed - 1.0  # the extra time of a unit of CPU work on busy CPUs
    handover = _new_handover(rates, workers, handover_ms)
    rest, rest_cpu = rates.rest_ms + handover, (rates.rest_cpu_ms or 0.0) + handover
    batch_cpu = _batch_cpu(rates, cpu_bound)
    terms = [(rest + rest_cpu * slow, "rest"),
             ((rates.batch_ms + batch_cpu * slow) / max(workers, 1), "workers")]
    if cpus and rates.batch_cpu_ms is not None and rates.rest_cpu_ms is not None:
        terms.append(((rest_cpu + rates.batch_cpu_ms) / (cpus * thread_speed), "cpus"))
    return max(terms)


def _new_handover(rates: LoaderRates, workers: int, handover_ms: float) -> float:
    """The hand-over of each batch (the batch's tensors through shared memory) that the run's
    rest of the step does not hold already: a run without workers never paid it."""
    return handover_ms if workers > 0 and rates.workers == 0 else 0.0


def _batch_cpu(rates: LoaderRates, cpu_bound: bool) -> float:
    """A batch's CPU time: measured, else all of it where making it is CPU work."""
    if rates.batch_cpu_ms is not None:
        return rates.batch_cpu_ms
    return rates.batch_ms if cpu_bound else 0.0


def busy_thread_speed(cpus: int | None, thresholds: dict) -> float:
    """How fast each busy thread runs when every CPU is busy, from `cpu_shared_throughput`: the
    throughput each further busy CPU adds (hyperthreads of one core, a VM's vCPUs on a busy host)."""
    if not cpus or cpus < 2:
        return 1.0
    return (1.0 + (cpus - 1) * thresholds["cpu_shared_throughput"]) / cpus


def cpus_per_rank(loader: dict) -> int | None:
    """The CPUs each local rank of a loader's process may use (its recorded CPUs over its local ranks)."""
    cpus, local = loader.get("cpus"), loader.get("local_ranks") or 1
    return cpus // local if isinstance(cpus, int) and cpus > 0 and isinstance(local, int) and local > 0 else None


def expectation(rates: LoaderRates, workers: int, cpus: int | None, thresholds: dict, cpu_bound: bool = False,
                host_cpus: int | None = None, foreign_cpus: float = 0.0) -> tuple[float, float, float, str]:
    """(the step expected with `workers` workers, the low and high ends of its range, what sets it).
    Each thread runs slower as the host's other CPUs get busy: at `busy_thread_speed` with all of
    them busy, in proportion between; how busy they are is the CPU work of the host's ranks at
    the pace expected with every CPU at full speed, and `foreign_cpus`, the CPUs other processes
    kept busy during the run, which the rank's CPUs share in proportion. The range reaches up to
    every CPU busy."""
    handover = thresholds["loader_handover_ms"]
    host = host_cpus or cpus
    extra = _new_handover(rates, workers, handover)
    ideal, _ = predicted_step(rates, workers, cpus, cpu_bound, 1.0, handover)
    left = _cpus_left(cpus, host, _host_demand(rates, ideal, cpus, host, cpu_bound, extra), foreign_cpus)
    if left != cpus:
        ideal, _ = predicted_step(rates, workers, left, cpu_bound, 1.0, handover)
    full = busy_thread_speed(host, thresholds)
    speed = 1.0 - (1.0 - full) * _others_busy(rates, ideal, cpus, host, cpu_bound, extra, foreign_cpus)
    expected, limit = predicted_step(rates, workers, left, cpu_bound, speed, handover)
    all_busy, _ = predicted_step(rates, workers, left, cpu_bound, full, handover)
    spread = rates.rest_spread_ms
    return (expected, max(rates.rest_ms - spread, 0.0),
            max(expected, all_busy) * (1.0 + thresholds["loader_model_margin"]) + spread, limit)


def _cpus_left(cpus: int | None, host: int | None, demand: float, foreign_cpus: float) -> float | None:
    """The rank's CPUs as the job gets them beside other processes keeping `foreign_cpus` busy:
    all of them while the job's `demand` and theirs fit the host, else the host's CPUs shared in
    proportion to what each asks (the scheduler shares time among busy threads)."""
    if not cpus or not host or foreign_cpus <= 0 or demand + foreign_cpus <= host:
        return cpus
    return cpus * host / (demand + foreign_cpus) if demand > 0 else cpus


def _host_demand(rates: LoaderRates, step_ms: float, cpus: int | None, host: int | None, cpu_bound: bool,
                 extra_cpu_ms: float = 0.0) -> float:
    """The CPUs the host's ranks (host CPUs / CPUs per rank of them) keep busy, each doing its
    step's CPU work (and `extra_cpu_ms`) every `step_ms`."""
    if not host or step_ms <= 0:
        return 0.0
    ranks = max(1, host // cpus) if cpus else 1
    return ranks * ((rates.rest_cpu_ms or 0.0) + extra_cpu_ms + _batch_cpu(rates, cpu_bound)) / step_ms


def _others_busy(rates: LoaderRates, step_ms: float, cpus: int | None, host: int | None, cpu_bound: bool,
                 extra_cpu_ms: float = 0.0, foreign_cpus: float = 0.0) -> float:
    """How busy the host's CPUs other than a thread's own are, 0 to 1, with its ranks' demand
    (_host_demand) and `foreign_cpus` kept busy by other processes."""
    if not host or host < 2 or step_ms <= 0:
        return 0.0
    demand = _host_demand(rates, step_ms, cpus, host, cpu_bound, extra_cpu_ms)
    return min(max((demand + max(foreign_cpus, 0.0) - 1.0) / (host - 1), 0.0), 1.0)


def batch_is_cpu_work(rates: LoaderRates, thresholds: dict) -> bool:
    """Whether making a batch is CPU work: its CPU time is `loader_cpu_bound_share` of its wall
    time or more. Unmeasured CPU use is taken as CPU work: the bound that can not overpromise."""
    return rates.batch_cpu_ms is None or rates.batch_ms <= 0 or \
        rates.batch_cpu_ms >= thresholds["loader_cpu_bound_share"] * rates.batch_ms


def plan_workers(rates: LoaderRates, cpus_per_rank: int | None, thresholds: dict,
                 cpu_bound: bool | None = None, host_cpus: int | None = None, foreign_cpus: float = 0.0) -> WorkerPlan:
    """The worker count to name and the step it gives; `cpu_bound` says whether making a batch
    is CPU work where something else measured it (the workers' sampled CPU use), else the
    CPU time of the waits tells."""
    if cpu_bound is None:
        cpu_bound = batch_is_cpu_work(rates, thresholds)
    cap = max(1, cpus_per_rank - 1) if cpu_bound and cpus_per_rank else int(thresholds["loader_max_workers"])
    needed = max(1, math.ceil(thresholds["loader_worker_headroom"] * rates.batch_ms / max(rates.rest_ms, 1e-6)))
    workers = min(needed, cap)
    expected, low, high, limit = expectation(rates, workers, cpus_per_rank, thresholds, cpu_bound, host_cpus,
                                             foreign_cpus)
    return WorkerPlan(workers=workers, needed=needed, hides=needed <= cap, cpu_bound=cpu_bound, cap=cap,
                      expected_ms=expected, low_ms=low, high_ms=high, ceiling_ms=rates.rest_ms, limit=limit)
