"""The compute causes: fp32 matrix math the tensor cores could run, and matrix ops by shape and
dtype with the dimensions their tiles do not divide."""

from __future__ import annotations

import re

from diag.analyzers.diagnosis.causes.common import ms_text, ranks_text, times_text
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import MergedRank, device_timeline
from diag.analyzers.numbers import dict_at


def fp32_math(ctx: JobContext) -> dict | None:
    """Matrix kernels that run fp32 on the CUDA cores, or TF32 where bf16 doubles the peak, for
    `fp32_math_share` of the compute kernels' time or more (precision from the kernels' names)."""
    minimum = ctx.tree.thresholds["fp32_math_share"]
    found = {}
    for rank, merged in ctx.ranks.items():
        m = merged.facts.causes.math
        if not m or not m.get("compute_ms_per_step"):
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
    text = f"On {ranks_text(sorted(found))}, {what}{peak}."
    odd = _untiled_in_half(ctx.ranks[min(found)], kind)
    if odd:
        text += (f" {ms_text(odd[0])} of them run on shapes that half precision's tiles do not divide either "
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


def _untiled_in_half(merged: MergedRank, kind: str) -> tuple[float, list[str]] | None:
    """Of the rank's matrix-op groups in `kind` (fp32, tf32), the time per step on dimensions
    that are not multiples of 8 (the half-precision tile), and those dimensions; None where
    none are, or under half the groups' time."""
    m = merged.facts.causes.matrix_ops
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
    return f"{g['op']} on {g['shapes']} in {g['dtype']}, {times_text(g['calls_per_step'])}, {g['ms_per_step']:.1f} ms{rate}{peak}"


def matrix_ops(ctx: JobContext) -> dict | None:
    """The matrix ops that do a compute-bound step's work, by shape and dtype, once they hold
    `matrix_ops_compute_share` of the compute time: what would make them faster, from their
    shapes (tiles the tensor cores do not divide), their rate (under `matrix_ops_low_peak` of
    the peak: too small to fill the device) and their dtype (fp32 on a CPU with bf16 units)."""
    th = ctx.tree.thresholds
    found = {}
    for rank, merged in ctx.ranks.items():
        m = merged.facts.causes.matrix_ops
        if m and m.get("groups") and m.get("compute_ms_per_step") and \
                float(m.get("ms_per_step") or 0.0) >= th["matrix_ops_compute_share"] * float(m["compute_ms_per_step"]):
            found[rank] = (m, merged)
    if not found:
        return None
    m, merged = found[min(found)]
    groups, device = m["groups"][:3], device_timeline(merged.facts)
    text = (f"On {ranks_text(sorted(found))}, matrix ops run {m['ms_per_step']:.1f} ms per traced step (compute in all: "
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
    cpu = dict_at(merged.info, "cpu")
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
