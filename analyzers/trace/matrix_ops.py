"""The matrix ops that do a step's work: which matmuls, convolutions and attention calls,
at what shapes and dtype, how fast against the device's peak, and on shapes the
tensor cores' tiles do not divide.

Ops are grouped by (top-level op, input shapes, dtype): a linear layer's forward is one
group, the same layer's weight gradient (an `aten::mm` in the backward pass) another, so a
group is one place in the model. Their time is the device time of the kernels they launch
on a device timeline (an op's kernels carry its External id), the op's own span on a CPU
one. Facts per traced step, for the diagnosis's compute causes; and, on a CPU timeline,
what running the fp32 ones in bf16 would save. Pure.
"""

from __future__ import annotations

import math

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace import roofline
from diag.analyzers.trace.columns import Trace

TOP_GROUPS = 5
# Tensor cores take operands in 16-byte rows: a GEMM dimension that is not a multiple of
# 16 bytes of its dtype falls back to slower tiles (NVIDIA's matrix-multiplication guide).
TILE_BYTES = 16
_ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def gemm_dims(name: str, dims: list) -> dict[str, int] | None:
    """The GEMM dimensions an op runs ({"M", "N", "K"}; a convolution's channels as "C_in",
    "C_out"), where its shapes say; None otherwise."""
    d = [x if isinstance(x, list) and all(isinstance(v, int) for v in x) else [] for x in dims]
    try:
        if name in ("aten::mm", "aten::matmul", "aten::bmm") and len(d[0]) >= 2 and len(d[1]) >= 2:
            return {"M": d[0][-2], "K": d[0][-1], "N": d[1][-1]}
        if name in ("aten::addmm", "aten::_addmm_activation", "aten::baddbmm") and len(d[1]) >= 2 and len(d[2]) >= 2:
            return {"M": d[1][-2], "K": d[1][-1], "N": d[2][-1]}
        if name == "aten::linear" and d[0] and len(d[1]) == 2:
            return {"M": math.prod(d[0][:-1]), "K": d[0][-1], "N": d[1][0]}
        if name.startswith("aten::conv") or name in ("aten::convolution", "aten::_convolution"):
            w = d[2] if name == "aten::convolution_backward" else d[1]
            return {"C_in": w[1], "C_out": w[0]} if len(w) >= 3 else None
    except IndexError:
        return None
    return None


def misaligned(dims: dict[str, int] | None, dtype: str) -> list[str]:
    """The dimensions the tensor cores' 16-byte rows do not divide, as "K=1000 (not a multiple of 8)"."""
    if not dims:
        return []
    step = TILE_BYTES // _ELEMENT_BYTES.get(dtype, 4)
    return [f"{k}={v} (not a multiple of {step})" for k, v in dims.items() if v % step]




def _op_time_us(trace: Trace, ops, on_device: bool) -> np.ndarray:
    """Per FLOP op (ops' rows), its time: on a device timeline the kernels launched inside its
    top-level op (a convolution's kernels carry the External id of the cuDNN op nested in
    it), on a CPU one its own span."""
    if not on_device:
        return trace.cpu_dur[ops.rows].astype(np.float64)
    out = np.zeros(len(ops.rows))
    launchers = trace.launcher_rows()
    kern = np.flatnonzero((trace.dev_kind == 0) & (launchers >= 0))
    launcher = launchers[kern]
    top = np.flatnonzero(ops.top)
    if not len(kern) or not len(top):
        return out
    rows = ops.rows[top]
    i = iv.span_holding(trace.cpu_ts[launcher], trace.cpu_tid[launcher], trace.cpu_ts[rows],
                        trace.cpu_ts[rows] + trace.cpu_dur[rows], trace.cpu_tid[rows])
    np.add.at(out, top[i[i >= 0]], trace.dev_dur[kern[i >= 0]])
    return out


