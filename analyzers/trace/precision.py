"""In which precision the device does its matrix math, read from the kernels' names.

cuBLAS, CUTLASS and cuDNN name their kernels by the math they run: `volta_sgemm_64x64_nt` and
`volta_scudnn_128x64_relu` are fp32 on the CUDA cores, `cutlass_80_tensorop_s1688gemm` is TF32
on the tensor cores, `volta_h884gemm` and `ampere_bf16_s16816gemm` are fp16 and bf16 on the
tensor cores. The names tell this even where the trace recorded no input types, and they tell
what the op's input dtype cannot: whether fp32 inputs ran as TF32.

Facts per traced step, for the diagnosis's compute causes: the matrix kernels' time by
precision, the fp32 ones by name, and the device's peaks by dtype. Pure.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace.columns import Trace

# Order matters: the first pattern that matches a kernel's name gives its precision.
PRECISIONS: tuple[tuple[str, re.Pattern], ...] = (
    ("fp8", re.compile(r"e4m3|e5m2|fp8", re.IGNORECASE)),
    ("half", re.compile(r"h884|h1688|h16816|hmma|hgemm|bf16|f16f16|fp16|_half|tensorop_h", re.IGNORECASE)),
    ("tf32", re.compile(r"tf32|tensorop_s1688|s1688gemm|tensorop_s16816|s16816gemm", re.IGNORECASE)),
    ("fp32", re.compile(r"sgemm|scudnn|sgemv|gemm_f32f32_f32f32_f32|implicit_convolve_sgemm|"
                        r"(?:dgrad|wgrad)\w*engine<float|conv2d_grouped_direct_kernel<float", re.IGNORECASE)),
)
MATH_RE = re.compile(r"gemm|gemv|cudnn|conv|mma|cutlass|xmma|Cijk_|(?:dgrad|wgrad)\w*engine", re.IGNORECASE)
TOP_FP32 = 3


def precision_of(name: str) -> str | None:
    """The precision a matrix kernel's name states, or None (not matrix math, or not said)."""
    if not MATH_RE.search(name):
        return None
    return next((p for p, rx in PRECISIONS if rx.search(name)), None)


def math_facts(trace: Trace, dev_classes: np.ndarray, win: np.ndarray, device) -> tuple[dict | None, np.ndarray | None]:
    """{"compute_ms_per_step", "<precision>_ms_per_step", "fp32_kernels", "peaks_tflops"} over
    the compute-class kernels starting in the windows (None without any); and per window, what
    running the fp32 (and, where bf16 is faster, TF32) kernels at the fastest tensor-core peak
    would save (µs), at the fraction of peak they reach now (None without the device's peaks)."""
    n = len(win)
    if not n or not len(trace.dev_ts):
        return None, None
    k = trace.step_of("dev", win)
    sel = np.flatnonzero((k >= 0) & (dev_classes == ec.COMPUTE) & (trace.dev_kind == 0))
    if not len(sel):
        return None, None
    by_name = np.bincount(trace.dev_name[sel], weights=trace.dev_dur[sel], minlength=len(trace.names))
    ms = {p: 0.0 for p, _ in PRECISIONS}
    fp32 = []
    for nid in np.flatnonzero(by_name).tolist():
        p = precision_of(trace.names[nid])
        if p is not None:
            ms[p] += float(by_name[nid]) / 1e3
            if p == "fp32":
                fp32.append((float(by_name[nid]) / 1e3, trace.names[nid]))
    fp32.sort(reverse=True)
    facts = {
        "compute_ms_per_step": round(float(trace.dev_dur[sel].sum()) / 1e3 / n, 4),
        **{f"{p}_ms_per_step": round(v / n, 4) for p, v in ms.items()},
        "fp32_kernels": [{"name": name, "ms_per_step": round(t / n, 4)} for t, name in fp32[:TOP_FP32]],
        "peaks_tflops": {d: round(v / 1e12, 1) for d, v in device.flops.items()} if device is not None else None,
    }
    return facts, _saving_by_window(trace, sel, k[sel], n, device)


def _saving_by_window(trace: Trace, sel: np.ndarray, window: np.ndarray, n: int, device) -> np.ndarray | None:
    peaks = device.flops if device is not None else {}
    fast = max((peaks.get(d) or 0.0) for d in ("bf16", "fp16"))
    if not fast or not peaks.get("fp32"):
        return None
    keep = {"fp32": 1.0 - peaks["fp32"] / fast}
    if peaks.get("tf32") and peaks["tf32"] < fast:
        keep["tf32"] = 1.0 - peaks["tf32"] / fast
    precision = {nid: precision_of(trace.names[nid]) for nid in np.unique(trace.dev_name[sel]).tolist()}
    factor = np.array([keep.get(precision[nid] or "", 0.0) for nid in trace.dev_name[sel].tolist()])
    return np.bincount(window, weights=trace.dev_dur[sel] * factor, minlength=n)

