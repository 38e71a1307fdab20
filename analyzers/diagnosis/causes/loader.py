"""The input pipeline's causes: a DataLoader without workers, and one whose workers cannot keep up,
each with the worker count that would and the step predicted for it (loader_model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diag.analyzers.analysis_types import RankFacts
from diag.analyzers.diagnosis.causes.common import ranks_text, recorded_loaders, upper_median
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import MergedRank
from diag.analyzers.diagnosis.loader_model import (
    LoaderRates,
    WorkerPlan,
    cpus_per_rank,
    loader_rates,
    plan_workers,
)
from diag.analyzers.numbers import finite


def _host_median(merged: MergedRank, key: str) -> float | None:
    """The median of a host sample figure over the rank's samples (None where none has it)."""
    return upper_median([float(s["host"][key]) for s in merged.samples if isinstance(s.get("host"), dict)
                    and isinstance(s["host"].get(key), (int, float)) and not isinstance(s["host"][key], bool)])


def _collate_split(facts: RankFacts) -> tuple[float | None, float | None] | None:
    """(median data wait, median collate time) in ms per step, over the steps that timed both."""
    steps: list[Mapping[str, object]] = list(facts.steps)  # a trace's steps time neither
    rows = [(float(w), float(c)) for s in steps
            if isinstance(w := s.get("data_wait_ms"), (int, float)) and isinstance(c := s.get("collate_ms"), (int, float))]
    return (upper_median([w for w, _ in rows]), upper_median([c for _, c in rows])) if rows else None


def _io_text(merged: MergedRank) -> tuple[str, dict]:
    """What the rank's samples say about reads: the CPUs' I/O wait and the bytes read from
    storage per second by the process and its workers; ("", {}) where they say nothing."""
    ev = {k: _host_median(merged, k) for k in ("cpu_iowait_ratio", "process_read_bytes_per_second",
                                               "dataloader_workers_read_bytes_per_second")}
    parts = []
    if ev["cpu_iowait_ratio"] is not None:
        parts.append(f"the CPUs wait on I/O {ev['cpu_iowait_ratio']:.0%} of their time")
    read = (ev["process_read_bytes_per_second"] or 0.0) + (ev["dataloader_workers_read_bytes_per_second"] or 0.0)
    if ev["process_read_bytes_per_second"] is not None or ev["dataloader_workers_read_bytes_per_second"] is not None:
        parts.append(f"the process and its workers read {read / 1e6:.1f} MB/s from storage")
    return (" and ".join(parts), {k: round(v, 4) for k, v in ev.items() if v is not None})


def no_loader_workers(ctx: JobContext) -> dict | None:
    """The DataLoader loads in the training process: num_workers=0. The agent times its
    collate_fn, so the wait splits into reading the samples and collating them; a collate
    taking `collate_wait_share` of the wait or more is named as the larger part. The worker
    count named, and the step it gives, come from the run's own rates (loader_model.py)."""
    loaders = recorded_loaders(ctx)
    idle = sorted(r for r, ld in loaders.items() if ld["num_workers"] == 0)
    if not idle:
        return None
    ld = loaders[idle[0]]
    merged = ctx.ranks[idle[0]]
    where = f"{ld['class']} over {ld['dataset']}"
    text = (f"The {where} has num_workers=0 on {ranks_text(idle)}: every batch is read and collated on the "
            "training thread, inside the step.")
    planned = _worker_plan(ctx, merged, ld)
    if planned:
        rates, plan = planned
        lead = f"Give the {where} worker processes: " if plan.expected_ms < rates.step_ms else f"For the {where}, "
        action = lead + _workers_sizing(rates, plan, ld)
    else:
        per_rank = cpus_per_rank(ld)
        start = max(1, per_rank - 1) if per_rank else None
        sizing = (f"start at num_workers={start} ({ld.get('cpus')} CPUs for {ld.get('local_ranks') or 1} local "
                  "ranks, one left to the training process)" if start else "start at the number of CPU cores per rank")
        action = (f"Give the {where} worker processes: {sizing}, with persistent_workers=True so that they "
                  "outlive each epoch. (Too few steps were timed to size them from this run.)")
    split = _collate_split(merged.facts)
    wait, collate = split or (None, None)
    if wait and collate is not None:
        text += (f" Of its median wait of {wait:.1f} ms per step, collate_fn takes {collate:.1f} ms and reading the "
                 f"samples {max(wait - collate, 0.0):.1f} ms.")
        if collate >= ctx.tree.thresholds["collate_wait_share"] * wait:
            action += (" Collating is the larger part: store samples ready to batch (tensors of one size), index "
                       "whole batches at once (a BatchSampler passed as sampler, batch_size=None), or do the "
                       "per-sample work in the Dataset, which the workers run.")
    io, io_ev = _io_text(merged)
    if io:
        text += f" Meanwhile {io}."
    out: dict[str, Any] = {"text": text, "action": action,
           "evidence": {"ranks": idle, "loader": ld, "data_wait_ms": split[0] if split else None,
                        "collate_ms": split[1] if split else None, **io_ev}}
    if planned:
        out["evidence"]["model"] = _plan_evidence(*planned)
        out["expect"] = _plan_expectation(*planned)
    return out


