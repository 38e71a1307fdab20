"""`diag plan --search`: every valid layout for the GPUs, ranked by predicted step time.

Enumerated: tensor parallelism over the divisors of the GPUs per node (and twice that,
to show why crossing nodes loses), pipeline parallelism over the divisors of the layers,
ZeRO stages 0-3, recomputation none/selective/full (sequence parallelism whenever tp > 1,
as Megatron-LM recommends), and micro-batches that divide the global batch. Layouts that
fit are ranked by predicted step time; the others are grouped by why they lose: out of
memory, a pipeline bubble over BUBBLE_LOSS of the step, or tensor parallelism across nodes.
"""

from __future__ import annotations

from dataclasses import replace

from diag.analyzers.plan.models import Model
from diag.analyzers.plan.planner import Job, Rates, plan, validate
from diag.errors import DiagInputError

SCHEMA = "diag.plan_search/1"

BUBBLE_LOSS = 0.20
MICRO_BATCHES = (1, 2, 4, 8, 16)
TOP = 3


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def candidates(model: Model, job: Job) -> list[Job]:
    out = []
    tps = [t for t in _divisors(job.gpus, 2 * job.gpus_per_node) if t & (t - 1) == 0]
    for tp in tps:
        for pp in _divisors(job.gpus // tp, 64):
            for sharding in ("0", "1", "2", "3"):
                # With FlashAttention selective recomputation keeps what "none" keeps: one of them.
                for recompute in (("none", "full") if job.flash else ("none", "selective", "full")):
                    for mb in MICRO_BATCHES:
                        j = replace(job, tp=tp, pp=pp, sp=tp > 1, sharding=sharding, recompute=recompute,
                                    micro_batch=mb)
                        try:
                            validate(model, j)
                        except DiagInputError:
                            continue
                        out.append(j)
    return out


def _label(doc: dict) -> str:
    lay = doc["layout"]
    return (f"tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}, ZeRO-{lay['zero_stage']}, "
            f"recompute {lay['recompute']}, micro-batch {lay['micro_batch']}")


def search(model: Model, job: Job, rates: Rates) -> dict:
    if job.gpu_memory_bytes is None:
        raise DiagInputError("--search needs the GPU memory (--gpu-memory or --device)")
    if job.global_batch is None:
        raise DiagInputError("--search needs --global-batch (the layouts must train on the same batch)")
    docs = [plan(model, j, rates) for j in candidates(model, job)]
    if not docs:
        raise DiagInputError("no valid layout: the global batch, layers and heads allow none for these GPUs")
    fitting = [d for d in docs if d["fits"] and not d["tp_crosses_nodes"]]
    timed = [d for d in fitting if d.get("step_time_s")]
    ranked = sorted(timed, key=lambda d: d["step_time_s"]) if timed else sorted(
        fitting, key=lambda d: d["per_gpu"]["total_bytes"])
    good = [d for d in ranked if (d.get("bubble_share") or 0.0) <= BUBBLE_LOSS] or ranked
    top = good[:TOP]
    losers = {
        "out_of_memory": [d for d in docs if not d["fits"]],
        "pipeline_bubble": [d for d in ranked if (d.get("bubble_share") or 0.0) > BUBBLE_LOSS],
        "tp_across_nodes": [d for d in docs if d["fits"] and d["tp_crosses_nodes"]],
    }
    why = {
        "out_of_memory": lambda d: (f"needs {d['per_gpu']['total_bytes'] / 2**30:.1f} GiB per GPU of "
                                    f"{job.gpu_memory_bytes / 2**30:.0f} GiB"),
        "pipeline_bubble": lambda d: f"the pipeline bubble takes {d['bubble_share']:.0%} of the step",
        "tp_across_nodes": lambda d: (f"tensor parallelism of {d['layout']['tp']} spans nodes: its collectives "
                                      "run at network, not NVLink, bandwidth on the critical path"),
    }
    best = top[0] if top else None
    return {
        "schema": SCHEMA,
        "layouts_considered": len(docs),
        "layouts_fitting": len(fitting),
        "best": [{"layout": _label(d), "plan": d, "why": _why_good(d, best)} for d in top],
        "losers": {k: {"count": len(v), "example": _label(v[0]) if v else None,
                       "why": why[k](v[0]) if v else None} for k, v in losers.items()},
        "rates": dict(rates.sources),
    }


def _why_good(d: dict, best: dict | None) -> str:
    mem = d["per_gpu"]["total_bytes"] / 2**30
    of = (d["per_gpu"]["gpu_memory_bytes"] or 0) / 2**30
    parts = [f"{mem:.1f} of {of:.0f} GiB per GPU"]
    if d.get("step_time_s"):
        parts.append(f"{d['step_time_s']:.2f} s per step")
        if d.get("mfu") is not None:
            parts.append(f"MFU {d['mfu']:.0%}")
        b = d.get("breakdown_s") or {}
        comm = b.get("tp_comm", 0) + b.get("pp_comm", 0) + b.get("dp_comm_exposed", 0)
        parts.append(f"communication on the critical path {comm / d['step_time_s']:.0%}")
        if best is not None and d is not best:
            parts.append(f"{d['step_time_s'] / best['step_time_s'] - 1:.0%} slower than the first")
    return ", ".join(parts)
