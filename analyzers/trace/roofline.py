"""Arithmetic intensity of ops from recorded shapes and FLOPs, against the roofline knee.

With `record_shapes=True` and `with_flops=True`, torch.profiler writes each op's input
dimensions and dtypes and, for matmuls and convolutions, its FLOP count. Intensity is
FLOPs per byte moved (inputs read once plus the output written once, the lower bound a
kernel can achieve). An op whose intensity is at or above the device's knee
(peak FLOP/s / peak bytes/s for its dtype) can be compute-bound; below it, it is
bandwidth-bound however well its kernel is written.
"""

from __future__ import annotations

import math
import re

import msgspec

from diag.analyzers.dtypes import element_bytes

_PEAK_DTYPE = {"c10::Half": "fp16", "half": "fp16", "c10::BFloat16": "bf16", "bfloat16": "bf16",
               "float": "fp32", "double": "fp32"}

_decode = msgspec.json.Decoder().decode


# Ops whose FLOPs diag derives from recorded shapes. Recent PyTorch (2.x) writes
# `with_flops` counts only into key_averages(), not into the trace's args, so the trace
# alone needs this; a "flops" arg, where an older version wrote one, takes precedence.
FLOP_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::baddbmm", "aten::matmul",
    "aten::linear", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution",
    "aten::_convolution", "aten::convolution_backward", "aten::scaled_dot_product_attention",
})
# Elementwise, copy and reduction ops whose shapes are kept at load: the bytes their kernels
# move, for the achieved bandwidth of the bandwidth-bound kernels they launch.
_ELEMENTWISE = ("add", "sub", "mul", "div", "neg", "abs", "pow", "sqrt", "rsqrt", "exp", "log", "relu", "gelu",
                "silu", "sigmoid", "tanh", "clamp", "where", "masked_fill", "fill", "zero", "lerp", "addcmul",
                "addcdiv", "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward",
                "tanh_backward", "dropout", "native_dropout", "native_dropout_backward", "bernoulli", "uniform",
                "normal", "eq", "ne", "lt", "gt", "le", "ge", "maximum", "minimum", "square", "reciprocal", "sign",
                "floor", "ceil", "round", "cos", "sin", "erf", "hardtanh", "leaky_relu", "elu", "mish")
_COPIES = ("copy_", "clone", "_to_copy", "cat", "stack", "index", "index_select", "gather", "scatter", "scatter_add",
           "index_put_", "index_add_", "embedding", "embedding_dense_backward", "flip", "roll", "repeat",
           "constant_pad_nd", "masked_select", "nonzero", "sort", "topk", "cumsum")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "var_mean",
               "argmax", "argmin", "prod", "all", "any", "softmax", "_softmax", "log_softmax", "_log_softmax",
               "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm",
               "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
               "native_batch_norm", "native_batch_norm_backward", "_fused_rms_norm", "nll_loss",
               "nll_loss_forward", "nll_loss_backward", "mse_loss", "cross_entropy_loss")
REDUCTION_NAMES = frozenset(_REDUCTIONS)
BANDWIDTH_OPS = frozenset(f"aten::{op}{suffix}" for op in _ELEMENTWISE + _COPIES + _REDUCTIONS
                          for suffix in ("", "_")) - FLOP_OPS
_INTS = re.compile(r"-?\d+")


def _ints(text) -> list[int]:
    return [int(x) for x in _INTS.findall(text)] if isinstance(text, str) else []


def estimate_flops(name: str, dims: list, concrete: list) -> tuple[float, int | None] | None:
    """(FLOPs, output elements) of a matmul/convolution/attention op from its shapes."""
    try:
        return _estimate(name, dims, concrete)
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        return None


