"""The host's causes: values pulled to the host, pageable copies, launch-bound steps, the driver's
allocation calls, and the CPU work and Python the training thread runs between its launches."""

from __future__ import annotations

import re
from collections.abc import Callable

from diag.analyzers.analysis_types import PAGEABLE_HTOD_RE, SYNC_OP_NAMES, CauseFacts
from diag.analyzers.diagnosis.causes.common import (
    ms_text,
    ranks_text,
    recorded_loaders,
    times_text,
    traced_mean_ms,
    traced_step_ms,
)
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import step_iterations, traced_steps

# The call in the job's code that makes each op that brings a value to the host.
SYNC_OPS = dict(zip(SYNC_OP_NAMES, (".item()", "bool(tensor) or `if tensor:`", "nonzero() or boolean-mask indexing",
                                    "torch.equal()")))


def host_sync_points(ctx: JobContext) -> dict | None:
    """Ops that pull values to the host, at `sync_points_per_step` calls per traced step or more."""
    minimum = ctx.tree.thresholds["sync_points_per_step"]
    found = {}
    for rank, merged in ctx.ranks.items():
        facts = merged.facts
        traced = traced_steps(facts)
        ops = [o for o in facts.top_ops if isinstance(o, dict) and o.get("name") in SYNC_OPS]
        calls = sum(int(o.get("count") or 0) for o in ops) / traced if traced else 0.0
        if calls >= minimum:
            sites = [x for x in facts.causes.sync_sites if isinstance(x, dict) and x.get("function")]
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
        "text": f"Per traced step on {ranks_text(sorted(found))}, {listed}: {calls:.0f} values pulled to the host "
                "one at a time, each a wait for the device on a GPU"
                + (f"; the calls come from {', '.join(x['name'] for x in sites)}" if sites else "") + ".",
        "action": f"Keep the values on the device: replace the per-element {SYNC_OPS[first]}{where} with "
                  "tensor operations (sum, a mask, where, argmax) and read one result per step, or every N steps "
                  "for logging.",
        "evidence": {"ranks": sorted(found), "per_step": round(calls, 1), "traced_steps": traced,
                     "ops": [{"name": o["name"], "count": o["count"], "time_ms": o.get("time_ms")} for o in ops],
                     "call_sites": sites},
    }


