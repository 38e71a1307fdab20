"""What the host asks of the device in each traced step: copies by kind, and kernel launches.

Facts for the cause rules of the diagnosis, per traced step (events that start inside a step
window, divided by the number of windows):
- `copies`: device copies grouped by their trace name, which states direction and host
  memory kind ("Memcpy HtoD (Pageable -> Device)"), with the host time of the runtime calls
  that issued them (a copy from pageable memory holds its call until the data is staged);
- `launches`: kernels per step, their median duration, the host time of the launch calls,
  and the CPU ops that launch the most kernels (the region to capture in a CUDA graph);
- `cpu_work`: the ops of the training thread that run on the CPU, during which the process
  calls no runtime API (preprocessing, CPU tensors' math), by name;
- `allocator`: the runtime and driver calls that allocate or free device or pinned memory,
  by name: calls, host time and the longest call per step (the caching allocator calls them
  only when its cache misses, or when it is emptied).
Pure: reads the trace's columns, returns plain data.
"""

from __future__ import annotations

import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.trace.columns import Trace, index_of

KERNEL, MEMCPY = 0, 1  # device event kinds (columns: 0 kernel, 1 memcpy, 2 memset, 3 sync)
LAUNCH_RE = re.compile(r"^(?:cuda|hip)(?:LaunchKernel(?:ExC)?|LaunchCooperativeKernel|ExtModuleLaunchKernel|"
                       r"ModuleLaunchKernel|LaunchKernelEx)(?:_v\d+|_ptsz)?$|^cuLaunchKernel(?:Ex)?$")
GRAPH_RE = re.compile(r"^(?:cuda|hip)GraphLaunch")
TOP_LAUNCHERS = 3
TOP_CPU_OPS = 5
# Ops that only rearrange a tensor's metadata or allocate: no CPU work to move off the thread.
METADATA_OPS = frozenset(f"aten::{op}" for op in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "view_as", "as_strided", "flatten", "unflatten",
    "narrow", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "t", "transpose", "permute",
    "expand", "expand_as", "squeeze", "unsqueeze", "detach", "detach_", "alias", "lift_fresh", "empty",
    "empty_like", "empty_strided", "resize_", "set_", "contiguous", "size", "stride", "numel", "result_type",
    "unflatten_dense_tensors", "flatten_dense_tensors", "requires_grad_", "is_nonzero"))
# cudaMalloc/cudaFree and their HIP, async, host and managed forms; the driver's virtual-memory
# calls that expandable segments map and unmap pages with.
ALLOCATOR_RE = re.compile(r"^(?:cuda|hip)(?:Malloc|Free)(?:Async|Host|Managed|FromPoolAsync)?(?:_v\d+|_ptsz)?$|"
                          r"^(?:cuda|hip)(?:HostAlloc|HostMalloc|HostFree|ExtMallocWithFlags)$|"
                          r"^cuMem(?:Alloc|Free|AllocHost|FreeHost|AllocManaged|AllocAsync|FreeAsync|Create|Release|"
                          r"Map|Unmap|AddressReserve|AddressFree)(?:_v\d+)?$")


def _rt_ms_by_corr(trace: Trace, corr: np.ndarray) -> float:
    """Host milliseconds of the runtime calls whose correlation ids are in `corr`."""
    if not len(corr) or not len(trace.rt_corr):
        return 0.0
    return float(trace.rt_dur[index_of(corr, trace.rt_corr) >= 0].sum()) / 1e3