def _estimate(name, dims, concrete):
    d = [x if isinstance(x, list) else [] for x in dims]
    if name in ("aten::mm", "aten::matmul") and len(d[0]) >= 2 and len(d[1]) >= 2:
        batch = math.prod(d[0][:-2]) if len(d[0]) > 2 else 1
        m, k, n = d[0][-2], d[0][-1], d[1][-1]
        return 2.0 * batch * m * k * n, batch * m * n
    if name in ("aten::addmm", "aten::_addmm_activation") and len(d) >= 3 and len(d[1]) == 2:
        m, k, n = d[1][0], d[1][1], d[2][1]
        return 2.0 * m * k * n, m * n
    if name == "aten::linear" and len(d) >= 2 and d[0] and len(d[1]) == 2:
        rows = math.prod(d[0][:-1])
        k, n = d[0][-1], d[1][0]
        return 2.0 * rows * k * n, rows * n
    if name == "aten::bmm" and len(d[0]) == 3:
        b, m, k, n = d[0][0], d[0][1], d[0][2], d[1][2]
        return 2.0 * b * m * k * n, b * m * n
    if name == "aten::baddbmm" and len(d) >= 3 and len(d[1]) == 3:
        b, m, k, n = d[1][0], d[1][1], d[1][2], d[2][2]
        return 2.0 * b * m * k * n, b * m * n
    if name in ("aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution", "aten::_convolution"):
        x, w = d[0], d[1]
        if len(x) < 3 or len(w) != len(x):
            return None
        nsp = len(x) - 2
        stride = _ints(concrete[3]) if len(concrete) > 3 else []
        pad = _ints(concrete[4]) if len(concrete) > 4 else []
        dil = _ints(concrete[5]) if len(concrete) > 5 else []
        stride = (stride or [1]) * (nsp if len(stride) <= 1 else 1)
        pad = (pad or [0]) * (nsp if len(pad) <= 1 else 1)
        dil = (dil or [1]) * (nsp if len(dil) <= 1 else 1)
        out_sp = [(x[2 + i] + 2 * pad[i] - dil[i] * (w[2 + i] - 1) - 1) // stride[i] + 1 for i in range(nsp)]
        out = x[0] * w[0] * math.prod(out_sp)
        # Each output element: Cin/groups * kernel multiply-adds (weight dim 1 is Cin/groups).
        return 2.0 * out * w[1] * math.prod(w[2:]), out
    if name == "aten::convolution_backward":
        go, x, w = d[0], d[1], d[2]
        if len(go) < 3 or len(w) != len(go):
            return None
        fwd = 2.0 * math.prod(go) * w[1] * math.prod(w[2:])
        mask = re.findall(r"True|False", concrete[10]) if len(concrete) > 10 and isinstance(concrete[10], str) else []
        grads = sum(1 for m in mask[:2] if m == "True") if mask else 2
        return fwd * grads, math.prod(x)
    if name == "aten::scaled_dot_product_attention" and len(d) >= 3 and len(d[0]) >= 3:
        q, k, v = d[0], d[1], d[2]
        batch = math.prod(q[:-2])
        lq, e, lk, ev = q[-2], q[-1], k[-2], v[-1]
        return 2.0 * batch * lq * lk * (e + ev), batch * lq * ev
    return None


def parse_shapes(dims_raw: bytes, types_raw: bytes | None) -> tuple[list, list]:
    try:
        dims = _decode(dims_raw) if dims_raw else []
        types = _decode(types_raw) if types_raw else []
    except (msgspec.DecodeError, UnicodeDecodeError):  # damaged shapes: the op's FLOPs are unknown
        return [], []
    if not isinstance(dims, list):
        dims = []
    if not isinstance(types, list):
        types = []
    return dims, types


def numel(shape) -> int | None:
    """Elements of a tensor's recorded shape (None: not a tensor's shape)."""
    if not isinstance(shape, list) or not shape or not all(isinstance(x, int) for x in shape):
        return None
    return math.prod(shape)


def shapes_text(dims: list) -> str:
    """An op's tensor inputs as "512x1024, 768x1024" (scalars and empty lists left out)."""
    tensors = [x for x in dims if isinstance(x, list) and x and all(isinstance(v, int) for v in x)]
    return ", ".join("x".join(map(str, t)) for t in tensors[:3])


def op_dtype(types: list) -> str:
    """Peak-table dtype ("bf16", "fp16", "fp32") of an op from its input types."""
    for t in types:
        if t in _PEAK_DTYPE:
            return _PEAK_DTYPE[t]
    return "fp32"


def op_bytes(name: str, dims: list, types: list, out_numel: int | None = None) -> float | None:
    """Bytes an op must move at least: its tensor inputs plus its output."""
    tensors = []
    for i, d in enumerate(dims):
        n = numel(d)
        t = types[i] if i < len(types) else None
        if n is not None and (size := element_bytes(t)) is not None:
            tensors.append((d, n, size))
    if not tensors:
        return None
    read = sum(n * b for _, n, b in tensors)
    elem = tensors[0][2]
    out = out_numel if out_numel is not None else _outputnumel(name, [d for d, _, _ in tensors])
    if out is None:
        out = max(n for _, n, _ in tensors)
    return float(read + out * elem)


def _outputnumel(name: str, shapes: list) -> int | None:
    base = name.split("::")[-1]
    try:
        if base in ("mm", "matmul") and len(shapes) >= 2:
            return shapes[0][-2] * shapes[1][-1] if len(shapes[0]) >= 2 else shapes[1][-1]
        if base in ("addmm", "_addmm_activation") and len(shapes) >= 3:
            return shapes[1][0] * shapes[2][1]
        if base == "bmm" and len(shapes) >= 2:
            return shapes[0][0] * shapes[0][1] * shapes[1][2]
        if base == "baddbmm" and len(shapes) >= 3:
            return shapes[1][0] * shapes[1][1] * shapes[2][2]
        if base.startswith(("conv", "_convolution", "convolution", "cudnn_conv", "mkldnn_conv")) \
                and len(shapes) >= 2 and len(shapes[0]) >= 3 and len(shapes[1]) >= 2:
            # Output channels from the weight; spatial size taken as the input's (stride 1).
            return shapes[0][0] * shapes[1][0] * math.prod(shapes[0][2:])
    except (IndexError, TypeError):
        return None
    return None


def intensity(flops: float, nbytes: float | None) -> float | None:
    if not nbytes or nbytes <= 0 or not flops or flops <= 0:
        return None
    return flops / nbytes


def is_compute_bound(ai: float | None, knee: float | None) -> bool | None:
    """True at or above the knee, False below, None when either is unknown."""
    if ai is None or knee is None:
        return None
    return ai >= knee