def pageable_copies(ctx: JobContext) -> dict | None:
    """Host-to-device copies from pageable memory holding the host `pageable_copy_step_share`
    of the step or more."""
    minimum = ctx.tree.thresholds["pageable_copy_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        facts = merged.facts
        copies = [c for c in facts.causes.copies if isinstance(c, dict) and PAGEABLE_HTOD_RE.search(str(c.get("name")))]
        host_ms = sum(float(c.get("host_ms_per_step") or 0.0) for c in copies)
        step_ms = traced_step_ms(facts)
        if copies and step_ms and host_ms >= minimum * step_ms:
            found[rank] = (copies, host_ms, step_ms)
    if not found:
        return None
    copies, host_ms, step_ms = found[min(found)]
    calls = sum(float(c.get("calls_per_step") or 0.0) for c in copies)
    mb = sum(float(c.get("mb_per_step") or 0.0) for c in copies)
    loader = recorded_loaders(ctx).get(min(found))
    if loader is not None and not loader.get("pin_memory"):
        pin = f"Set pin_memory=True on the {loader['class']} over {loader['dataset']} (it has pin_memory=False)"
    else:
        pin = "Pin the host tensors: pin_memory=True on the DataLoader, or tensor.pin_memory() for those built in the loop"
    return {
        "text": f"On {ranks_text(sorted(found))}, {round(calls, 2):g} host-to-device copies per traced step ({mb:.1f} MB) read "
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


def launch_bound(ctx: JobContext) -> dict | None:
    """Launch calls that take the host `launch_bound_ratio` of the kernels' own time or more,
    and `launch_bound_step_share` of the step, at their median cost per call: the device waits
    for work to be launched."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        lf, step_ms = merged.facts.causes.launches, traced_step_ms(merged.facts)
        if not lf or not step_ms:
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
        "text": f"On {ranks_text(sorted(found))}, {lf['kernels_per_step']:g} kernels per traced step run a median "
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


def _timed_items_over(ctx: JobContext, items_of: Callable[[CauseFacts], list[dict]], share: str
                      ) -> dict[int, tuple]:
    """Per rank whose cause facts that `items_of` picks (a list of {"name", "ms_per_step", ...})
    add up to the threshold `share` of its traced step or more: (items, their ms per step, the
    step's ms, the rank's facts)."""
    minimum = ctx.tree.thresholds[share]
    found = {}
    for rank, merged in ctx.ranks.items():
        facts = merged.facts
        items = [c for c in items_of(facts.causes) if isinstance(c, dict) and c.get("ms_per_step")]
        step_ms = traced_step_ms(facts)
        total = sum(float(c["ms_per_step"]) for c in items)
        if items and step_ms and total >= minimum * step_ms:
            found[rank] = (items, total, step_ms, facts)
    return found


def allocator_calls(ctx: JobContext) -> dict | None:
    """Device-memory allocation and release calls (cudaMalloc, cudaFree, their HIP and driver
    forms) holding the host `allocator_step_share` of the step or more: PyTorch's caching
    allocator calls the driver only when its cache misses or is emptied."""
    found = _timed_items_over(ctx, lambda c: c.allocator, "allocator_step_share")
    if not found:
        return None
    calls, total, step_ms, facts = found[min(found)]
    listed = ", ".join(f"{c['name']} {times_text(c['calls_per_step'])} ({ms_text(c['ms_per_step'])}, the longest "
                       f"{ms_text(c['longest_ms'])})" for c in calls[:3])
    hip = any(str(c["name"]).startswith("hip") for c in calls)
    conf = "PYTORCH_HIP_ALLOC_CONF" if hip else "PYTORCH_CUDA_ALLOC_CONF"
    frees = any(re.search(r"Free|Release|Unmap", str(c["name"])) for c in calls)
    text = (f"On {ranks_text(sorted(found))}, per traced step {listed}: the host spends {ms_text(total)} "
            f"({total / step_ms:.0%} of the step) allocating and freeing device memory in the driver.")
    iters = step_iterations(facts)
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


def cpu_work(ctx: JobContext) -> dict | None:
    """Ops of the training thread that run on the CPU (no runtime call while they run) holding
    the host `cpu_work_step_share` of the step or more: the device waits while the thread that
    feeds it computes."""
    found = _timed_items_over(ctx, lambda c: c.cpu_work, "cpu_work_step_share")
    if not found:
        return None
    ops, total, step_ms, facts = found[min(found)]
    share = total / (traced_mean_ms(facts) or step_ms)
    listed = ", ".join(f"{o['name']} ({ms_text(float(o['ms_per_step']))})" for o in ops[:4])
    after = sum(float(o.get("after_ms_per_step") or 0.0) for o in ops)
    if after >= 0.05 * total:
        listed += (f"; and {ms_text(after)} right after these ops before the thread's next event (freeing their "
                   "tensors, the Python between them), which goes where the work goes")
    loader = recorded_loaders(ctx).get(min(found))
    where = "into " + _into_workers(loader)
    return {
        "text": f"On {ranks_text(sorted(found))}, the training thread runs {ms_text(total)} of CPU work per traced step "
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


def python_gaps(ctx: JobContext) -> dict | None:
    """Python the training thread runs outside every op, in stretches long enough to be work of
    its own, holding `python_work_step_share` of the step or more: nothing is launched meanwhile."""
    minimum = ctx.tree.thresholds["python_work_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        gaps, step_ms = merged.facts.causes.python_gaps, traced_mean_ms(merged.facts)
        if gaps and step_ms and float(gaps.get("ms_per_step") or 0.0) >= minimum * step_ms:
            found[rank] = (gaps, step_ms)
    if not found:
        return None
    gaps, step_ms = found[min(found)]
    ms = float(gaps["ms_per_step"])
    frames = [f for f in gaps.get("frames") or [] if isinstance(f, dict) and f.get("function")]
    where = ("; most of it in " + ", ".join(f"{f['function']} ({f['file']}:{f['line']}, {ms_text(float(f['ms_per_step']))})"
                                            for f in frames)) if frames else \
        ("; which code runs there shows in a window recorded with Python stacks (stack_windows, or "
         "torch.profiler's with_stack=True)")
    loader = recorded_loaders(ctx).get(min(found))
    into = _into_workers(loader)
    return {
        "text": f"On {ranks_text(sorted(found))}, the training thread runs Python outside every op for {ms_text(ms)} per traced "
                f"step ({ms / step_ms:.0%} of the step), in {gaps['stretches_per_step']:g} stretches of "
                f"{ctx.tree.thresholds['python_gap_min_us']:g} µs or more (the longest {ms_text(float(gaps['longest_ms']))}), "
                f"launching nothing meanwhile{where}. CUDA graphs and compilation do not shorten it.",
        "action": f"Move this Python work off the training thread: into {into}; or do it once before the loop.",
        "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), **gaps, "loader": loader},
    }
