"""The report's memory section: peak device memory against capacity, what the model's
states take of it, what each memory lever would free or cost, and the capacity advice.

The model states are what the agent read from the live model and optimizer
(diag.collectors.model_facts): parameters, gradients and optimizer state in the bytes this
rank held. What the measured peak holds beyond them is activations plus allocator and
library overhead. The levers, for a data-parallel group of Nd ranks (ZeRO, Rajbhandari et
al. SC'20, with the formulas of diag.analyzers.plan.memory):
- ZeRO-1 shards the optimizer state: frees (1 - 1/Nd) of it;
- ZeRO-2 also the gradients; ZeRO-3 / FSDP FULL_SHARD also the parameters;
- full activation recomputation keeps a layer's input, 2sbh of the 34sbh a transformer
  layer stores (Korthikanti et al., MLSys 2023): frees about 94% of the activations;
- each further sample per step costs the activations of one sample.
Computed here only; the views render it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from diag.analyzers.diagnosis.inputs import MergedRank, Ranks, num, recorded_model, size
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import percent as pct
from diag.analyzers.plan.memory import activations_per_layer


def recompute_keeps() -> float:
    """Share of a layer's activations that full recomputation keeps (2/34, from the formulas)."""
    full = activations_per_layer(1, 1, 1024, 16, recompute="full")
    return full / activations_per_layer(1, 1, 1024, 16, recompute="none", flash=True)


def _rank_peak_and_capacity(r: MergedRank) -> tuple[float | None, float | None]:
    # The larger of torch's peak allocation and NVML's memory in use (which includes the
    # caching allocator's reserve): what the device really had to hold.
    p = r.step_table.peak[~np.isnan(r.step_table.peak)]
    peak = float(p.max()) if len(p) else None
    gpus = [g for s in r.samples if isinstance(g := s.get("gpu"), dict)]
    caps = [c for c in (num(g.get("memory_total_bytes")) for g in gpus) if c]
    used = [u for u in (num(g.get("memory_used_bytes")) for g in gpus) if u is not None]
    if used:
        peak = max(peak or 0.0, max(used))
    cap = max(caps) if caps else None
    if cap is None:
        dev = dict_at(r.info, "device")
        cap = num(dev.get("memory_total_bytes")) or num(r.info.get("device_memory_total_bytes"))
    return peak, cap


def _facts(r: MergedRank) -> dict | None:
    for src in (r.info.get("model"), recorded_model(r.facts)):
        if isinstance(src, dict) and num(src.get("param_bytes")) is not None:
            return src
    return None


def breakdown(facts: dict | None, peak: float | None, samples: float | None) -> dict | None:
    """The model states as held, and the rest of the measured peak (activations and overhead)."""
    if facts is None:
        return None
    states = {"params_bytes": num(facts.get("param_bytes")) or 0.0, "grads_bytes": num(facts.get("grad_bytes")) or 0.0,
              "optimizer_bytes": num(facts.get("optimizer_state_bytes")) or 0.0,
              "buffers_bytes": num(facts.get("buffer_bytes")) or 0.0}
    held = sum(states.values())
    out = {**states, "model_states_bytes": held, "peak_bytes": peak, "activations_and_other_bytes": None,
           "activations_per_sample_bytes": None, "source": "the live model and optimizer, read by the agent"}
    if peak is not None and peak > held:
        out["activations_and_other_bytes"] = peak - held
        if samples:
            out["activations_per_sample_bytes"] = (peak - held) / samples
    return out


def levers(b: dict | None, dp: int, sharded: bool, samples: float | None) -> list[dict]:
    """What each memory lever frees (positive) or costs (negative), in bytes per GPU."""
    if b is None:
        return []
    out = []
    keep = 1.0 - 1.0 / dp if dp > 1 else 0.0
    if dp > 1 and not sharded:
        opt, grads, params = b["optimizer_bytes"], b["grads_bytes"], b["params_bytes"]
        out += [
            {"id": "zero1", "change": f"ZeRO-1: shard the optimizer state over the {dp} data-parallel ranks",
             "bytes": opt * keep},
            {"id": "zero2", "change": "ZeRO-2 (FSDP SHARD_GRAD_OP): also shard the gradients",
             "bytes": (opt + grads) * keep},
            {"id": "zero3", "change": "ZeRO-3 (FSDP FULL_SHARD): also shard the parameters",
             "bytes": (opt + grads + params) * keep},
        ]
    act = b.get("activations_and_other_bytes")
    if act:
        out.append({"id": "recompute", "change": "full activation recomputation (checkpoint every block)",
                    "bytes": act * (1.0 - recompute_keeps()),
                    "basis": "a transformer block keeps 2sbh of 34sbh per layer; other models differ"})
    per = b.get("activations_per_sample_bytes")
    if per and samples:
        out.append({"id": "double_batch", "change": f"double the per-device batch ({samples:.0f} -> "
                    f"{2 * samples:.0f} samples)", "bytes": -per * samples})
    return [x for x in out if x["bytes"]]


