"""Plans grounded in an agent run (`diag plan --run`): the rates the run measured, and the
run's own model planned under other data-parallel layouts.

From the run's analysis (diag.analysis/1 of a run directory) this takes:
- the achieved FLOP/s of the device work: the profiled steps' operator FLOPs over their
  compute and memory-bound time (diag.analyzers.job.run_analysis.measured_rates), the
  median over ranks;
- the step split: data and host time per step, which no parallel layout changes, is kept
  as a constant overhead; communication and waiting are what the plan predicts anew;
- the bus bandwidth the run's own collectives achieved, timed by their fastest rank
  (diag.analyzers.job.cross_rank.achieved_busbw);
- what the live model and optimizer held (diag.collectors.model_facts): parameter count,
  bytes by dtype, gradients and optimizer state, and the configuration, if any.
A model without a recorded transformer shape (an MLP, a CNN) is planned from these facts
alone: its FLOPs per sample are measured, its model states are the recorded bytes
re-sharded by the ZeRO stage, and only data parallelism applies.
"""

from __future__ import annotations

from typing import Any

from diag.analyzers.numbers import median as _median
from diag.analyzers.plan.memory import zero_stage
from diag.analyzers.plan.planner import (
    FRAGMENTATION,
    SCHEMA,
    WORKSPACE_BYTES,
    Job,
    Rates,
    data_parallel,
    dp_comm_bytes,
    step_timing,
)
from diag.errors import DiagInputError


def run_facts(analysis: dict) -> dict:
    """What a run measured, from its analysis document (as JSON), in the units the planner uses."""
    ranks = [r for r in analysis.get("ranks") or [] if isinstance(r, dict)]
    if not ranks:
        raise DiagInputError("the run has no analysed rank")
    rates = [r.get("rates") or {} for r in ranks]
    model = next((r["model"] for r in ranks if isinstance(r.get("model"), dict)), None)
    shares = {c: _median((r.get("shares") or {}).get(c) for r in ranks) for c in
              ("data", "host", "comm", "wait", "memory", "compute")}
    # Unprofiled steps: what the plan predicts (the profiler slows the steps it records).
    step_s = _median(_median(s.get("duration_ms") for s in r.get("steps") or [] if s.get("evidence") == "sampled")
                     for r in ranks) or _median((r.get("step_time_ms") or {}).get("p50") for r in ranks)
    step_s = step_s / 1000.0 if step_s else None
    samples = _median(s.get("samples") for r in ranks for s in r.get("steps") or [])
    tokens = _median(s.get("tokens") for r in ranks for s in r.get("steps") or [])
    world = (analysis.get("run") or {}).get("world_size") or next(
        (r["world_size"] for r in ranks if isinstance(r.get("world_size"), int)), None) or len(ranks)
    hosts = {r.get("host") for r in ranks if r.get("host")}
    busbw = ((analysis.get("job") or {}).get("collectives") or {}).get("busbw")
    overhead = None
    if step_s and shares["data"] is not None and shares["host"] is not None:
        overhead = (shares["data"] + shares["host"]) * step_s
    return {
        "source": analysis.get("source"),
        "world_size": world,
        "hosts": len(hosts) or 1,
        "device": next((r["device"] for r in ranks if r.get("device")), None),
        "model": model,
        "achieved_flops_per_s": _median(x.get("achieved_flops_per_s") for x in rates),
        "flops_per_step": _median(x.get("flops_per_step") for x in rates),
        "flops_per_sample": _median(x.get("flops_per_sample") for x in rates),
        "flops_per_token": _median(x.get("flops_per_token") for x in rates),
        "profiled_steps": sum(int(x.get("steps") or 0) for x in rates),
        "step_time_s": step_s,
        "shares": shares,
        "overhead_s": overhead,
        "samples_per_step": samples,
        "tokens_per_step": tokens,
        "busbw_gbps": busbw.get("median_gbps") if isinstance(busbw, dict) else None,
        "busbw": busbw if isinstance(busbw, dict) else None,
    }