def _worker_plan(ctx: JobContext, merged: MergedRank, ld: dict, cpu_bound: bool | None = None
                 ) -> tuple[LoaderRates, WorkerPlan] | None:
    """The rank's loader rates and the worker count they call for; None where the run timed
    too few steps, or no wait to hide. `cpu_bound`: whether making a batch is CPU work, where
    the workers' sampled CPU says (the step records of a loader with workers can not: its
    batches are made in other processes)."""
    th = ctx.tree.thresholds
    rates = loader_rates(merged.facts.steps, ld["num_workers"], th,
                         _workers_cpu(merged) if ld["num_workers"] > 0 else None)
    if rates is None or rates.wait_ms <= 0.0:
        return None
    return rates, plan_workers(rates, cpus_per_rank(ld), th, cpu_bound=cpu_bound, host_cpus=ld.get("cpus"),
                               foreign_cpus=_foreign_cpus(ctx, merged, ld))


def _own_cpus(merged: MergedRank) -> float | None:
    """The median CPUs a rank's process and its DataLoader workers used, over its samples."""
    return upper_median([proc + (finite(h.get("dataloader_workers_cpu_ratio")) or 0.0)
                         for s in merged.samples if isinstance(h := s.get("host"), dict)
                         and (proc := finite(h.get("process_cpu_ratio"))) is not None])


def _foreign_cpus(ctx: JobContext, merged: MergedRank, ld: dict) -> float:
    """The CPUs other processes kept busy over the run, as many as fall on the rank's own CPUs:
    the host's busy CPUs (the median over the rank's samples) less what the job's ranks on that
    host and their workers used, shared out over the host's CPUs; none under
    `loader_foreign_min_cpus`, the scatter of that difference on a quiet host."""
    busy_share = [r for s in merged.samples if isinstance(h := s.get("host"), dict)
                  and (r := finite(h.get("cpu_ratio"))) is not None]
    counts = [c for s in merged.samples if isinstance(h := s.get("host"), dict)
              and (c := finite(h.get("cpu_count"))) is not None and c >= 1]
    usable = ld.get("cpus")
    if not busy_share or not isinstance(usable, int) or isinstance(usable, bool) or usable <= 0:
        return 0.0
    total = max(upper_median(counts) or float(usable), float(usable))
    busy = (upper_median(busy_share) or 0.0) * total
    own = sum(_own_cpus(r) or 0.0 for r in ctx.ranks.values() if r.host == merged.host)
    foreign = max(busy - own, 0.0)
    return foreign * usable / total if foreign >= ctx.tree.thresholds["loader_foreign_min_cpus"] else 0.0


def _workers_sizing(rates: LoaderRates, plan: WorkerPlan, ld: dict) -> str:
    """The worker count to set and why that many, in the run's own figures."""
    k, per_batch = plan.workers, rates.batch_ms / plan.workers
    if plan.cpu_bound:
        made = ("making a batch is CPU work" + (f" ({rates.batch_cpu_ms / rates.batch_ms:.0%} of its "
                f"{rates.batch_ms:.0f} ms)" if rates.batch_cpu_ms is not None else " (its CPU time was not measured)")
                + f", so the workers share this rank's CPUs ({ld.get('cpus')} CPUs for "
                f"{ld.get('local_ranks') or 1} local ranks, one left to the training process)")
    else:
        made = (f"making a {rates.batch_ms:.0f} ms batch is mostly waiting ({rates.batch_cpu_ms:.1f} ms of it is CPU "
                "time), so workers beyond the CPU count still help")
    if plan.expected_ms >= rates.step_ms:
        return (f"more workers will not make this step faster: {made}, and with num_workers={k} the rank's CPUs, "
                f"busy with the batches' CPU work and the training's own, would make the step "
                f"{plan.expected_ms:.1f} ms against the {rates.step_ms:.1f} ms measured. Make each batch cheaper "
                "instead (less work per sample, decode once and keep the result, smaller images read), or give "
                "each rank more CPUs.")
    if plan.hides:
        return (f"set num_workers={k}, with persistent_workers=True so that they outlive each epoch: {made}, and "
                f"{k} of them make a batch every {per_batch:.1f} ms, within the {rates.rest_ms:.1f} ms the rest of "
                "the step takes.")
    pace = (", so the step still waits" if per_batch > rates.rest_ms else
            f", too close to hide the batches' own scatter ({plan.needed} would)")
    return (f"set num_workers={k}, with persistent_workers=True, the most this rank can run for these reads: {made}. "
            f"They make a batch every {per_batch:.1f} ms against the {rates.rest_ms:.1f} ms the rest of the step "
            f"takes{pace}; to hide the rest, make each batch cheaper (less work per sample, faster or local "
            "storage) or give each rank more CPUs.")


