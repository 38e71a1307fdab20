"""The bandwidth-bound kernels that do a step's memory traffic: which ops launch them, at what
shapes, how many bytes they move and how fast against the device memory's peak.

A kernel's bytes come from the op that launched it (its External id): its tensor inputs
read and one output written the size of the largest input for elementwise ops and copies,
the inputs alone for reductions and for `copy_` (whose first input is the output). Ops
whose traffic their shapes do not tell (gathers, scatters, sorts: it depends on the indices)
are listed as irregular, with their time and no rate. Groups are (launching op, shapes,
dtype), most device time first. Facts per traced step, for the diagnosis's memory causes;
and per window, what running the slow groups at a target fraction of peak would save. Pure.
"""

from __future__ import annotations

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.dtypes import element_bytes
from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace import roofline
from diag.analyzers.trace.columns import Trace

TOP_GROUPS = 5
_KERNEL = 0
# Their bytes depend on the index values, which a trace does not hold.
IRREGULAR = frozenset(f"aten::{op}" for op in (
    "index", "index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_put_",
    "index_add_", "embedding", "embedding_dense_backward", "masked_select", "nonzero", "sort", "topk"))
_NO_OUTPUT = frozenset({"aten::copy_", "aten::fill_", "aten::zero_"})  # the first input is what they write


def _reduces(name: str) -> bool:
    base = name.split("::")[-1].rstrip("_")
    return base in roofline.REDUCTION_NAMES


def op_traffic(name: str, dims: list, types: list) -> float | None:
    """Bytes an elementwise, copy or reduction op moves at least (None: its shapes do not say)."""
    if name in IRREGULAR:
        return None
    sizes = [(roofline.numel(d), element_bytes(t)) for d, t in zip(dims, types)]
    tensors = [(n, b) for n, b in sizes if n is not None and b]
    if not tensors:
        return None
    read = sum(n * b for n, b in tensors)
    if name in _NO_OUTPUT or _reduces(name):
        return float(read)
    n, b = max(tensors)
    return float(read + n * b)


def _group_rows(trace: Trace, rows: np.ndarray, names: np.ndarray, outer: np.ndarray,
                wanted: np.ndarray) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """(each group's (kind, key): ("irregular", name) or ("rated", (top, op, shapes, dtype)); the
    group of each launching row, -1 for none; the bytes each row's shapes say it moves)."""
    backward = "autograd::engine::evaluate_function: "
    keys: list[tuple] = []
    key_id: dict[tuple, int] = {}
    group_of_row = np.full(len(rows), -1, dtype=np.int64)
    row_bytes = np.zeros(len(rows))
    parsed: dict[tuple, tuple] = {}
    for j in wanted.tolist():
        row, nid = int(rows[j]), int(names[j])
        name = trace.names[nid]
        if name in IRREGULAR:
            key = ("irregular", name)
        else:
            raw = trace.bw_shapes[row]
            top = int(trace.cpu_name[outer[j]]) if outer[j] >= 0 else nid
            if (top, nid, raw) not in parsed:
                dims, types = roofline.parse_shapes(raw[0], raw[1])
                parsed[top, nid, raw] = ((trace.names[top].removeprefix(backward), name, roofline.shapes_text(dims),
                                          roofline.op_dtype(types)), op_traffic(name, dims, types))
            group, nbytes = parsed[top, nid, raw]
            if not nbytes:
                continue
            key, row_bytes[j] = ("rated", group), nbytes
        group_of_row[j] = key_id.setdefault(key, len(keys))
        if group_of_row[j] == len(keys):
            keys.append(key)
    return keys, group_of_row, row_bytes


def _rated_groups(groups: dict, n: int, peak: float | None, target_frac: float, slow_frac: float,
                  min_call_bytes: float) -> tuple[list[dict], np.ndarray]:
    """(the rated groups, largest first, at most TOP_GROUPS; per window, what the slow ones would
    save running at `target_frac` of the peak)."""
    out: list[dict] = []
    saving = np.zeros(n)
    for (top, name, shapes, dtype), g in sorted(groups.items(), key=lambda kv: -float(kv[1]["us"].sum())):
        us = float(g["us"].sum())
        rate = g["bytes"] / (us * 1e-6) if us > 0 else None
        frac = rate / peak if rate and peak else None
        slow = frac is not None and frac < slow_frac and g["bytes"] / g["calls"] >= min_call_bytes
        if slow and frac is not None:
            saving += g["us"] * (1.0 - frac / target_frac)
        if len(out) < TOP_GROUPS:
            where = f"{top} → {name}" if top != name else name
            out.append({"name": f"{where} on {shapes or '?'} in {dtype}", "op": name,
                        "called_from": top if top != name else None, "shapes": shapes, "dtype": dtype, "calls_per_step": round(g["calls"] / n, 3),
                        "ms_per_step": round(us / 1e3 / n, 4), "gb_per_step": round(g["bytes"] / 1e9 / n, 4),
                        "mb_per_call": round(g["bytes"] / 1e6 / g["calls"], 3),
                        "achieved_gbps": round(rate / 1e9, 1) if rate else None,
                        "peak_frac": round(frac, 3) if frac is not None else None})
    return out, saving


