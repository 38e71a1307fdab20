"""The communication cause: the collectives that expose the most time, with what the job's own
settings (bucket size, accumulation, compression hook, FSDP) say to change."""

from __future__ import annotations

import re
from typing import Any

from diag.analyzers.analysis_types import ALL_REDUCE_RE, RankFacts
from diag.analyzers.diagnosis.causes.common import ranks_text, times_text, traced_step_ms
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import recorded_model, traced_steps


def _collective_groups(facts: RankFacts) -> list[dict]:
    """The rank's collectives by (name, process group): calls, median bytes, and the time not
    hidden behind computation, per traced step; most exposed first."""
    traced = traced_steps(facts)
    groups: dict[tuple, dict] = {}
    for c in facts.causes.collectives:
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


def exposed_collectives(ctx: JobContext) -> dict | None:
    """The collective that carries the most exposed communication, once it exposes
    `collective_exposed_step_share` of the step; advice by its size and count."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        facts = merged.facts
        groups, step_ms = _collective_groups(facts), traced_step_ms(facts)
        if groups and step_ms and (groups[0]["exposed_ms_per_step"] or 0.0) >= th["collective_exposed_step_share"] * step_ms:
            found[rank] = (groups[0], step_ms, facts)
    if not found:
        return None
    g, step_ms, facts = found[min(found)]
    size = _mb(g["median_bytes"])
    pg = f" on process group {g['pg']}" if g.get("pg") not in (None, "", "default_pg", "0") else ""
    hidden = g["hidden_fraction"]
    busbw = (ctx.job.collectives.get("busbw") or {}).get("median_gbps")
    times = times_text(g["calls_per_step"])
    text = (f"On {ranks_text(sorted(found))}, {g['name']}{pg} of {size} runs {times} per traced "
            f"step and exposes {g['exposed_ms_per_step']:.1f} ms per step ({g['exposed_ms_per_step'] / step_ms:.0%} of the "
            f"step; {hidden:.0%} of its time hidden behind computation)"
            + (f", at a median bus bandwidth of {busbw:.2f} GB/s" if busbw else "") + ".")
    small = g["median_bytes"] is not None and g["median_bytes"] < th["small_collective_bytes"] and \
        g["calls_per_step"] >= th["small_collectives_per_step"]
    late = g["backward_known"] and g["after_backward"] >= th["collective_after_backward"] * g["backward_known"]
    hook = _compression_hook(facts)
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
    model = recorded_model(facts) or {}
    fsdp = facts.causes.fsdp
    change, micro = None, _micro_batches(facts, g, th)
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
    out: dict[str, Any] = {"text": text, "action": action,
           "evidence": {"ranks": sorted(found), "step_ms": round(step_ms, 3), "busbw_gbps": busbw,
                        "dominant_param": one, "nccl_log_findings": [f["id"] for f in told], "fsdp": fsdp,
                        "micro_batches": micro, "backend": facts.backend,
                        "compression_hook": None if fsdp else hook, **g}}
    if change:
        out["change"] = change
    elif not fsdp and out["evidence"]["compression_hook"] is None:
        out["change"] = None  # halving the bytes is no change this backend's user can make
    return out


def _micro_batches(facts: RankFacts, group: dict, th: dict) -> float | None:
    """Forward passes per optimizer step where DDP all-reduces after each of them (the group
    is an all-reduce and the step runs `accumulation_min_micro_batches` or more); else None."""
    acc = facts.causes.accumulation or {}
    fwd, opt = acc.get("forwards_per_step"), acc.get("optimizer_steps_per_step")
    if not ALL_REDUCE_RE.search(group["name"]) or not fwd or not opt:
        return None
    k = float(fwd) / float(opt)
    return round(k, 2) if opt >= 0.5 and k >= th["accumulation_min_micro_batches"] else None


def _compression_hook(facts: RankFacts) -> str | None:
    """The DDP compression hook that halves a gradient all-reduce's bytes on this rank's
    backend: bf16 where NCCL runs it (DDP refuses bf16_compress_hook without NCCL 2.10+);
    none on gloo, whose reduction of fp16 runs in software on the CPU (fp16_compress_hook made
    a 2-rank gloo all-reduce of 8 MB slower, not faster, in bench/fix_bank.py)."""
    backend = str(facts.backend or "").lower()
    on_device = (facts.device_info or {}).get("type") == "gpu" or \
        str(facts.device or "cpu").lower() not in ("cpu", "none")
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
