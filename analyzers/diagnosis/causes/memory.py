"""The memory causes: the optimizer's step, bandwidth-bound kernels far below the memory's peak,
and chains of elementwise ops a fused kernel would run in one pass."""

from __future__ import annotations

from diag.analyzers.diagnosis.causes.common import ms_text, ranks_text, times_text, traced_step_ms
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import num

# torch.optim optimizers with a fused implementation (one kernel launch for all parameters).
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")


def optimizer_step(ctx: JobContext) -> dict | None:
    """An optimizer that is not fused, whose step holds the host or the device for
    `optimizer_step_share` of the step or more: a for-loop or foreach update makes a pass over
    memory (and a launch) per tensor or per op that a fused one makes once. A for-loop over
    fewer than `optimizer_min_loop_ops` tensors is not named: there is nothing to fuse."""
    minimum = ctx.tree.thresholds["optimizer_step_share"]
    min_loop = ctx.tree.thresholds["optimizer_min_loop_ops"]
    found = {}
    for rank, merged in ctx.ranks.items():
        opt, step_ms = merged.facts.causes.optimizer, traced_step_ms(merged.facts)
        if not opt or opt.get("implementation") == "fused" or not step_ms:
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
    text = (f"On {ranks_text(sorted(found))}, the {name} optimizer's step ({impl}: {opt['ops_per_step']:g} ops"
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


def bandwidth_kernels(ctx: JobContext) -> dict | None:
    """Bandwidth-bound kernels taking `bandwidth_kernels_step_share` of the step or more, named
    by the ops that launch them with the bandwidth they reach against the memory's peak: a
    group far under the peak (`bandwidth_slow_peak`, moving `bandwidth_min_call_mb` a call or
    more) has a layout to fix, the others bytes to cut."""
    minimum = ctx.tree.thresholds["bandwidth_kernels_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        traffic = merged.facts.causes.memory_traffic
        step_ms = traced_step_ms(merged.facts)
        if not traffic or not step_ms:
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
        return f"{ms_text(float(g['ms_per_step']))} at {g['achieved_gbps']:,.0f} GB/s ({g['peak_frac']:.0%} of the peak)"
    listed = "; ".join(f"{g['name']}, {times_text(float(g['calls_per_step']))}, {rate(g)}" for g in groups[:3])
    text = (f"On {ranks_text(sorted(found))}, bandwidth-bound kernels run {ms_text(total)} per traced step "
            f"({total / step_ms:.0%} of the step) against the memory's {peak:,.0f} GB/s peak; the most: {listed}.")
    irregular = [g for g in traffic.get("irregular") or [] if isinstance(g, dict)]
    if irregular:
        one = len(irregular[:2]) == 1
        text += (f" {', '.join(g['op'] + ' (' + ms_text(float(g['ms_per_step'])) + ')' for g in irregular[:2])} "
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


def elementwise_chain(ctx: JobContext) -> dict | None:
    """A run of elementwise ops with no matrix math between them taking `fusion_chain_step_share`
    of the step or more: each op reads and writes whole tensors that one fused kernel would
    read once."""
    minimum = ctx.tree.thresholds["fusion_chain_step_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        chains = [c for c in merged.facts.causes.elementwise_chains if isinstance(c, dict)]
        step_ms = traced_step_ms(merged.facts)
        if chains and step_ms and float(chains[0].get("ms_per_step") or 0.0) >= minimum * step_ms:
            found[rank] = (chains[0], step_ms)
    if not found:
        return None
    chain, step_ms = found[min(found)]
    times = times_text(chain["per_step"])
    return {
        "text": f"On {ranks_text(sorted(found))}, a chain of {chain['length']} elementwise ops with no matrix math between "
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