def traffic_facts(trace: Trace, classes: np.ndarray, win: np.ndarray, device, target_frac: float,
                  slow_frac: float, min_call_bytes: float) -> tuple[dict | None, np.ndarray | None]:
    """{"peak_gbps", "bandwidth_ms_per_step", "rated_share", "groups": [...], "irregular": [...]}
    over the bandwidth-class kernels of the windows (None without any); and per window, what
    the groups under `slow_frac` of the peak would save running at `target_frac` (µs; None
    without the device's peak or such a group): the what-if change's own definition. Groups
    moving under `min_call_bytes` a call are left out of it: kernels that small cannot reach
    the peak, whatever their pattern. Which groups to name as slow is the diagnosis's call,
    from each group's peak_frac and mb_per_call."""
    n = len(win)
    if not n or not len(trace.dev_ts):
        return None, None
    step = trace.step_of("dev", win)
    kern = np.flatnonzero((step >= 0) & (classes == ec.BANDWIDTH) & (trace.dev_kind == _KERNEL))
    if not len(kern):
        return None, None
    total_us = float(trace.dev_dur[kern].sum())
    launcher = trace.launcher_rows()[kern]
    kern, launcher = kern[launcher >= 0], launcher[launcher >= 0]
    rows, row_of = np.unique(launcher, return_inverse=True)
    # Only the launching ops whose bytes can be known (shapes kept at load) or that are
    # irregular are looked at one by one.
    names = trace.cpu_name[rows]
    irregular_ids = [i for i, name in enumerate(trace.names) if name in IRREGULAR]
    shaped = np.fromiter((r in trace.bw_shapes for r in rows.tolist()), bool, len(rows)) if trace.bw_shapes \
        else np.zeros(len(rows), bool)
    wanted = np.flatnonzero(shaped | np.isin(names, irregular_ids))
    peak = float(device.mem_bw) if device is not None and getattr(device, "mem_bw", None) else None
    outer = np.full(len(rows), -1, dtype=np.int64)
    outer[wanted] = _outermost(trace, rows[wanted])
    keys, group_of_row, row_bytes = _group_rows(trace, rows, names, outer, wanted)
    g_kern = group_of_row[row_of]
    ok = g_kern >= 0
    per_step = np.bincount(g_kern[ok] * n + step[kern][ok], weights=trace.dev_dur[kern][ok],
                           minlength=len(keys) * n).reshape(len(keys), n)
    has = group_of_row >= 0
    calls = np.bincount(group_of_row[has], minlength=len(keys))
    nbytes = np.bincount(group_of_row[has], weights=row_bytes[has], minlength=len(keys))
    groups = {key[1]: {"calls": int(calls[g]), "bytes": float(nbytes[g]), "us": per_step[g]}
              for g, key in enumerate(keys) if key[0] == "rated"}
    irregular = {key[1]: {"op": key[1], "calls": int(calls[g]), "us": per_step[g]}
                 for g, key in enumerate(keys) if key[0] == "irregular"}
    rated_us = sum(float(g["us"].sum()) for g in groups.values())
    out, saving = _rated_groups(groups, n, peak, target_frac, slow_frac, min_call_bytes)
    facts = {
        "peak_gbps": round(peak / 1e9, 1) if peak else None,
        "bandwidth_ms_per_step": round(total_us / 1e3 / n, 4),
        # The share of the bandwidth-bound kernels' time whose bytes the shapes give.
        "rated_share": round(rated_us / total_us, 3) if total_us > 0 else None,
        "groups": out,
        "irregular": [{"name": g["op"], "op": g["op"], "calls_per_step": round(g["calls"] / n, 3),
                       "ms_per_step": round(float(g["us"].sum()) / 1e3 / n, 4)}
                      for g in sorted(irregular.values(), key=lambda g: -float(g["us"].sum()))[:TOP_GROUPS]],
    }
    return facts, (saving if np.any(saving > 0) else None)


def _outermost(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """For each CPU op row, the outermost op on its thread that holds it (the user's call:
    aten::contiguous for the aten::copy_ inside it); -1 where none does."""
    ops = np.flatnonzero(trace.cpu_kind == 0)
    if not len(ops) or not len(rows):
        return np.full(len(rows), -1, dtype=np.int64)
    ops = ops[np.lexsort((-trace.cpu_dur[ops], trace.cpu_ts[ops], trace.cpu_tid[ops]))]
    tid, start = trace.cpu_tid[ops], trace.cpu_ts[ops]
    end = start + trace.cpu_dur[ops]
    top = np.ones(len(ops), dtype=bool)
    for t in np.unique(tid).tolist():  # an op is outermost where it starts after all before it ended
        mine = np.flatnonzero(tid == t)
        reach = np.maximum.accumulate(end[mine])
        top[mine[1:]] = start[mine[1:]] >= reach[:-1]
    held = iv.span_holding(trace.cpu_ts[rows], trace.cpu_tid[rows], start[top], end[top], tid[top])
    return np.where(held >= 0, ops[top][np.maximum(held, 0)], -1)