def memory_section(ranks: Ranks, tree, world: int | None = None) -> dict:
    """Peak device memory against capacity, the breakdown, the levers, and the advice."""
    peak, cap = {}, {}
    for r in ranks.values():
        p, c = _rank_peak_and_capacity(r)
        if p is not None:
            peak[r.rank] = p
        if c:
            cap[r.rank] = c
    fullest = max(peak, key=lambda k: peak[k]) if peak else next(iter(ranks), None)
    r = ranks.get(fullest) if fullest is not None else None
    facts = _facts(r) if r is not None else None
    if facts is None:
        facts = next((f for f in (_facts(x) for x in ranks.values()) if f), None)
    samples = None
    if r is not None:
        s = r.step_table.samples[~np.isnan(r.step_table.samples)]
        samples = float(np.median(s)) if len(s) else None
    b = breakdown(facts, peak.get(fullest) if fullest is not None else None, samples)
    dp = max(int(world or 1), 1)
    out: dict[str, Any] = {"peak_bytes": max(peak.values()) if peak else None,
           "capacity_bytes": min(cap.values()) if cap else None, "advice": None, "text": None,
           "breakdown": b, "levers": levers(b, dp, bool(facts and facts.get("sharded")), samples),
           "samples_per_step": samples}
    states = (f" The model states the agent read take {size(b['model_states_bytes'])} per rank (parameters "
              f"{size(b['params_bytes'])}, gradients {size(b['grads_bytes'])}, optimizer state "
              f"{size(b['optimizer_bytes'])}).") if b else ""
    fracs = [peak[k] / cap[k] for k in peak if k in cap and cap[k] > 0]
    if not peak:
        out["text"] = ("No device memory figures were recorded (a CPU-only run, or neither "
                       "torch.cuda memory statistics nor NVML were available)." + states)
        return out
    if not fracs:
        out["text"] = (f"Peak device memory allocated is {size(out['peak_bytes'])}; the device's capacity "
                       "is unknown (no NVML samples), so no capacity advice can be given." + states)
        return out
    hi, lo = max(fracs), min(fracs)
    out["used_fraction_max"] = hi
    out["used_fraction_min"] = lo
    limit = tree.thresholds["memory_capacity"]
    out["text"] = (f"Peak device memory is {size(out['peak_bytes'])} of {size(out['capacity_bytes'])} "
                   f"({pct(hi)} on the fullest rank, {pct(lo)} on the emptiest)." + states)
    if hi < limit:
        out["advice"] = _raise_batch(hi, limit, tree.thresholds["memory_target_use"], out, b, samples)
    elif hi >= tree.thresholds["memory_nearly_full"]:
        freeing = sorted((x for x in out["levers"] if x["bytes"] > 0), key=lambda x: -x["bytes"])
        actions = [f"{x['change']}: frees about {size(x['bytes'])} per GPU." for x in freeing[:3]] or [
            "Enable activation checkpointing on the largest blocks, or shard optimizer state (ZeRO/FSDP)."]
        out["advice"] = {
            "title": "Device memory is nearly full: make room before it fails or slows down",
            "actions": actions + [
                "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation.",
                "Lower the micro-batch and raise gradient accumulation to keep the global batch.",
            ],
            "gain": "Avoids out-of-memory failures and allocator retries (cudaFree/cudaMalloc stalls); "
                    "not quantified",
            "why": f"Device memory use peaks at {pct(hi)} of capacity.",
        }
    else:
        out["note"] = (f"Memory use is in the healthy range ({pct(limit)} to {pct(tree.thresholds['memory_nearly_full'])}"
                       " of capacity): no change needed.")
    return out


def _raise_batch(hi: float, limit: float, target: float, out: dict, b: dict | None, samples: float | None) -> dict:
    """The capacity advice, with how far the batch can grow (to `target` of capacity) where the
    activations per sample are known."""
    room = target * out["capacity_bytes"] - out["peak_bytes"]
    per = (b or {}).get("activations_per_sample_bytes")
    if per and samples and room > 0:
        extra = math.floor(room / per)
        first = (f"Raise the per-device batch from {samples:.0f} to about {samples + extra:.0f} samples: each sample's "
                 f"activations take {size(per)}, and {size(room)} is free below {pct(target)} of capacity "
                 f"(today the fullest rank uses {pct(hi)}).")
        out["batch_headroom"] = {"samples_now": samples, "samples_max": samples + extra, "free_bytes": room,
                                 "per_sample_bytes": per, "target_use": target}
    else:
        first = (f"Raise the per-device batch (or micro-batch) until peak memory nears {pct(target)} of capacity: "
                 f"{size(max(room, 0.0))} is free below that (today the fullest rank uses {pct(hi)}).")
    return {
        "title": "Use the free device memory: raise the batch size",
        "actions": [first, "Keep the global batch fixed by lowering gradient-accumulation steps, if you use them."],
        "gain": "Fewer, larger kernels and fewer optimizer and communication rounds per sample; "
                "not quantified from these measurements",
        "why": f"Device memory use peaks at {pct(hi)} of capacity, below {pct(limit)}.",
    }