def _plan_expectation(rates: LoaderRates, plan: WorkerPlan) -> dict:
    """The prediction for the worker count named, with its range and ceiling."""
    limit = {"rest": "the rest of the step, with the input hidden",
             "workers": f"the {plan.workers} workers' pace, {rates.batch_ms:.1f} ms a batch each",
             "cpus": "the rank's CPUs, shared by the workers and the training process"}[plan.limit]
    limit += ("; each thread's CPU work taken slower as the other CPUs get busy (cpu_shared_throughput: shared "
              "cores, a VM's vCPUs)")
    return {"action": f"num_workers={plan.workers}", "baseline_step_ms": rates.step_ms,
            "expected_step_ms": plan.expected_ms, "low_ms": plan.low_ms, "high_ms": plan.high_ms,
            "ceiling_step_ms": plan.ceiling_ms, "limit": plan.limit,
            "assumes": f"the step is then set by {limit}; the ceiling is the step without its data wait"}


def _plan_evidence(rates: LoaderRates, plan: WorkerPlan) -> dict:
    return {"batch_ms": round(rates.batch_ms, 3), "batch_cpu_ms": _rounded(rates.batch_cpu_ms),
            "rest_ms": round(rates.rest_ms, 3), "rest_cpu_ms": _rounded(rates.rest_cpu_ms),
            "step_ms": round(rates.step_ms, 3), "steps": rates.steps, "cpu_bound": plan.cpu_bound,
            "workers": plan.workers, "workers_cap": plan.cap, "hides": plan.hides}


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _sampled_host(merged: MergedRank, key: str, with_workers: bool = False) -> float | None:
    """The upper median of a host measurement over the rank's samples (those with DataLoader
    workers only, where `with_workers`)."""
    return upper_median([float(s["host"][key]) for s in merged.samples
                         if isinstance(s.get("host"), dict) and isinstance(s["host"].get(key), (int, float))
                         and (not with_workers or (s["host"].get("dataloader_workers") or 0) > 0)])


def _workers_cpu(merged: MergedRank) -> float | None:
    """The median CPU seconds per second of the rank's DataLoader workers, over its samples."""
    return _sampled_host(merged, "dataloader_workers_cpu_ratio", with_workers=True)


def _workers_waiting(merged: MergedRank) -> float | None:
    """The median seconds per second the rank's DataLoader workers were ready to run and
    waited for a CPU, over its samples (None where the OS keeps no such count)."""
    return _sampled_host(merged, "dataloader_workers_runqueue_ratio", with_workers=True)


def _host_cpu(merged: MergedRank) -> float | None:
    """The median share of the host's CPUs in use, over the rank's samples with DataLoader
    workers: the same moments the workers' CPU is read at (a slow start, before the workers
    run, would otherwise count as spare CPUs they never had)."""
    return _sampled_host(merged, "cpu_ratio", with_workers=True)


def _worker_kind(load: float, host_cpu: float | None, th: dict, waiting: float | None = None) -> str | None:
    """busy, idle or None (can't tell) for workers using `load` of their cores each, and
    waiting `waiting` of their time each for a CPU where that was measured."""
    if load >= th["loader_workers_busy"]:
        return "busy"
    if waiting is not None and load + waiting >= th["loader_workers_busy"]:
        return "busy"  # ready to run that much of the time: CPU-bound, and short of CPUs
    if load < th["loader_workers_idle"]:
        return "idle"
    if host_cpu is not None and host_cpu >= th["loader_host_cpu_saturated"]:
        return "busy"  # CPU-bound, and short of CPUs: the host's are taken
    return None


def _short_of_cpus(host_cpu: float | None, waiting: float | None) -> str:
    """What shows the workers short of CPUs: the host's CPUs busy, their wait for one."""
    parts = ([f"the host's CPUs {host_cpu:.0%} busy"] if host_cpu is not None else []) + \
        ([f"{waiting:.1f} s a second spent waiting for a CPU"] if waiting else [])
    return ", with " + " and ".join(parts) if parts else ""


