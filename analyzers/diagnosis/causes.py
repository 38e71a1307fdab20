"""Causes: what in the job's own objects makes a phase slow, in the names the job uses.

A verdict names a class (data, host, ...); a cause names what to change: this DataLoader's
`num_workers=0`. Each rule is an object that says which phase it explains, detects itself
in the facts and returns its evidence (the numbers and names it found) and an action that
quotes them. The phase's recommendation leads with the causes found; the gain stays the
phase's, predicted by replaying the traced steps without that phase's work.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from diag.analyzers.analysis_types import ALL_REDUCE_RE, PAGEABLE_HTOD_RE, SYNC_OP_NAMES
from diag.analyzers.diagnosis import action_models
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import num, traced_durations, traced_steps
from diag.analyzers.diagnosis.loader_model import (
    LoaderRates,
    WorkerPlan,
    cpus_per_rank,
    loader_rates,
    plan_workers,
)
from diag.analyzers.diagnosis.recommendations import cause_gain


@dataclass(frozen=True)
class CauseRule:
    id: str
    phase: str  # the class whose time it explains (decision_tree.CLASSES)
    detect: Callable[[JobContext], dict | None]  # -> {"text", "action", "evidence"} or None
    supersedes: tuple[str, ...] = ()  # the verdict's generic fixes (by their start) its action replaces
    device: bool = True  # it reads the trace's device work (kernels, their ops' time): never on a trace without it
    also: tuple[str, ...] = ()  # other classes its time can land in (a blocking copy: data or host)
    change: str | None = None  # the [[what_if]] change that removes exactly this cause (a detector's
    # own "change" overrides it, where what the cause allows depends on the evidence)
    # The prediction for the cause's action, from its evidence and the ceiling (action_models);
    # a detector may give its own ("expect") instead.
    model: Callable[[JobContext, dict, dict | None], dict | None] | None = None


def _loaders(ctx: JobContext) -> dict[int, dict]:
    """The DataLoader settings each rank's agent recorded (rank -> settings)."""
    out = {}
    for rank, merged in ctx.ranks.items():
        loader = (merged.get("analysis") or {}).get("loader")
        if isinstance(loader, dict) and isinstance(loader.get("num_workers"), int):
            out[rank] = loader
    return out


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _median(vals: list[float]) -> float | None:
    vals = sorted(vals)
    return vals[len(vals) // 2] if vals else None


def _host_median(merged: dict, key: str) -> float | None:
    """The median of a host sample figure over the rank's samples (None where none has it)."""
    return _median([float(s["host"][key]) for s in merged.get("samples") or [] if isinstance(s.get("host"), dict)
                    and isinstance(s["host"].get(key), (int, float)) and not isinstance(s["host"][key], bool)])


def _collate_split(analysis: dict) -> tuple[float, float] | None:
    """(median data wait, median collate time) in ms per step, over the steps that timed both."""
    rows = [(float(s["data_wait_ms"]), float(s["collate_ms"])) for s in analysis.get("steps") or []
            if isinstance(s, dict) and isinstance(s.get("data_wait_ms"), (int, float))
            and isinstance(s.get("collate_ms"), (int, float))]
    return (_median([w for w, _ in rows]), _median([c for _, c in rows])) if rows else None


def _io_text(merged: dict) -> tuple[str, dict]:
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


def _no_loader_workers(ctx: JobContext) -> dict | None:
    """The DataLoader loads in the training process: num_workers=0. The agent times its
    collate_fn, so the wait splits into reading the samples and collating them; a collate
    taking `collate_wait_share` of the wait or more is named as the larger part. The worker
    count named, and the step it gives, come from the run's own rates (loader_model.py)."""
    loaders = _loaders(ctx)
    idle = sorted(r for r, ld in loaders.items() if ld["num_workers"] == 0)
    if not idle:
        return None
    ld = loaders[idle[0]]
    merged = ctx.ranks[idle[0]]
    where = f"{ld['class']} over {ld['dataset']}"
    text = (f"The {where} has num_workers=0 on {_ranks(idle)}: every batch is read and collated on the "
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
    split = _collate_split(merged.get("analysis") or {})
    if split and split[0]:
        wait, collate = split
        text += (f" Of its median wait of {wait:.1f} ms per step, collate_fn takes {collate:.1f} ms and reading the "
                 f"samples {max(wait - collate, 0.0):.1f} ms.")
        if collate >= ctx.tree.thresholds["collate_wait_share"] * wait:
            action += (" Collating is the larger part: store samples ready to batch (tensors of one size), index "
                       "whole batches at once (a BatchSampler passed as sampler, batch_size=None), or do the "
                       "per-sample work in the Dataset, which the workers run.")
    io, io_ev = _io_text(merged)
    if io:
        text += f" Meanwhile {io}."
    out = {"text": text, "action": action,
           "evidence": {"ranks": idle, "loader": ld, "data_wait_ms": split[0] if split else None,
                        "collate_ms": split[1] if split else None, **io_ev}}
    if planned:
        out["evidence"]["model"] = _plan_evidence(*planned)
        out["expect"] = _plan_expectation(*planned)
    return out


def _worker_plan(ctx: JobContext, merged: dict, ld: dict, cpu_bound: bool | None = None
                 ) -> tuple[LoaderRates, WorkerPlan] | None:
    """The rank's loader rates and the worker count they call for; None where the run timed
    too few steps, or no wait to hide. `cpu_bound`: whether making a batch is CPU work, where
    the workers' sampled CPU says (the step records of a loader with workers can not: its
    batches are made in other processes)."""
    th = ctx.tree.thresholds
    rates = loader_rates((merged.get("analysis") or {}).get("steps") or [], ld["num_workers"], th,
                         _workers_cpu(merged) if ld["num_workers"] > 0 else None)
    if rates is None or rates.wait_ms <= 0.0:
        return None
    return rates, plan_workers(rates, cpus_per_rank(ld), th, cpu_bound=cpu_bound, host_cpus=ld.get("cpus"))


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


def _workers_cpu(merged: dict) -> float | None:
    """The median CPU seconds per second of the rank's DataLoader workers, over its samples."""
    return _median([float(s["host"]["dataloader_workers_cpu_ratio"]) for s in merged.get("samples") or []
                    if isinstance(s.get("host"), dict) and (s["host"].get("dataloader_workers") or 0) > 0
                    and isinstance(s["host"].get("dataloader_workers_cpu_ratio"), (int, float))])


def _loader_workers(ctx: JobContext) -> dict | None:
    """A DataLoader with workers that still keeps the step waiting: workers busy for
    `loader_workers_busy` of their cores or more are CPU-bound (more workers where CPUs are
    spare, else less work per sample); under `loader_workers_idle` they wait on reads, and more
    of them help whatever the CPU count. Workers that keep the step waiting set its pace, so
    each makes a batch in about k steps: the count named and its step follow from that."""
    th = ctx.tree.thresholds
    found = {}
    for rank, ld in _loaders(ctx).items():
        used = _workers_cpu(ctx.ranks[rank])
        if ld["num_workers"] > 0 and used is not None:
            load = used / ld["num_workers"]
            if load >= th["loader_workers_busy"]:
                found[rank] = ("busy", ld, used)
            elif load < th["loader_workers_idle"]:
                found[rank] = ("idle", ld, used)
    if not found:
        return None
    rank = min(found)
    kind, ld, used = found[rank]
    where, w = f"{ld['class']} over {ld['dataset']}", ld["num_workers"]
    ranks = sorted(r for r, f in found.items() if f[0] == kind)
    per_rank = cpus_per_rank(ld)
    io, io_ev = _io_text(ctx.ranks[rank])
    planned = _worker_plan(ctx, ctx.ranks[rank], ld, cpu_bound=kind == "busy")
    more = planned is not None and planned[1].workers > w
    if kind == "busy":
        spare = per_rank - 1 - w if per_rank else None
        text = (f"The {where} on {_ranks(ranks)} has {w} workers, and they use {used:.1f} CPUs ({used / w:.0%} of "
                "theirs): decoding and augmenting the samples is CPU-bound, and the step still waits for it.")
        if more:
            action = (f"Raise num_workers from {w} to {planned[1].workers} ({ld['cpus']} CPUs for "
                      f"{ld.get('local_ranks') or 1} local ranks, one left to the training process).")
        elif spare and spare > 0 and planned is None:
            action = (f"Raise num_workers from {w} to {w + spare} ({ld['cpus']} CPUs for {ld.get('local_ranks') or 1} "
                      "local ranks, one left to the training process).")
        else:
            action = (f"The {per_rank or ld.get('cpus')} CPUs of each rank are all in use: do less per sample on the "
                      "CPU (decode on the GPU with torchvision.io / DALI, augment batches on the device, store the "
                      "dataset pre-processed), or give each rank more CPUs.")
    else:
        text = (f"The {where} on {_ranks(ranks)} has {w} workers, but they use {used:.2f} CPUs ({used / w:.0%} of "
                "theirs) while the step waits for data: the workers wait on reads, not on the CPU"
                + (f"; {io}" if io else "") + ".")
        action = ((f"Raise num_workers from {w} to {planned[1].workers}: workers that wait on reads need no CPU of "
                   "their own. " if more else "")
                  + "Make the reads faster or earlier: copy the dataset to local NVMe, read larger sequential shards "
                  "(WebDataset, a packed format) instead of many small files, and raise prefetch_factor "
                  f"(now {ld.get('prefetch_factor')}) so that more batches are in flight.")
    out = {"text": text, "action": action,
           "evidence": {"ranks": ranks, "kind": kind, "loader": ld, "workers_cpu": round(used, 3),
                        "cpus_per_rank": per_rank, **io_ev}}
    if more:
        out["evidence"]["model"] = _plan_evidence(*planned)
        out["expect"] = _plan_expectation(*planned)
    return out


# The call in the job's code that makes each op that brings a value to the host.
SYNC_OPS = dict(zip(SYNC_OP_NAMES, (".item()", "bool(tensor) or `if tensor:`", "nonzero() or boolean-mask indexing",
                                    "torch.equal()")))


def _traced_step_ms(analysis: dict) -> float | None:
    """The median duration of the rank's traced steps."""
    return _median(traced_durations(analysis))


def _traced_mean_ms(analysis: dict) -> float | None:
    """The mean duration of the rank's traced steps: what per-step facts (totals over the
    traced steps, divided by their count) are shares of."""
    vals = traced_durations(analysis)
    return sum(vals) / len(vals) if vals else None


def _host_sync_points(ctx: JobContext) -> dict | None:
    """Ops that pull values to the host, at `sync_points_per_step` calls per traced step or more."""
    minimum = ctx.tree.thresholds["sync_points_per_step"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        traced = traced_steps(analysis)
        ops = [o for o in analysis.get("top_ops") or [] if isinstance(o, dict) and o.get("name") in SYNC_OPS]
        calls = sum(int(o.get("count") or 0) for o in ops) / traced if traced else 0.0
        if calls >= minimum:
            sites = [x for x in analysis.get("sync_sites") or [] if isinstance(x, dict) and x.get("function")]
            found[rank] = (sorted(ops, key=lambda o: -int(o.get("count") or 0)), traced, calls, sites)
    if not found:
        return None
    ops, traced, calls, sites = found[min(found)]
    listed = ", ".join(f"{o['name']} {o['count'] / traced:.0f} times ({float(o.get('time_ms') or 0) / traced:.2f} ms)"
                       for o in ops)
    first = ops[0]["name"]
    # The call site, where a window recorded Python stacks.
    where = f" in {sites[0]['function']} ({sites[0]['file']}:{sites[0]['line']})" if sites else ""
    return {
        "text": f"Per traced step on {_ranks(sorted(found))}, {listed}: {calls:.0f} values pulled to the host "
                "one at a time, each a wait for the device on a GPU"
                + (f"; the calls come from {', '.join(x['name'] for x in sites)}" if sites else "") + ".",
        "action": f"Keep the values on the device: replace the per-element {SYNC_OPS[first]}{where} with "
                  "tensor operations (sum, a mask, where, argmax) and read one result per step, or every N steps "
                  "for logging.",
        "evidence": {"ranks": sorted(found), "per_step": round(calls, 1), "traced_steps": traced,
                     "ops": [{"name": o["name"], "count": o["count"], "time_ms": o.get("time_ms")} for o in ops],
                     "call_sites": sites},
    }


def _pageable_copies(ctx: JobContext) -> dict | None:
    """Host-to-device copies from pageable memory holding the host `pageable_copy_step_share`
    of the step or more."""
    minimum = ctx.tree.thresholds["pageable_copy_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        copies = [c for c in analysis.get("copies") or [] if isinstance(c, dict) and PAGEABLE_HTOD_RE.search(str(c.get("name")))]
        host_ms = sum(float(c.get("host_ms_per_step") or 0.0) for c in copies)
        step_ms = _traced_step_ms(analysis)
        if copies and step_ms and host_ms >= minimum * step_ms:
            found[rank] = (copies, host_ms, step_ms)
    if not found:
        return None
    copies, host_ms, step_ms = found[min(found)]
    calls = sum(float(c.get("calls_per_step") or 0.0) for c in copies)
    mb = sum(float(c.get("mb_per_step") or 0.0) for c in copies)
    loader = _loaders(ctx).get(min(found))
    if loader is not None and not loader.get("pin_memory"):
        pin = f"Set pin_memory=True on the {loader['class']} over {loader['dataset']} (it has pin_memory=False)"
    else:
        pin = "Pin the host tensors: pin_memory=True on the DataLoader, or tensor.pin_memory() for those built in the loop"
    return {
        "text": f"On {_ranks(sorted(found))}, {round(calls, 2):g} host-to-device copies per traced step ({mb:.1f} MB) read "
                f"pageable memory ({', '.join(c['name'] for c in copies)}): each holds the host until the driver "
                f"has staged it, {host_ms:.2f} ms per step ({host_ms / step_ms:.1%} of the step), and none can "
                "overlap with compute.",
        "action": f"{pin}, and copy with .to(device, non_blocking=True).",
        "evidence": {"ranks": sorted(found), "calls_per_step": round(calls, 2), "mb_per_step": round(mb, 4),
                     "host_ms_per_step": round(host_ms, 4), "step_ms": round(step_ms, 3),
                     "copies": copies, "loader": loader},
    }


def _typical_launch_ms(lf: dict) -> float:
    """The launch calls' host time per step at their median cost: one cold first launch (lazy
    module loading, hundreds of ms) is start-up, not a cost the step pays every time."""
    median, calls = lf.get("median_launch_us"), lf.get("launch_calls_per_step")
    total = float(lf.get("launch_ms_per_step") or 0.0)
    return min(total, float(median) * float(calls) / 1e3) if median is not None and calls else total


def _launch_bound(ctx: JobContext) -> dict | None:
    """Launch calls that take the host `launch_bound_ratio` of the kernels' own time or more,
    and `launch_bound_step_share` of the step, at their median cost per call: the device waits
    for work to be launched."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        lf, step_ms = analysis.get("launches"), _traced_step_ms(analysis)
        if not isinstance(lf, dict) or not step_ms:
            continue
        launch_ms, kernel_ms = _typical_launch_ms(lf), float(lf.get("kernel_ms_per_step") or 0.0)
        if launch_ms >= th["launch_bound_ratio"] * kernel_ms and launch_ms >= th["launch_bound_step_share"] * step_ms:
            found[rank] = (lf, step_ms)
    if not found:
        return None
    lf, step_ms = found[min(found)]
    typical = _typical_launch_ms(lf)
    per_call = 1e3 * typical / lf["launch_calls_per_step"] if lf.get("launch_calls_per_step") else None
    launchers = ", ".join(f"{t['name']} ({t['kernels_per_step']:g})" for t in lf.get("top_launchers") or [])
    # In-place elementwise ops launching a large part of the kernels: a per-parameter loop.
    elementwise = [t["name"] for t in lf.get("top_launchers") or [] if str(t["name"]).endswith("_")
                   and t["kernels_per_step"] >= th["launch_elementwise_share"] * lf["kernels_per_step"]]
    fuse = (f" {' and '.join(elementwise)} launch one kernel per tensor: a foreach or fused optimizer "
            "(torch.optim.AdamW(..., fused=True)) launches a few for all parameters.") if elementwise else ""
    graph = "a HIP graph (torch.cuda.graphs on ROCm)" if lf.get("runtime") == "hip" else "a CUDA graph"
    return {
        "text": f"On {_ranks(sorted(found))}, {lf['kernels_per_step']:g} kernels per traced step run a median "
                f"{lf['median_kernel_us']:g} µs each, {lf['kernel_ms_per_step']:.2f} ms in all, while launching them "
                f"holds the host {typical:.2f} ms ({typical / step_ms:.0%} of the step"
                + (f", {per_call:.0f} µs per launch" if per_call else "") + ")"
                + (f"; the most come from {launchers}" if launchers else "") + ".",
        "action": "Launch fewer, larger pieces of work: capture the step"
                  + (f" (at least {launchers.split(' (')[0]})" if launchers else "")
                  + f" in {graph}, or compile it with torch.compile(mode='reduce-overhead'); raise the batch size "
                  "so that each kernel does more." + fuse,
        "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3),
                     "launch_us_per_call": round(per_call, 2) if per_call else None,
                     "typical_launch_ms_per_step": round(typical, 4), **lf},
    }


def _timed_items_over(ctx: JobContext, key: str, share: str) -> dict[int, tuple]:
    """Per rank whose facts `key` (a list of {"name", "ms_per_step", ...}) add up to the
    threshold `share` of its traced step or more: (items, their ms per step, the step's ms,
    the rank's analysis)."""
    minimum = ctx.tree.thresholds[share]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        items = [c for c in analysis.get(key) or [] if isinstance(c, dict) and c.get("ms_per_step")]
        step_ms = _traced_step_ms(analysis)
        total = sum(float(c["ms_per_step"]) for c in items)
        if items and step_ms and total >= minimum * step_ms:
            found[rank] = (items, total, step_ms, analysis)
    return found


def _allocator_calls(ctx: JobContext) -> dict | None:
    """Device-memory allocation and release calls (cudaMalloc, cudaFree, their HIP and driver
    forms) holding the host `allocator_step_share` of the step or more: PyTorch's caching
    allocator calls the driver only when its cache misses or is emptied."""
    found = _timed_items_over(ctx, "allocator", "allocator_step_share")
    if not found:
        return None
    calls, total, step_ms, analysis = found[min(found)]
    listed = ", ".join(f"{c['name']} {_times(c['calls_per_step'])} ({_ms(c['ms_per_step'])}, the longest "
                       f"{_ms(c['longest_ms'])})" for c in calls[:3])
    hip = any(str(c["name"]).startswith("hip") for c in calls)
    conf = "PYTORCH_HIP_ALLOC_CONF" if hip else "PYTORCH_CUDA_ALLOC_CONF"
    frees = any(re.search(r"Free|Release|Unmap", str(c["name"])) for c in calls)
    text = (f"On {_ranks(sorted(found))}, per traced step {listed}: the host spends {_ms(total)} "
            f"({total / step_ms:.0%} of the step) allocating and freeing device memory in the driver.")
    iters = analysis.get("iterations") if isinstance(analysis.get("iterations"), dict) else {}
    if iters and not iters.get("used"):
        text += (" The trace was judged whole, start-up included: its longest calls may be one-off start-up "
                 "(the first allocations, the CUDA context), not a loop's churn.")
    if frees:
        action = ("Stop giving memory back inside the loop: remove torch.cuda.empty_cache() calls from it; if there "
                  "are none, the caching allocator frees its cache to retry allocations at the memory limit "
                  "(torch.cuda.memory_stats()['num_alloc_retries'] > 0), so lower the peak (a smaller micro-batch, "
                  f"activation checkpointing) and set {conf}=expandable_segments:True so that segments grow "
                  "instead of being freed and re-allocated.")
    else:
        action = (f"Keep the allocator's cache warm: tensors of new sizes every step (variable sequence lengths) "
                  f"carve new segments, so pad batches to a few fixed lengths, and set {conf}=expandable_segments:True "
                  "so that segments grow in place.")
    return {"text": text, "action": action,
            "evidence": {"ranks": sorted(found), "ms_per_step": round(total, 4), "step_ms": round(step_ms, 3),
                         "calls": calls, "alloc_conf": conf}}


def _cpu_work(ctx: JobContext) -> dict | None:
    """Ops of the training thread that run on the CPU (no runtime call while they run) holding
    the host `cpu_work_step_share` of the step or more: the device waits while the thread that
    feeds it computes."""
    found = _timed_items_over(ctx, "cpu_work", "cpu_work_step_share")
    if not found:
        return None
    ops, total, step_ms, analysis = found[min(found)]
    share = total / (_traced_mean_ms(analysis) or step_ms)
    listed = ", ".join(f"{o['name']} ({_ms(float(o['ms_per_step']))})" for o in ops[:4])
    after = sum(float(o.get("after_ms_per_step") or 0.0) for o in ops)
    if after >= 0.05 * total:
        listed += (f"; and {_ms(after)} right after these ops before the thread's next event (freeing their "
                   "tensors, the Python between them), which goes where the work goes")
    loader = _loaders(ctx).get(min(found))
    where = "into " + _into_workers(loader)
    return {
        "text": f"On {_ranks(sorted(found))}, the training thread runs {_ms(total)} of CPU work per traced step "
                f"({share:.0%} of the step) between its launches, and the device waits for it: {listed}.",
        "action": f"Move this work off the training thread: {where}; or do it on the device (create the tensors "
                  "with device= and transform them there).",
        "evidence": {"ranks": sorted(found), "ms_per_step": round(total, 4), "step_ms": round(step_ms, 3),
                     "ops": ops, "loader": loader},
    }


def _into_workers(loader: dict | None) -> str:
    """Where work on the training thread goes to run in DataLoader workers: the job's own loader
    where the agent recorded it."""
    if loader:
        return (f"the Dataset's __getitem__ or the collate_fn of the {loader['class']} over {loader['dataset']}, "
                f"run by its workers (it has num_workers={loader['num_workers']})")
    return "the Dataset's __getitem__ or collate_fn, run by DataLoader workers (num_workers > 0)"


def _python_gaps(ctx: JobContext) -> dict | None:
    """Python the training thread runs outside every op, in stretches long enough to be work of
    its own, holding `python_work_step_share` of the step or more: nothing is launched meanwhile."""
    minimum = ctx.tree.thresholds["python_work_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        gaps, step_ms = analysis.get("python_gaps"), _traced_mean_ms(analysis)
        if isinstance(gaps, dict) and step_ms and float(gaps.get("ms_per_step") or 0.0) >= minimum * step_ms:
            found[rank] = (gaps, step_ms)
    if not found:
        return None
    gaps, step_ms = found[min(found)]
    ms = float(gaps["ms_per_step"])
    frames = [f for f in gaps.get("frames") or [] if isinstance(f, dict) and f.get("function")]
    where = ("; most of it in " + ", ".join(f"{f['function']} ({f['file']}:{f['line']}, {_ms(float(f['ms_per_step']))})"
                                            for f in frames)) if frames else \
        ("; which code runs there shows in a window recorded with Python stacks (stack_windows, or "
         "torch.profiler's with_stack=True)")
    loader = _loaders(ctx).get(min(found))
    into = _into_workers(loader)
    return {
        "text": f"On {_ranks(sorted(found))}, the training thread runs Python outside every op for {_ms(ms)} per traced "
                f"step ({ms / step_ms:.0%} of the step), in {gaps['stretches_per_step']:g} stretches of "
                f"{ctx.tree.thresholds['python_gap_min_us']:g} µs or more (the longest {_ms(float(gaps['longest_ms']))}), "
                f"launching nothing meanwhile{where}. CUDA graphs and compilation do not shorten it.",
        "action": f"Move this Python work off the training thread: into {into}; or do it once before the loop.",
        "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), **gaps, "loader": loader},
    }


def _times(n: float) -> str:
    return "once" if round(n, 2) == 1 else f"{round(n, 2):g} times"


def _ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms:.2f} ms"


def _fp32_math(ctx: JobContext) -> dict | None:
    """Matrix kernels that run fp32 on the CUDA cores, or TF32 where bf16 doubles the peak, for
    `fp32_math_share` of the compute kernels' time or more (precision from the kernels' names)."""
    minimum = ctx.tree.thresholds["fp32_math_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        m = (merged.get("analysis") or {}).get("math")
        if not isinstance(m, dict) or not m.get("compute_ms_per_step"):
            continue
        peaks = m.get("peaks_tflops") or {}
        total = float(m["compute_ms_per_step"])
        if float(m.get("fp32_ms_per_step") or 0.0) >= minimum * total:
            found[rank] = ("fp32", m, peaks)
        elif float(m.get("tf32_ms_per_step") or 0.0) >= minimum * total and \
                (peaks.get("bf16") or 0.0) > (peaks.get("tf32") or float("inf")):
            found[rank] = ("tf32", m, peaks)
    if not found:
        return None
    kind, m, peaks = found[min(found)]
    ms, total = float(m[f"{kind}_ms_per_step"]), float(m["compute_ms_per_step"])
    fast = "bf16" if peaks.get("bf16") else ("fp16" if peaks.get("fp16") else None)
    slow = kind if peaks.get(kind) else "fp32"
    ratio = peaks[fast] / peaks[slow] if fast and peaks.get(slow) else None
    names = ", ".join(k["name"] if len(k["name"]) <= 60 else k["name"][:57] + "..." for k in m.get("fp32_kernels") or [])
    if kind == "fp32":
        what = (f"{ms:.1f} ms of the {total:.1f} ms per traced step in compute kernels are fp32 matrix math on the "
                "CUDA cores, not the tensor cores" + (f" (the most: {names})" if names else ""))
    else:
        what = f"{ms:.1f} ms of the {total:.1f} ms per traced step in compute kernels are TF32 matrix math"
    peak = f"; the device's {fast} peak is {ratio:.0f}x its {kind} peak" if ratio else ""
    if fast == "fp16" and not peaks.get("tf32"):  # V100: fp16 tensor cores, no bf16, no TF32
        action = ("Run the forward and loss under torch.autocast('cuda', dtype=torch.float16) with a "
                  "torch.amp.GradScaler('cuda'): this device's tensor cores take fp16, not bf16 or TF32.")
    elif kind == "tf32":
        action = "Run the forward and loss under torch.autocast('cuda', dtype=torch.bfloat16): bf16 doubles TF32's tensor-core peak."
    else:
        action = ("Run the forward and loss under torch.autocast('cuda', dtype=torch.bfloat16), and let the fp32 "
                  "math left run as TF32: torch.set_float32_matmul_precision('high') and "
                  "torch.backends.cudnn.allow_tf32 = True.")
    text = f"On {_ranks(sorted(found))}, {what}{peak}."
    odd = _untiled_in_half(ctx.ranks[min(found)], kind)
    if odd:
        text += (f" {_ms(odd[0])} of them run on shapes that half precision's tiles do not divide either "
                 f"({', '.join(odd[1])}): there bf16 kernels stay well under the peak, so the ceiling is an "
                 "upper bound, and the prediction for autocast takes their lower rate.")
        action += f" Pad those dimensions to multiples of {TILE_ELEMENTS_HALF} as well."
    return {
        "text": text,
        "action": action,
        "evidence": {"ranks": sorted(found), "precision": kind, "ms_per_step": round(ms, 4),
                     "compute_ms_per_step": round(total, 4), "peak_ratio": round(ratio, 2) if ratio else None,
                     "fp32_kernels": m.get("fp32_kernels") or [], "peaks_tflops": peaks or None},
    }


TILE_ELEMENTS_HALF = 8  # 16-byte tensor-core rows of 2-byte elements (matrix_ops.TILE_BYTES)


def _untiled_in_half(merged: dict, kind: str) -> tuple[float, list[str]] | None:
    """Of the rank's matrix-op groups in `kind` (fp32, tf32), the time per step on dimensions
    that are not multiples of 8 (the half-precision tile), and those dimensions; None where
    none are, or under half the groups' time."""
    m = (merged.get("analysis") or {}).get("matrix_ops")
    groups = [g for g in (m or {}).get("groups") or [] if isinstance(g, dict) and g.get("dtype") in (kind, "fp32")]
    odd_ms, dims = 0.0, []
    for g in groups:
        bad = [d.split(" ")[0] for d in g.get("misaligned") or []
               if isinstance(d, str) and (v := re.match(r"\w+=(\d+)", d)) and int(v.group(1)) % TILE_ELEMENTS_HALF]
        if bad:
            odd_ms += float(g.get("ms_per_step") or 0.0)
            dims += [d for d in bad if d not in dims]
    total = sum(float(g.get("ms_per_step") or 0.0) for g in groups)
    return (odd_ms, dims[:4]) if total and odd_ms >= 0.5 * total else None


def _matrix_group_text(g: dict) -> str:
    rate = f" at {g['tflops'] * 1e3:.0f} GFLOP/s" if g.get("tflops") and g["tflops"] < 1 else \
        (f" at {g['tflops']:.1f} TFLOP/s" if g.get("tflops") else "")
    peak = f" ({g['peak_fraction']:.0%} of the device's {g['dtype']} peak)" if g.get("peak_fraction") else ""
    return f"{g['op']} on {g['shapes']} in {g['dtype']}, {_times(g['calls_per_step'])}, {g['ms_per_step']:.1f} ms{rate}{peak}"


def _matrix_ops(ctx: JobContext) -> dict | None:
    """The matrix ops that do a compute-bound step's work, by shape and dtype, once they hold
    `matrix_ops_compute_share` of the compute time: what would make them faster, from their
    shapes (tiles the tensor cores do not divide), their rate (under `matrix_ops_low_peak` of
    the peak: too small to fill the device) and their dtype (fp32 on a CPU with bf16 units)."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        m = (merged.get("analysis") or {}).get("matrix_ops")
        if isinstance(m, dict) and m.get("groups") and m.get("compute_ms_per_step") and \
                float(m.get("ms_per_step") or 0.0) >= th["matrix_ops_compute_share"] * float(m["compute_ms_per_step"]):
            found[rank] = (m, merged)
    if not found:
        return None
    m, merged = found[min(found)]
    groups, device = m["groups"][:3], (merged.get("analysis") or {}).get("timeline") == "device"
    text = (f"On {_ranks(sorted(found))}, matrix ops run {m['ms_per_step']:.1f} ms per traced step (compute in all: "
            f"{m['compute_ms_per_step']:.1f} ms); the most: "
            + "; ".join(_matrix_group_text(g) for g in groups) + ".")
    actions, change = [], None
    odd = next((g for g in groups if g.get("misaligned")), None)
    if odd:
        actions.append(f"Pad {odd['op']} on {odd['shapes']} to tile-sized dimensions ({', '.join(odd['misaligned'])}): "
                       "round vocabulary, hidden and head sizes up, and pad sequences (pad_to_multiple_of).")
    slow = [g for g in groups if g.get("peak_fraction") is not None and g["peak_fraction"] < th["matrix_ops_low_peak"]]
    if slow:
        actions.append(f"{slow[0]['op']} on {slow[0]['shapes']} reaches {slow[0]['peak_fraction']:.0%} of peak: matrices "
                       "this small or thin leave the device's units idle; raise the (micro-)batch size, batch the "
                       "small products into one (bmm, grouped GEMMs), or let torch.compile(mode='max-autotune') "
                       "pick kernels for these shapes.")
    fp32 = [g for g in groups if g["dtype"] == "fp32"]
    cpu = (merged.get("info") or {}).get("cpu") if isinstance((merged.get("info") or {}).get("cpu"), dict) else {}
    if fp32 and not device:
        isa = f" ({cpu['isa']})" if cpu.get("isa") else ""
        if cpu.get("bf16_units") is False:
            actions.append(f"This CPU{isa} has no bf16 matrix units (AMX, AVX512-BF16), so lower precision will not "
                           "speed these fp32 ops up here: the step is their FLOPs. Do fewer (narrower layers, "
                           "smaller batches per step), or run them on a GPU, where bf16 tensor cores run the same "
                           "products many times faster.")
        else:
            change = "half_precision_matrix_ops"
            actions.append("Run them in bf16: torch.autocast('cpu', dtype=torch.bfloat16) around the forward and loss "
                           + ("uses this CPU's bf16 matrix units." if cpu.get("bf16_units") else
                              "uses the bf16 matrix units of CPUs that have them (AMX, AVX512-BF16)."))
    if not actions:
        actions.append("They run near the device's peak for their dtype: the step is their FLOPs. Lower precision "
                       "(bf16, fp8 where the device has it) or fewer FLOPs (narrower layers, shorter sequences) "
                       "is what makes it faster.")
    return {"text": text, "action": " ".join(actions), "change": change,
            "evidence": {"ranks": sorted(found), "ms_per_step": m["ms_per_step"],
                         "compute_ms_per_step": m["compute_ms_per_step"], "groups": m["groups"],
                         "cpu": cpu or None}}


# torch.optim optimizers with a fused implementation (one kernel launch for all parameters).
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")


def _optimizer_step(ctx: JobContext) -> dict | None:
    """An optimizer that is not fused, whose step holds the host or the device for
    `optimizer_step_share` of the step or more: a for-loop or foreach update makes a pass over
    memory (and a launch) per tensor or per op that a fused one makes once. A for-loop over
    fewer than `optimizer_min_loop_ops` tensors is not named: there is nothing to fuse."""
    minimum = ctx.tree.thresholds["optimizer_step_share"]
    min_loop = ctx.tree.thresholds["optimizer_min_loop_ops"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        opt, step_ms = analysis.get("optimizer"), _traced_step_ms(analysis)
        if not isinstance(opt, dict) or opt.get("implementation") == "fused" or not step_ms:
            continue
        if opt.get("implementation") == "for-loop" and float(opt.get("ops_per_step") or 0.0) < min_loop:
            continue
        cost = max(float(opt.get("ms_per_step") or 0.0), float(opt.get("kernel_ms_per_step") or 0.0))
        if cost >= minimum * step_ms:
            found[rank] = (opt, cost, step_ms)
    if not found:
        return None
    opt, cost, step_ms = found[min(found)]
    name, impl = opt["name"], opt["implementation"]
    text = (f"On {_ranks(sorted(found))}, the {name} optimizer's step ({impl}: {opt['ops_per_step']:g} ops"
            + (f" and {opt['kernels_per_step']:g} kernels" if opt.get("kernels_per_step") else "")
            + f" per traced step) holds the host {opt['ms_per_step']:.1f} ms"
            + (f" and the device {opt['kernel_ms_per_step']:.1f} ms" if opt.get("kernel_ms_per_step") else "")
            + f" per step, {cost / step_ms:.0%} of the step.")
    if name in FUSED_OPTIMIZERS:
        action = (f"Construct it fused: torch.optim.{name}(params, ..., fused=True) updates every parameter in a few "
                  "kernels, each tensor read and written once"
                  + ("; foreach=True where fused is not available for the device." if impl == "for-loop" else "."))
    else:
        action = (f"Fuse {name}'s update: torch.compile(optimizer.step) turns its "
                  + ("per-parameter" if impl == "for-loop" else "foreach") + " ops into a few kernels"
                  + (", or pass foreach=True where it takes it" if impl == "for-loop" else "")
                  + "; where its step does expensive work of its own (a preconditioner), run that less often.")
    return {"text": text, "action": action,
            "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), "ms_per_step": round(cost, 4), **opt}}


def _collective_groups(analysis: dict) -> list[dict]:
    """The rank's collectives by (name, process group): calls, median bytes, and the time not
    hidden behind computation, per traced step; most exposed first."""
    traced = traced_steps(analysis)
    groups: dict[tuple, dict] = {}
    for c in analysis.get("collectives") or []:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            continue
        g = groups.setdefault((c["name"], c.get("pg")), {"name": c["name"], "pg": c.get("pg"), "calls": 0,
                                                          "bytes": [], "dur_us": 0.0, "exposed_us": 0.0,
                                                          "after_backward": 0, "backward_known": 0})
        g["calls"] += 1
        if isinstance(c.get("after_backward"), bool):
            g["backward_known"] += 1
            g["after_backward"] += c["after_backward"]
        if isinstance(c.get("bytes"), (int, float)) and c["bytes"] > 0:
            g["bytes"].append(float(c["bytes"]))
        g["dur_us"] += float(c.get("dur_us") or 0.0)
        g["exposed_us"] += sum(float(b) - float(a) for a, b in c.get("exposed") or [] if b > a)
    out = []
    for g in groups.values():
        sizes = sorted(g.pop("bytes"))
        out.append({**g, "calls_per_step": g["calls"] / traced if traced else None,
                    "median_bytes": sizes[len(sizes) // 2] if sizes else None,
                    "exposed_ms_per_step": g["exposed_us"] / 1e3 / traced if traced else None,
                    "hidden_fraction": min(1.0, max(0.0, 1.0 - g["exposed_us"] / g["dur_us"])) if g["dur_us"] > 0
                    else None})
    return sorted(out, key=lambda g: -(g["exposed_ms_per_step"] or 0.0))


def _exposed_collectives(ctx: JobContext) -> dict | None:
    """The collective that carries the most exposed communication, once it exposes
    `collective_exposed_step_share` of the step; advice by its size and count."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        groups, step_ms = _collective_groups(analysis), _traced_step_ms(analysis)
        if groups and step_ms and (groups[0]["exposed_ms_per_step"] or 0.0) >= th["collective_exposed_step_share"] * step_ms:
            found[rank] = (groups[0], step_ms, analysis)
    if not found:
        return None
    g, step_ms, analysis = found[min(found)]
    size = _mb(g["median_bytes"])
    pg = f" on process group {g['pg']}" if g.get("pg") not in (None, "", "default_pg", "0") else ""
    hidden = g["hidden_fraction"]
    busbw = ((ctx.job.get("collectives") or {}).get("busbw") or {}).get("median_gbps")
    times = _times(g["calls_per_step"])
    text = (f"On {_ranks(sorted(found))}, {g['name']}{pg} of {size} runs {times} per traced "
            f"step and exposes {g['exposed_ms_per_step']:.1f} ms per step ({g['exposed_ms_per_step'] / step_ms:.0%} of the "
            f"step; {hidden:.0%} of its time hidden behind computation)"
            + (f", at a median bus bandwidth of {busbw:.2f} GB/s" if busbw else "") + ".")
    small = g["median_bytes"] is not None and g["median_bytes"] < th["small_collective_bytes"] and \
        g["calls_per_step"] >= th["small_collectives_per_step"]
    late = g["backward_known"] and g["after_backward"] >= th["collective_after_backward"] * g["backward_known"]
    hook = _compression_hook(analysis)
    if late:
        text += (f" {g['after_backward']} of its {g['backward_known']} calls in steps with a backward pass start after "
                 "backward has ended, with no computation left to hide them.")
    if late and not small:
        action = (f"Start {g['name']} during backward, not after it: let DDP (or FSDP) reduce the gradients from "
                  "their autograd hooks instead of a separate collective after loss.backward(), with a bucket_cap_mb "
                  "small enough that the first buckets are ready early; and send less (ddp.no_sync() over several "
                  "micro-batches" + (f", the {hook.split('_')[0]} compression hook" if hook else "") + ").")
    elif small:
        action = (f"Send fewer, larger messages: {g['calls_per_step']:g} {g['name']} calls of {size} per step pay "
                  "their latency each time; raise DDP's bucket_cap_mb (25 by default) or flatten small tensors "
                  "into one before the collective.")
    else:
        action = (f"Move less, less often, and later: accumulate gradients over several micro-batches inside "
                  f"ddp.no_sync() so {g['name']} runs once per accumulation; {_compression(hook)}; a smaller "
                  "bucket_cap_mb starts the first buckets while backward still runs.")
    model = analysis.get("model") if isinstance(analysis.get("model"), dict) else {}
    fsdp = analysis.get("fsdp") if isinstance(analysis.get("fsdp"), dict) else None
    change, micro = None, _micro_batches(analysis, g, th)
    if fsdp and re.search(r"all_?gather|reduce_?scatter|all_?reduce", g["name"], re.IGNORECASE):
        action = _fsdp_action(g["name"], fsdp)
    elif micro:
        text += (f" Each optimizer step runs {micro:.3g} forward and backward passes, and DDP all-reduces the "
                 "gradients after every one of them.")
        action = ("All-reduce once per optimizer step: run every micro-batch but the last inside "
                  "`with model.no_sync():`, so the gradients accumulate locally and the last backward all-reduces "
                  "their sum (the same update). Then, to send less still: " + action[0].lower() + action[1:])
        change = "ddp_no_sync_accumulation"
    # What the run's own fabric measurement and NCCL log say, joined in.
    nccl = ctx.nccl or {}
    told = [f for f in nccl.get("log_findings") or [] if f.get("severity") in ("warning", "error", "critical")]
    if nccl.get("bandwidth_summary"):
        text += f" The run's own diag nccl measured {nccl['bandwidth_summary']}."
    if told:
        text += f" NCCL's log: {told[0]['message']}"
        action += f" First: {told[0]['advice']}" if told[0].get("advice") else ""
    one = _dominant_param(model, th["dominant_param_share"])
    if one and not small and not fsdp:
        action += (f" One parameter, {one['name']}, is {one['share']:.0%} of the gradient: if it is an embedding "
                   "table, sparse gradients (nn.Embedding(..., sparse=True)) or a sharded table send only the rows "
                   "a step uses.")
    out = {"text": text, "action": action,
           "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), "busbw_gbps": busbw,
                        "dominant_param": one, "nccl_log_findings": [f["id"] for f in told], "fsdp": fsdp,
                        "micro_batches": micro, "backend": analysis.get("backend"),
                        "compression_hook": None if fsdp else hook, **g}}
    if change:
        out["change"] = change
    elif not fsdp and out["evidence"]["compression_hook"] is None:
        out["change"] = None  # halving the bytes is no change this backend's user can make
    return out


def _micro_batches(analysis: dict, group: dict, th: dict) -> float | None:
    """Forward passes per optimizer step where DDP all-reduces after each of them (the group
    is an all-reduce and the step runs `accumulation_min_micro_batches` or more); else None."""
    acc = analysis.get("accumulation") if isinstance(analysis.get("accumulation"), dict) else {}
    fwd, opt = acc.get("forwards_per_step"), acc.get("optimizer_steps_per_step")
    if not ALL_REDUCE_RE.search(group["name"]) or not fwd or not opt:
        return None
    k = float(fwd) / float(opt)
    return round(k, 2) if opt >= 0.5 and k >= th["accumulation_min_micro_batches"] else None


def _compression_hook(analysis: dict) -> str | None:
    """The DDP compression hook that halves a gradient all-reduce's bytes on this rank's
    backend: bf16 where NCCL runs it (DDP refuses bf16_compress_hook without NCCL 2.10+);
    none on gloo, whose reduction of fp16 runs in software on the CPU (fp16_compress_hook made
    a 2-rank gloo all-reduce of 8 MB slower, not faster, in bench/fix_bank.py)."""
    backend = str(analysis.get("backend") or "").lower()
    on_device = (analysis.get("device_info") or {}).get("type") == "gpu" or \
        str(analysis.get("device") or "cpu").lower() not in ("cpu", "none")
    if backend == "nccl" or (not backend and on_device):
        return "bf16_compress_hook"
    return None


def _compression(hook: str | None) -> str:
    """The action's words on compressing the collective, with the hook the backend runs."""
    if hook:
        return (f"halve its bytes with the {hook.split('_')[0]} compression hook (ddp.register_comm_hook(None, "
                f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.{hook}))")
    return ("the compression hooks do not pay here: bf16_compress_hook needs NCCL, and gloo reduces fp16 in software "
            "on the CPU, which costs more than the bytes it saves on a fast link")


def _fsdp_action(name: str, fsdp: dict) -> str:
    """What makes FSDP's exposed all-gathers or gradient reductions overlap, by FSDP version
    (under FSDP an all-reduce reduces gradients too: HSDP's replicas, gloo's reduce-scatter)."""
    if not re.search(r"all_?gather", name, re.IGNORECASE):
        sync = "model.set_requires_gradient_sync(False)" if fsdp.get("version") == 2 else "model.no_sync()"
        return (f"FSDP's gradient {name} is exposed: skip it on all but the last micro-batch of an accumulation "
                f"({sync} on the others), and reduce in bf16 (FSDP2: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16); "
                "FSDP1: MixedPrecision(reduce_dtype=torch.bfloat16)).")
    if fsdp.get("version") == 2:
        fwd = fsdp.get("forward_prefetches_per_step") or 0
        return ("Prefetch FSDP's all-gathers: "
                + ("none is prefetched in forward here; " if not fwd else "")
                + "give each block the next ones to gather ahead (block.set_modules_to_forward_prefetch([next_block]), "
                  "and set_modules_to_backward_prefetch to reach further than the one unit it prefetches by default), "
                  "keep the root unsharded after forward (fully_shard(model, reshard_after_forward=False)) so that "
                  "backward starts without an all-gather, and gather in bf16 (MixedPrecisionPolicy(param_dtype="
                  "torch.bfloat16)); fewer, larger FSDP units send fewer, larger all-gathers.")
    return ("Prefetch FSDP's all-gathers: FullyShardedDataParallel(..., forward_prefetch=True, backward_prefetch="
            "BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True), gather in bf16 (MixedPrecision(param_dtype="
            "torch.bfloat16)), and wrap fewer, larger units (auto_wrap_policy) so that each all-gather is larger.")


def _mb(nbytes: float | None) -> str:
    if nbytes is None:
        return "unknown size"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} KB"


def _dominant_param(model: dict, share: float) -> dict | None:
    """The largest parameter, where it holds `share` of the model's parameters (and so of the
    gradient the collectives carry)."""
    n, name, params = model.get("largest_param"), model.get("largest_param_name"), model.get("params")
    if not (isinstance(n, int) and isinstance(name, str) and isinstance(params, int) and params > 0):
        return None
    return {"name": name, "elements": n, "share": round(n / params, 4)} if n >= share * params else None


def _bandwidth_kernels(ctx: JobContext) -> dict | None:
    """Bandwidth-bound kernels taking `bandwidth_kernels_step_share` of the step or more, named
    by the ops that launch them with the bandwidth they reach against the memory's peak: a
    group far under the peak (`bandwidth_slow_peak`, moving `bandwidth_min_call_mb` a call or
    more) has a layout to fix, the others bytes to cut."""
    minimum = ctx.tree.thresholds["bandwidth_kernels_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        traffic = analysis.get("memory_traffic")
        step_ms = _traced_step_ms(analysis)
        if not isinstance(traffic, dict) or not step_ms:
            continue
        groups = [g for g in traffic.get("groups") or [] if isinstance(g, dict) and g.get("peak_frac") is not None]
        total = float(traffic.get("bandwidth_ms_per_step") or 0.0)
        if groups and total >= minimum * step_ms:
            found[rank] = (traffic, groups, total, step_ms)
    if not found:
        return None
    traffic, groups, total, step_ms = found[min(found)]
    peak = traffic.get("peak_gbps")

    def rate(g: dict) -> str:
        return f"{_ms(float(g['ms_per_step']))} at {g['achieved_gbps']:,.0f} GB/s ({g['peak_frac']:.0%} of the peak)"
    listed = "; ".join(f"{g['name']}, {_times(float(g['calls_per_step']))}, {rate(g)}" for g in groups[:3])
    text = (f"On {_ranks(sorted(found))}, bandwidth-bound kernels run {_ms(total)} per traced step "
            f"({total / step_ms:.0%} of the step) against the memory's {peak:,.0f} GB/s peak; the most: {listed}.")
    irregular = [g for g in traffic.get("irregular") or [] if isinstance(g, dict)]
    if irregular:
        one = len(irregular[:2]) == 1
        text += (f" {', '.join(g['op'] + ' (' + _ms(float(g['ms_per_step'])) + ')' for g in irregular[:2])} "
                 f"read{'s' if one else ''} memory where {'its' if one else 'their'} indices point: "
                 f"{'its' if one else 'their'} bytes, and so {'its' if one else 'their'} rate, are not known.")
    th = ctx.tree.thresholds
    slow = [g for g in groups if float(g["peak_frac"]) < th["bandwidth_slow_peak"]
            and (num(g.get("mb_per_call")) or 0.0) >= th["bandwidth_min_call_mb"]]
    if slow:
        names = ", ".join(g["name"] for g in slow[:2])
        action = (f"Fix the memory layout behind {names}: at {slow[0]['peak_frac']:.0%} of the peak they read or "
                  "write with a stride (a transpose or a strided slice copied, a permute before a contiguous "
                  "op). Make such a tensor contiguous once where it is built, not every step, or produce it in "
                  "the layout its consumer reads (channels_last for convolutions).")
        change = "slow_bandwidth_kernels_at_target"
    else:
        best = max(float(g["peak_frac"]) for g in groups)
        action = (f"These kernels already move their bytes at up to {best:.0%} of the memory's peak: only fewer "
                  "bytes help. Fuse them (torch.compile), keep activations in bf16 (torch.autocast), and drop "
                  "copies the next op does not need (.contiguous(), .clone(), dtype casts).")
        change = None
    return {"text": text, "action": action, "change": change,
            "evidence": {"ranks": sorted(found), "ms_per_step": round(total, 4), "step_ms": round(step_ms, 3),
                         "peak_gbps": peak, "groups": groups, "irregular": irregular,
                         "rated_share": traffic.get("rated_share")}}


def _elementwise_chain(ctx: JobContext) -> dict | None:
    """A run of elementwise ops with no matrix math between them taking `fusion_chain_step_share`
    of the step or more: each op reads and writes whole tensors that one fused kernel would
    read once."""
    minimum = ctx.tree.thresholds["fusion_chain_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        analysis = merged.get("analysis") or {}
        chains = [c for c in analysis.get("elementwise_chains") or [] if isinstance(c, dict)]
        step_ms = _traced_step_ms(analysis)
        if chains and step_ms and float(chains[0].get("ms_per_step") or 0.0) >= minimum * step_ms:
            found[rank] = (chains[0], step_ms)
    if not found:
        return None
    chain, step_ms = found[min(found)]
    times = _times(chain["per_step"])
    return {
        "text": f"On {_ranks(sorted(found))}, a chain of {chain['length']} elementwise ops with no matrix math between "
                f"them ({chain['name']}) runs {times} per traced step, {chain['ms_per_step']:.1f} ms per step "
                f"({chain['ms_per_step'] / step_ms:.0%} of the step): each op reads and writes whole tensors that the "
                "next reads again.",
        "action": "Fuse the chain: torch.compile the module that runs it (its ops become one kernel that reads "
                  "the inputs once), or use the fused op where one exists (F.layer_norm, F.gelu, torch.addcmul, "
                  "a fused optimizer)." + _hand_written(chain["ops"]),
        "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), **chain},
    }


# Chains that compute by hand what one fused op computes: (ops the chain holds, what it is, the op).
HAND_WRITTEN = (
    ({"aten::exp", "aten::sum", "aten::div"}, "a softmax", "torch.softmax(x, dim)"),
    ({"aten::mean", "aten::rsqrt"}, "a normalisation", "F.layer_norm or torch.nn.RMSNorm"),
    ({"aten::mean", "aten::sqrt", "aten::div"}, "a normalisation", "F.layer_norm or torch.nn.RMSNorm"),
    ({"aten::var", "aten::sqrt"}, "a normalisation", "F.layer_norm or F.batch_norm"),
    ({"aten::tanh", "aten::pow", "aten::mul"}, "a tanh-approximated GELU", "F.gelu(x, approximate='tanh')"),
)


def _hand_written(ops: list[str]) -> str:
    """What a chain's ops compute by hand, where a fused op computes it (empty otherwise)."""
    names = set(ops)
    hit = next(((what, op) for need, what, op in HAND_WRITTEN if need <= names), None)
    return f" Its ops ({', '.join(ops)}) compute {hit[0]} by hand: {hit[1]} does it in one kernel." if hit else ""


RULES: tuple[CauseRule, ...] = (
    # The loader's settings and waits and the count of sync ops are the host's own facts.
    CauseRule("data_loader_no_workers", "data", _no_loader_workers, supersedes=("Raise DataLoader num_workers",),
              change="no_data_wait", device=False),
    CauseRule("data_loader_workers", "data", _loader_workers, supersedes=("Raise DataLoader num_workers",),
              change="no_data_wait", device=False),
    CauseRule("host_sync_points", "host", _host_sync_points, supersedes=("Remove synchronisation points",),
              change="no_sync_points", device=False, model=action_models.removal("the values kept on the device")),
    # The copy's device time is what the replay removes (the call that waits for it returns as
    # early); pinning it is modelled as that time at the pinned rate.
    CauseRule("pageable_copies", "data", _pageable_copies, supersedes=("Set pin_memory=True",),
              also=("host", "memory"), change="no_pageable_copies", model=action_models.pinned_copies),
    CauseRule("cpu_work_on_training_thread", "host", _cpu_work, change="no_cpu_work_on_thread",
              model=action_models.removal("the work moved off the training thread")),
    CauseRule("python_on_training_thread", "host", _python_gaps, change="no_python_gaps",
              supersedes=("Capture the step with CUDA graphs",),
              model=action_models.removal("the Python moved off the training thread")),
    CauseRule("launch_bound", "host", _launch_bound, supersedes=("Capture the step with CUDA graphs",),
              change="no_launch_cost"),
    CauseRule("allocator_calls", "host", _allocator_calls, change="no_allocator_calls",
              model=action_models.removal("no allocation in the driver inside the loop")),
    CauseRule("fp32_math", "compute", _fp32_math, supersedes=("Use lower precision",), change="tensor_core_math",
              model=action_models.autocast),
    # Its change is the detector's: bf16 replayed only on a CPU that may have bf16 units.
    CauseRule("matrix_ops", "compute", _matrix_ops, change="half_precision_matrix_ops"),
    CauseRule("elementwise_chain", "memory", _elementwise_chain, supersedes=("Fuse elementwise chains",),
              change="fuse_elementwise_chain"),
    # What a fused update saves is its passes over memory and its launches, which the trace does
    # not measure apart: no change of its own.
    CauseRule("optimizer_step", "memory", _optimizer_step, also=("host",)),
    CauseRule("bandwidth_kernels", "memory", _bandwidth_kernels),
    CauseRule("exposed_collectives", "comm", _exposed_collectives,
              supersedes=("Accumulate gradients", "Tune DDP bucket_cap_mb", "Compress gradients"),
              change="compressed_collective", model=action_models.collective),
)


def causes(ctx: JobContext) -> list[dict]:
    """The causes found, each with its rule's id and the phase it explains, the bounding phase's
    first, then by the gain their own changes predict: only
    for a phase that bounds the job or takes at least `recommendation_min_share` of its steps (a
    DataLoader without workers is no cause of a compute-bound job's time). A rule whose time can
    land in several phases explains the bounding one, else the first large enough."""
    shares = ctx.shares or {}
    minimum = ctx.tree.thresholds["recommendation_min_share"]
    seeing = _with_device_events(ctx)
    out = []
    for rule in RULES:
        phases = (rule.phase, *rule.also)
        # Compute time is the work itself: a cause of it only where it bounds the job.
        phase = ctx.bound if ctx.bound in phases else next(
            (p for p in phases if p != "compute" and (shares.get(p) or 0.0) >= minimum), None)
        if phase is None:
            continue
        found = rule.detect(seeing if rule.device else ctx)
        if found:
            # The action's own prediction where the rule models it ("expect"), and the ceiling:
            # the replay with the cause's time gone entirely.
            expect = found.pop("expect", None)
            pred = _prediction(ctx, found.pop("change", rule.change))
            if expect is None and rule.model is not None:
                expect = rule.model(ctx, found["evidence"], pred)
            out.append({"id": rule.id, "phase": phase, "supersedes": list(rule.supersedes), **found,
                        "what_if": pred, "expected": expect, "gain": cause_gain(expect, pred)})
    # The bounding phase's causes first, then the larger predicted gains.
    return sorted(out, key=lambda c: (c["phase"] != ctx.bound, -_speedup(c)))


def _with_device_events(ctx: JobContext):
    """The context without the ranks whose traces lack their GPU's device events: their op
    times are the host's launches, on which no cause about the device's work may rest."""
    ranks = {k: r for k, r in ctx.ranks.items() if not (r.get("analysis") or {}).get("device_events_missing")}
    return ctx if len(ranks) == len(ctx.ranks) else dataclasses.replace(ctx, ranks=ranks)


def _speedup(cause: dict) -> float:
    """What a cause's action is predicted to win, else its ceiling (1.0: nothing predicted)."""
    e = cause.get("expected")
    if e and e.get("expected_step_ms"):
        return e["baseline_step_ms"] / e["expected_step_ms"]
    return (cause.get("what_if") or {}).get("speedup") or 1.0


def _prediction(ctx: JobContext, change: str | None) -> dict | None:
    """The job's what-if entry of the change that removes the cause (None: the rule has none)."""
    if change is None:
        return None
    entry = next((e for e in ctx.job.get("what_if") or [] if isinstance(e, dict) and e.get("change") == change), None)
    if entry is None:
        return {"change": change, "predicted_step_ms": None, "speedup": None,
                "note": "the change was not replayed on these steps"}
    return {k: entry.get(k) for k in ("change", "description", "baseline_step_ms", "predicted_step_ms", "speedup",
                                      "note") if k in entry}