def matrix_facts(trace: Trace, ops, win: np.ndarray, compute_us: np.ndarray, device, on_device: bool,
                 half_speedup: float, compute_part: np.ndarray = iv.EMPTY) -> tuple[dict | None, np.ndarray | None]:
    """({"ms_per_step", "compute_ms_per_step", "groups": [...]}, per-window µs that running the
    fp32 groups `half_speedup` times faster (bf16) would save on a CPU timeline, else None).

    Each group: op, shapes, dtype, calls and ms per step, achieved TFLOP/s, its fraction of
    the device's peak for the dtype (None where the peak is unknown), and on a device the
    dimensions the tensor cores' tiles do not divide."""
    n = len(win)
    if not n or not len(ops.rows) or not ops.top.any():
        return None, None
    time_us = _op_time_us(trace, ops, on_device)
    top = np.flatnonzero(ops.top)
    k = trace.step_of("cpu", win)[ops.rows[top]]
    top = top[(k >= 0) & (time_us[top] > 0)]
    if not len(top):
        return None, None
    groups: dict[tuple, dict] = {}
    for j in top.tolist():
        r = int(ops.rows[j])
        name = trace.names[trace.cpu_name[r]]
        sh = trace.shapes.get(r)
        dims = roofline.parse_shapes(sh[0], sh[1])[0] if sh else []
        shapes = roofline.shapes_text(dims)
        g = groups.setdefault((name, shapes, ops.dtype[j]), {"op": name, "shapes": shapes, "dtype": ops.dtype[j],
                                                              "dims": gemm_dims(name, dims), "calls": 0,
                                                              "us": 0.0, "flops": 0.0})
        g["calls"] += 1
        g["us"] += float(time_us[j])
        g["flops"] += float(ops.flops[j])
    total_us = sum(g["us"] for g in groups.values())
    rows = sorted(groups.values(), key=lambda g: -g["us"])[:TOP_GROUPS]
    facts = {
        "ms_per_step": round(total_us / 1e3 / n, 4),
        "compute_ms_per_step": round(float(np.sum(compute_us)) / 1e3 / n, 4),
        "groups": [_group(g, n, device, on_device) for g in rows],
    }
    return facts, (None if on_device else _cpu_half_saving(trace, ops, top, win, half_speedup, compute_part))


def _group(g: dict, n: int, device, on_device: bool) -> dict:
    tflops = g["flops"] / (g["us"] * 1e-6) / 1e12 if g["us"] > 0 else None
    peak = device.peak_flops(g["dtype"]) if device is not None else None
    if peak and tflops and g["dtype"] == "fp32" and tflops * 1e12 > peak and device.flops.get("tf32"):
        peak = device.flops["tf32"]  # above the fp32 peak: the kernels ran as TF32
    return {
        "name": f"{g['op']}({g['shapes']}) {g['dtype']}",
        "op": g["op"], "shapes": g["shapes"], "dtype": g["dtype"],
        "calls_per_step": round(g["calls"] / n, 2),
        "ms_per_step": round(g["us"] / 1e3 / n, 4),
        # Four significant digits: a CPU's matmuls run at hundredths of a TFLOP/s.
        "tflops": float(f"{tflops:.4g}") if tflops else None,
        "peak_fraction": round(tflops * 1e12 / peak, 4) if tflops and peak else None,
        # Tiles matter on tensor cores; a CPU's vector units are not judged by them.
        "misaligned": misaligned(g["dims"], g["dtype"]) if on_device else [],
        "dims": dict(g["dims"]) if g["dims"] else None,
    }


def _cpu_half_saving(trace: Trace, ops, top: np.ndarray, win: np.ndarray, speedup: float,
                     compute_part: np.ndarray) -> np.ndarray | None:
    """Per window, (1 - 1/speedup) of the compute time attributed inside the top-level fp32 matrix ops."""
    fp32 = [j for j in top.tolist() if ops.dtype[j] == "fp32"]
    if not fp32 or speedup <= 1.0:
        return None
    rows = ops.rows[fp32]
    spans = iv.from_arrays(trace.cpu_ts[rows], trace.cpu_ts[rows] + trace.cpu_dur[rows])
    return iv.measure_in_windows(iv.intersect(spans, compute_part), win) * (1.0 - 1.0 / speedup)