def copy_facts(trace: Trace, win: np.ndarray) -> list[dict]:
    """Per copy name: calls, MB, device and host milliseconds per traced step, most time first."""
    n = len(win)
    sel = np.flatnonzero((trace.dev_kind == MEMCPY) & (trace.step_of("dev", win) >= 0)) if n else np.empty(0, np.int64)
    out = []
    for nid in np.unique(trace.dev_name[sel]).tolist() if len(sel) else []:
        rows = sel[trace.dev_name[sel] == nid]
        nbytes = trace.dev_bytes[rows]
        known = nbytes[np.isfinite(nbytes)]
        out.append({
            "name": trace.names[nid],
            "calls_per_step": round(len(rows) / n, 3),
            "mb_per_step": round(float(known.sum()) / 1e6 / n, 4) if len(known) else None,
            "ms_per_step": round(float(trace.dev_dur[rows].sum()) / 1e3 / n, 4),
            "host_ms_per_step": round(_rt_ms_by_corr(trace, trace.dev_corr[rows]) / n, 4),
        })
    out.sort(key=lambda c: -c["ms_per_step"])
    return out


def launch_facts(trace: Trace, win: np.ndarray) -> dict | None:
    """Kernels per traced step, their median µs, the launch calls' host time (in all, and the
    median and slowest call), and the ops that launch the most kernels; None without kernels."""
    n = len(win)
    if not n:
        return None
    kern = np.flatnonzero((trace.dev_kind == KERNEL) & (trace.step_of("dev", win) >= 0))
    if not len(kern):
        return None
    rt = np.flatnonzero(trace.step_of("rt", win) >= 0)
    ids = np.flatnonzero(np.bincount(trace.rt_name[rt], minlength=len(trace.names))).tolist()
    launch = np.isin(trace.rt_name[rt], [i for i in ids if LAUNCH_RE.match(trace.names[i])])
    graphs = int(np.isin(trace.rt_name[rt], [i for i in ids if GRAPH_RE.match(trace.names[i])]).sum())
    hip = any(trace.names[i].startswith("hip") for i in ids)
    call_us = trace.rt_dur[rt][launch]
    return {
        "kernels_per_step": round(len(kern) / n, 2),
        "median_kernel_us": round(float(np.median(trace.dev_dur[kern])), 3),
        "kernel_ms_per_step": round(float(trace.dev_dur[kern].sum()) / 1e3 / n, 4),
        "launch_calls_per_step": round(int(launch.sum()) / n, 2),
        "launch_ms_per_step": round(float(call_us.sum()) / 1e3 / n, 4),
        # The typical call apart from the slowest: a cold first launch (lazy module loading)
        # costs hundreds of ms once, which a per-step sum would spread over every step.
        "median_launch_us": round(float(np.median(call_us)), 3) if len(call_us) else None,
        "max_launch_us": round(float(call_us.max()), 3) if len(call_us) else None,
        "graph_launches_per_step": round(graphs / n, 2),
        "runtime": "hip" if hip else "cuda",
        "top_launchers": _top_launchers(trace, kern, n),
    }


def launch_mask(trace: Trace) -> np.ndarray:
    """Which runtime rows launch a kernel (LAUNCH_RE)."""
    ids = [i for i, name in enumerate(trace.names) if LAUNCH_RE.match(name)]
    return np.isin(trace.rt_name, ids) if ids else np.zeros(len(trace.rt_name), dtype=bool)


def allocator_mask(trace: Trace) -> np.ndarray:
    """Which runtime rows are allocator calls (ALLOCATOR_RE)."""
    ids = [i for i, name in enumerate(trace.names) if ALLOCATOR_RE.match(name)]
    return np.isin(trace.rt_name, ids) if ids else np.zeros(len(trace.rt_name), dtype=bool)


def allocator_facts(trace: Trace, win: np.ndarray) -> list[dict]:
    """Per allocator call name: calls, host milliseconds and the longest call per traced step,
    most time first."""
    n = len(win)
    sel = np.flatnonzero(allocator_mask(trace) & (trace.step_of("rt", win) >= 0)) if n else []
    out = []
    for nid in np.unique(trace.rt_name[sel]).tolist() if len(sel) else []:
        dur = trace.rt_dur[sel[trace.rt_name[sel] == nid]]
        out.append({"name": trace.names[nid], "calls_per_step": round(len(dur) / n, 3),
                    "ms_per_step": round(float(dur.sum()) / 1e3 / n, 4), "longest_ms": round(float(dur.max()) / 1e3, 4)})
    out.sort(key=lambda c: -c["ms_per_step"])
    return out


