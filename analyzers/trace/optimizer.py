"""The optimizer's step, per traced step: which optimizer, how it is implemented, and what it
costs the host and the device.

torch.optim marks each step with an `Optimizer.step#<Class>.step` annotation. Inside it, the
implementation shows in the ops: a fused one (`fused=True`: `aten::_fused_adamw_` and kin, or
a fused class such as apex's FusedAdam) launches a few kernels for all parameters; a foreach
one (`aten::_foreach_*`) a few per group of tensors; the for-loop one several small ops per
parameter, each its own kernel and its own pass over memory. Pure.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.columns import Trace

STEP_RE = re.compile(r"^Optimizer\.step#(\w+)\.step$")
OP, ANNOTATION = 0, 1  # cpu_kind codes (schema.CPU_CATS); 2021 traces record the step as an op


def implementation(name: str, op_names: set[str]) -> str:
    """"fused", "foreach" or "for-loop", from the optimizer's class name and the ops it ran."""
    if name.lower().startswith("fused") or any(n.startswith("aten::_fused_") for n in op_names):
        return "fused"
    if any(n.startswith("aten::_foreach_") for n in op_names):
        return "foreach"
    return "for-loop"


def optimizer_facts(trace: Trace, win: np.ndarray) -> dict | None:
    """{"name", "implementation", "calls_per_step", "ms_per_step" (the host's span),
    "ops_per_step", "kernels_per_step", "kernel_ms_per_step"} of the optimizer taking the
    most host time in the traced steps; None where no step ran one."""
    n = len(win)
    ids = {i: m.group(1) for i, name in enumerate(trace.names) if (m := STEP_RE.match(name))}
    if not n or not ids:
        return None
    k = trace.step_of("cpu", win)
    rows = np.flatnonzero((k >= 0) & (trace.cpu_kind <= ANNOTATION) & np.isin(trace.cpu_name, list(ids)))
    if not len(rows):
        return None
    by_class: dict[str, list[int]] = {}
    for r in rows.tolist():
        by_class.setdefault(ids[int(trace.cpu_name[r])], []).append(r)
    name, spans = max(by_class.items(), key=lambda kv: float(trace.cpu_dur[kv[1]].sum()))
    spans = np.array(spans)
    start, end, tid = trace.cpu_ts[spans], trace.cpu_ts[spans] + trace.cpu_dur[spans], trace.cpu_tid[spans]
    ops = np.flatnonzero((trace.cpu_kind == OP) & np.isin(trace.cpu_tid, np.unique(tid)))
    ops = ops[(iv.span_holding(trace.cpu_ts[ops], trace.cpu_tid[ops], start, end, tid) >= 0) & ~np.isin(ops, spans)]
    launcher = trace.launcher_rows()
    kern = np.flatnonzero((trace.dev_kind == 0) & (launcher >= 0))
    kern = kern[np.isin(launcher[kern], ops)] if len(ops) else kern[:0]
    op_names = {trace.names[i] for i in np.unique(trace.cpu_name[ops]).tolist()}
    return {
        "name": name,
        "implementation": implementation(name, op_names),
        "calls_per_step": round(len(spans) / n, 3),
        "ms_per_step": round(float(trace.cpu_dur[spans].sum()) / 1e3 / n, 4),
        "ops_per_step": round(len(ops) / n, 2),
        "kernels_per_step": round(len(kern) / n, 2),
        "kernel_ms_per_step": round(float(trace.dev_dur[kern].sum()) / 1e3 / n, 4),
    }