def loader_workers(ctx: JobContext) -> dict | None:
    """A DataLoader with workers that still keeps the step waiting: workers busy for
    `loader_workers_busy` of their cores or more are CPU-bound (more workers where CPUs are
    spare, else less work per sample), and so are those between the two thresholds on a host
    whose CPUs are `loader_host_cpu_saturated` busy; under `loader_workers_idle` they wait on
    reads, and more of them help whatever the CPU count. Workers that keep the step waiting
    set its pace, so each makes a batch in about k steps: the count named and its step follow
    from that."""
    th = ctx.tree.thresholds
    found = {}
    for rank, ld in recorded_loaders(ctx).items():
        used = _workers_cpu(ctx.ranks[rank])
        if ld["num_workers"] > 0 and used is not None:
            host_cpu, waiting = _host_cpu(ctx.ranks[rank]), _workers_waiting(ctx.ranks[rank])
            kind = _worker_kind(used / ld["num_workers"], host_cpu, th,
                                None if waiting is None else waiting / ld["num_workers"])
            if kind is not None:
                found[rank] = (kind, ld, used, host_cpu, waiting)
    if not found:
        return None
    rank = min(found)
    kind, ld, used, host_cpu, waiting = found[rank]
    starved = kind == "busy" and used / ld["num_workers"] < th["loader_workers_busy"]
    where, w = f"{ld['class']} over {ld['dataset']}", ld["num_workers"]
    ranks = sorted(r for r, f in found.items() if f[0] == kind)
    per_rank = cpus_per_rank(ld)
    io, io_ev = _io_text(ctx.ranks[rank])
    planned = _worker_plan(ctx, ctx.ranks[rank], ld, cpu_bound=kind == "busy")
    # Workers starved of CPUs on a saturated host would only share them: no more are named.
    more = planned is not None and planned[1].workers > w and not starved
    if kind == "busy":
        spare = per_rank - 1 - w if per_rank else None
        text = (f"The {where} on {ranks_text(ranks)} has {w} workers, and they use {used:.1f} CPUs ({used / w:.0%} of "
                "theirs" + (_short_of_cpus(host_cpu, waiting) if starved else "")
                + "): decoding and augmenting the samples is CPU-bound, and the step still waits for it.")
        if more and planned is not None:
            action = (f"Raise num_workers from {w} to {planned[1].workers} ({ld['cpus']} CPUs for "
                      f"{ld.get('local_ranks') or 1} local ranks, one left to the training process).")
        elif starved:
            taken = (f"The host's CPUs are all in use ({host_cpu:.0%} busy)"
                     if host_cpu is not None and host_cpu >= th["loader_host_cpu_saturated"] else
                     "The CPUs the workers may use are all taken (they wait for one)")
            action = (f"{taken}, so more workers would only share them: "
                      "do less per sample on the CPU (decode on the GPU with torchvision.io / DALI, augment batches on "
                      "the device, store the dataset pre-processed), give each rank more CPUs, or move what else "
                      "runs on them.")
        elif spare and spare > 0 and planned is None:
            action = (f"Raise num_workers from {w} to {w + spare} ({ld['cpus']} CPUs for {ld.get('local_ranks') or 1} "
                      "local ranks, one left to the training process).")
        else:
            action = (f"The {per_rank or ld.get('cpus')} CPUs of each rank are all in use: do less per sample on the "
                      "CPU (decode on the GPU with torchvision.io / DALI, augment batches on the device, store the "
                      "dataset pre-processed), or give each rank more CPUs.")
    else:
        text = (f"The {where} on {ranks_text(ranks)} has {w} workers, but they use {used:.2f} CPUs ({used / w:.0%} of "
                "theirs) while the step waits for data: the workers wait on reads, not on the CPU"
                + (f"; {io}" if io else "") + ".")
        action = ((f"Raise num_workers from {w} to {planned[1].workers}: workers that wait on reads need no CPU of "
                   "their own. " if more and planned is not None else "")
                  + "Make the reads faster or earlier: copy the dataset to local NVMe, read larger sequential shards "
                  "(WebDataset, a packed format) instead of many small files, and raise prefetch_factor "
                  f"(now {ld.get('prefetch_factor')}) so that more batches are in flight.")
    out: dict[str, Any] = {"text": text, "action": action,
           "evidence": {"ranks": ranks, "kind": kind, "loader": ld, "workers_cpu": round(used, 3),
                        "host_cpu": _rounded(host_cpu), "workers_waiting_for_cpu": _rounded(waiting),
                        "cpus_per_rank": per_rank, **io_ev}}
    if more and planned is not None:
        out["evidence"]["model"] = _plan_evidence(*planned)
        out["expect"] = _plan_expectation(*planned)
    return out