def cpu_work_facts(trace: Trace, win: np.ndarray, min_coverage: float) -> list[dict]:
    """Per op name of cpu_work_ops: calls and host milliseconds per traced step, and the host
    time right after its calls before the thread's next event, most first."""
    n = len(win)
    rows, own, after = cpu_work_ops(trace, win, min_coverage)
    names = trace.cpu_name[rows]
    out = []
    for nid in np.unique(names).tolist():
        mine = names == nid
        out.append({"name": trace.names[nid], "calls_per_step": round(int(mine.sum()) / n, 3),
                    "ms_per_step": round(float(own[mine].sum()) / 1e3 / n, 4),
                    "after_ms_per_step": round(float(after[mine].sum()) / 1e3 / n, 4)})
    out.sort(key=lambda c: -c["ms_per_step"])
    return [c for c in out if c["ms_per_step"] > 0][:TOP_CPU_OPS]


def cpu_work_ops(trace: Trace, win: np.ndarray, min_coverage: float,
                 host_part: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ops of the training thread (the one holding the ProfilerSteps) that run on the CPU:
    outermost among the ops during which the process made no runtime call, outside the
    DataLoader's spans. Their CPU rows; each one's time (µs) less the view and allocation
    ops inside it (rearranging metadata is no CPU work to move); and the thread's time right
    after it, up to its next event or any runtime call (freeing the work's tensors, the Python
    between its ops: work that goes where the op goes), each within `host_part` where given.
    None where the trace lost host events (`op_coverage` under `min_coverage`): there an op
    whose calls were dropped would look like CPU work."""
    none = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    if not len(win) or not len(trace.rt_ts) or (trace.op_coverage is not None and trace.op_coverage < min_coverage):
        return none
    thread = training_thread(trace)
    if thread is None:
        return none
    rows = np.flatnonzero((trace.cpu_tid == thread) & (trace.cpu_kind == 0) & (trace.step_of("cpu", win) >= 0))
    rows = rows[np.lexsort((-trace.cpu_dur[rows], trace.cpu_ts[rows]))]
    start, end = trace.cpu_ts[rows], trace.cpu_ts[rows] + trace.cpu_dur[rows]
    calls = np.sort(trace.rt_ts)
    quiet = np.searchsorted(calls, start, side="left") == np.searchsorted(calls, end, side="left")
    meta = np.isin(trace.cpu_name[rows], [i for i, name in enumerate(trace.names) if name in METADATA_OPS])
    loader = loader_spans(trace, thread)
    in_loader = iv.window_of(start, loader) >= 0 if len(loader) else np.zeros(len(rows), bool)
    top = []
    reach = -np.inf
    for j in np.flatnonzero(quiet & ~meta & ~in_loader).tolist():
        if start[j] >= reach:  # outermost: ops on one thread nest or follow
            top.append(j)
            reach = end[j]
    if not top:
        return none
    top = np.array(top)
    work = iv.subtract(iv.from_arrays(start[top], end[top]), iv.from_arrays(start[meta], end[meta]))
    nxt = _next_event(trace, thread, end[top], calls)
    after = iv.from_arrays(end[top], nxt)
    if host_part is not None:
        work, after = iv.intersect(work, host_part), iv.intersect(after, host_part)
    return (rows[top], iv.measure_in_windows(work, np.column_stack([start[top], end[top]])),
            iv.measure_in_windows(after, np.column_stack([end[top], nxt])))


def _next_event(trace: Trace, thread, ends: np.ndarray, calls: np.ndarray) -> np.ndarray:
    """Per time in `ends`, the start of the training thread's next event, or of the next
    runtime call if sooner (the end itself where there is none)."""
    mine = np.sort(trace.cpu_ts[trace.cpu_tid == thread])
    out = np.full(len(ends), np.inf)
    for starts in (mine, calls):
        i = np.searchsorted(starts, ends, side="left")
        ok = i < len(starts)
        out[ok] = np.minimum(out[ok], starts[np.minimum(i, len(starts) - 1)][ok])
    return np.where(np.isfinite(out), np.maximum(out, ends), ends)


def training_thread(trace: Trace):
    """The thread id of the ProfilerStep spans, or None."""
    ids = [i for i, name in enumerate(trace.names) if name.startswith("ProfilerStep#")]
    rows = np.flatnonzero(np.isin(trace.cpu_name, ids)) if ids else np.empty(0, np.int64)
    return trace.cpu_tid[rows[0]] if len(rows) else None


def loader_spans(trace: Trace, thread) -> np.ndarray:
    ids = [i for i, name in enumerate(trace.names) if name.startswith("enumerate(DataLoader)")]
    rows = np.flatnonzero(np.isin(trace.cpu_name, ids) & (trace.cpu_tid == thread)) if ids else np.empty(0, np.int64)
    return iv.from_arrays(trace.cpu_ts[rows], trace.cpu_ts[rows] + trace.cpu_dur[rows]) if len(rows) else iv.EMPTY


def _top_launchers(trace: Trace, kern: np.ndarray, n: int) -> list[dict]:
    """The CPU ops whose External ids the most kernels carry (the op that launched them)."""
    ops = np.flatnonzero((trace.cpu_kind == 0) & (trace.cpu_ext >= 0))
    want = trace.dev_ext[kern]
    if not len(ops) or not len(want):
        return []
    op = index_of(trace.cpu_ext[ops], want)
    counts = np.bincount(trace.cpu_name[ops[op[op >= 0]]], minlength=len(trace.names))
    order = np.argsort(-counts, kind="stable")[:TOP_LAUNCHERS]
    return [{"name": trace.names[nid], "kernels_per_step": round(int(counts[nid]) / n, 2)}
            for nid in order.tolist() if counts[nid] > 0]


def merge_per_step(parts: list[tuple[dict | None, int]]) -> dict | None:
    """Per-step facts of several windows, each (facts, traced steps), over all their steps:
    numbers weighted by steps, lists of {"name", ...} merged by name (their numbers likewise,
    most first), other values from the first window."""
    windows = [(f, n) for f, n in parts if isinstance(f, dict) and n > 0]
    if not windows:
        return None
    total = sum(n for _, n in windows)
    out: dict = {}
    for key, first in windows[0][0].items():
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            out[key] = round(sum(float(f.get(key) or 0.0) * n for f, n in windows) / total, 4)
        elif isinstance(first, list):
            out[key] = _merge_named([(f.get(key) or [], n / total) for f, n in windows])
        else:
            out[key] = first
    return out


def merge_list(parts: list[tuple[list | None, int]]) -> list[dict]:
    """Per-step lists of {"name", ...} of several windows, each (list, traced steps), merged by name."""
    total = sum(n for items, n in parts if n > 0 and isinstance(items, list))
    return _merge_named([(items, n / total) for items, n in parts if n > 0 and isinstance(items, list)]) if total else []


def _merge_named(parts: list[tuple[list, float]]) -> list[dict]:
    """Rows merged by name: their per-step figures weighted, anything else from the first."""
    rows: dict[str, dict] = {}
    for items, weight in parts:
        for item in items:
            if not isinstance(item, dict) or "name" not in item:
                continue
            acc = rows.setdefault(item["name"], {})
            for k, v in item.items():
                if k.endswith("per_step") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc[k] = round(acc.get(k, 0.0) + v * weight, 4)
                else:
                    acc.setdefault(k, v)

    def most_first(r: dict) -> float:  # time first, else the first per-step figure
        key = "ms_per_step" if "ms_per_step" in r else next((k for k in r if k.endswith("per_step")), None)
        return -(r.get(key) or 0.0) if key else 0.0

    return sorted(rows.values(), key=most_first)