def measured_rates(facts: dict, base: Rates) -> Rates:
    """`base` (flags, --nccl, datasheets) with the run's measurements in place of what it assumed.

    Bus bandwidth measured by nccl-tests or `diag nccl` (already in `base`) is kept over
    the run's own collectives, which share the links with the training.
    """
    src = dict(base.sources)
    flops = base.flops_per_gpu
    if facts.get("achieved_flops_per_s"):
        flops = facts["achieved_flops_per_s"]
        src["flops"] = (f"measured: {flops / 1e9:.1f} GFLOP/s of device work on {facts['device'] or 'the device'} "
                        f"({facts['profiled_steps']} profiled step(s) of the run)")
    intra, inter = base.intra_busbw, base.inter_busbw
    if facts.get("busbw_gbps"):
        where = "inter" if facts["hosts"] > 1 else "intra"
        if (inter if where == "inter" else intra) is None or not src.get(f"{where}_busbw", "").startswith("measured"):
            bw = facts["busbw_gbps"] * 1e9
            b = facts["busbw"]
            src[f"{where}_busbw"] = (f"measured: {facts['busbw_gbps']:.2f} GB/s bus bandwidth of the run's own "
                                     f"{b['collectives']} collectives ({b['median_bytes']} B median), "
                                     "timed by their fastest rank")
            intra, inter = (intra, bw) if where == "inter" else (bw, inter)
    overhead = facts.get("overhead_s") or 0.0
    if overhead:
        sh = facts["shares"]
        src["overhead"] = (f"measured: {overhead * 1e3:.1f} ms of data wait and host work per step "
                           f"({(sh['data'] + sh['host']):.1%} of the run's step), kept as it is")
    return Rates(flops_per_gpu=flops, peak_flops=base.peak_flops, intra_busbw=intra, inter_busbw=inter,
                 sources=src, overhead_s=overhead)


def plan_own_model(facts: dict, job: Job, rates: Rates) -> dict:
    """A data-parallel layout of the run's own model, from its recorded bytes and measured FLOPs.

    `job.micro_batch` is samples per GPU per step; the run's model states are per GPU as
    recorded, un-sharded back to the full model when the run itself was sharded.
    """
    m = facts.get("model")
    if not m:
        raise DiagInputError("the run recorded no model facts: call agent.watch(model, optimizer) in the training "
                             "script, or give the model with --model, --hf-config or the shape flags")
    if job.tp > 1 or job.pp > 1:
        raise DiagInputError("tensor and pipeline parallelism need the model's transformer shape: give --model, "
                             "--hf-config or the shape flags")
    dp = data_parallel(job.gpus, 1, 1)
    stage = zero_stage(job.sharding)
    full = m.get("params") or 0
    held = m.get("local_params") or full
    # Bytes per parameter as the run held them (its precision and optimizer, measured).
    per = {k: (m.get(f"{k}_bytes") or 0) / held if held else 0.0 for k in ("param", "grad", "optimizer_state")}
    params_b = per["param"] * full / (dp if stage >= 3 else 1)
    grads_b = per["grad"] * full / (dp if stage >= 2 else 1)
    opt_b = 0.0 if job.offload else per["optimizer_state"] * full / (dp if stage >= 1 else 1)
    states = params_b + grads_b + opt_b
    allowance = WORKSPACE_BYTES + FRAGMENTATION * states
    fits = None
    flops_sample = facts.get("flops_per_sample")
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "model": {"name": m.get("class") or "the run's model", "params": full, "source": "recorded by the agent"},
        "layout": {"gpus": job.gpus, "gpus_per_node": job.gpus_per_node, "dp": dp, "tp": 1, "pp": 1,
                   "sharding": job.sharding, "zero_stage": stage, "micro_batch": job.micro_batch, "grad_accum": 1,
                   "global_batch": job.micro_batch * dp, "offload": job.offload},
        "per_gpu": {"params_bytes": params_b, "grads_bytes": grads_b, "optimizer_bytes": opt_b,
                    "activations_bytes": None, "allowance_bytes": allowance, "total_bytes": None,
                    "gpu_memory_bytes": job.gpu_memory_bytes,
                    "note": "activations are not modelled without a transformer shape; the report's memory "
                            "section gives them from the measured peak where the device reports one"},
        "fits": fits,
        "comm_bytes_per_step": dp_comm_bytes(per["grad"] * full, dp, stage, 1),
        "rates": dict(rates.sources),
    }
    if job.gpu_memory_bytes is not None and states + allowance > job.gpu_memory_bytes:
        out["fits"] = False  # the model states alone do not fit
    if not (flops_sample and rates.flops_per_gpu):
        out.update(step_time_s=None, breakdown_s=None, missing="measured FLOPs per sample (a profiled step with "
                   "agent.step(samples=...))")
        return out
    compute = flops_sample * job.micro_batch / rates.flops_per_gpu
    groups = {"tp": 0.0, "pp": 0.0, "dp": sum(out["comm_bytes_per_step"].values())}
    out.update(step_timing(job, rates, compute, 1, groups))
    out["model_flops_per_step"] = flops_sample * job.micro_batch * dp
    if out["step_time_s"] and rates.peak_flops:
        out["mfu"] = out["model_flops_per_step"] / (out["step_time_s"] * job.gpus * rates.peak_flops)
    return out


def self_check(facts: dict, predicted_step_s: float | None) -> dict | None:
    """The plan of the run's own layout beside the step time the run measured."""
    measured = facts.get("step_time_s")
    if not (measured and predicted_step_s):
        return None
    return {"measured_step_s": measured, "predicted_step_s": predicted_step_s,
            "error": predicted_step_s / measured - 1.0}
