"""Replay a step's dependency graph under changed durations, and its critical path.

A change is a small declarative entry: which parts of the step, scaled by what factor.
The parts:
- `data`: the host's time inside DataLoader spans (between the runtime calls);
- `host`: the rest of the host's own time between calls;
- `launch`: the runtime calls that launch device work;
- `sync`: what blocking calls spend beyond the wait for the device;
- `slack`: launch latency and queueing the edges do not explain;
- `comm`, `memory`, `compute`: device ops of each class.
Unlisted parts keep their measured durations. Replaying with no change gives back the
measured step (the graph keeps what it does not explain as slack), so a prediction is the
replayed step under the change, and its error is that of the graph alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from diag.analyzers.whatif.graph import StepGraph

PARTS = ("data", "host", "launch", "sync", "slack", "comm", "memory", "compute")


def topo_order(g: StepGraph) -> list[tuple[int, int]]:
    """(kind, index) in an order where every node comes after what it depends on:
    kind 0 = device node, 1 = host call; among the nodes ready at once, the earliest
    measured end first. A call that waits for work it launched itself (a blocking copy)
    comes after that work, which is ready once the call has started (`_self_waits`).
    Nodes are numbered host calls first, then device nodes (n_host + j)."""
    n_h, n_d = g.n_host, len(g.d_start)
    self_wait = _self_waits(g)
    src, dst = _edges(g, self_wait)
    end = np.concatenate((g.h_end, g.d_end)).astype(np.float64)
    # Most steps' measured ends already respect every edge: then that order is the answer.
    by_end = np.lexsort((np.concatenate((np.ones(n_h), np.zeros(n_d))), end))
    pos = np.empty(n_h + n_d, dtype=np.int64)
    pos[by_end] = np.arange(n_h + n_d)
    if not np.any(pos[src] >= pos[dst]):
        return [(1, int(k)) if k < n_h else (0, int(k) - n_h) for k in by_end.tolist()]
    return _kahn(n_h, n_d, src, dst, end, by_end)


def _edges(g: StepGraph, self_wait: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The graph's dependencies as (from, to) node numbers."""
    n_h, n_d = g.n_host, len(g.d_start)
    src, dst = [np.arange(n_h - 1)], [np.arange(1, n_h)]  # the host chain
    j = np.arange(n_d)
    launched = g.d_launch >= 0
    # A node waits for its launch call, or where that call waits for it, for the call before it.
    on = launched & ~self_wait
    src.append(g.d_launch[on])
    dst.append(n_h + j[on])
    early = launched & self_wait & (g.d_launch > 0)
    src.append(g.d_launch[early] - 1)
    dst.append(n_h + j[early])
    for dep in (g.d_pred, g.d_xdep):
        src.append(n_h + dep[dep >= 0])
        dst.append(n_h + j[dep >= 0])
    for i in np.flatnonzero(g.h_wait_on >= 0).tolist():
        awaited = _awaited(g, i)
        src.append(n_h + awaited)
        dst.append(np.full(len(awaited), i, dtype=np.int64))
    return (np.concatenate(src).astype(np.int64) if src else np.zeros(0, np.int64),
            np.concatenate(dst).astype(np.int64) if dst else np.zeros(0, np.int64))


def _kahn(n_h: int, n_d: int, src: np.ndarray, dst: np.ndarray, end: np.ndarray, by_end: np.ndarray) -> list:
    import heapq

    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    starts = np.searchsorted(src, np.arange(n_h + n_d + 1)).tolist()
    dst_l = dst.tolist()
    need = np.bincount(dst, minlength=n_h + n_d).tolist()
    end_l = end.tolist()
    heap = [(end_l[k], 1 if k < n_h else 0, k) for k in range(n_h + n_d) if need[k] == 0]
    heapq.heapify(heap)
    by_end = by_end.tolist()
    placed: list[bool] = [False] * (n_h + n_d)
    out: list = []
    while len(out) < n_h + n_d:
        if not heap:
            # A cycle through a wait the measured times suggested (a stream running work in
            # another order than it was launched, clocks that disagree): the next host call goes
            # first, and its waits for work not yet replayed hold it no longer (_replay).
            k = next((i for i in range(n_h) if not placed[i]), None)
            k = k if k is not None else next(x for x in by_end if not placed[x])
            heap.append((end_l[k], 1 if k < n_h else 0, k))
            need[k] = 0
        _, _, k = heapq.heappop(heap)
        if placed[k]:
            continue
        placed[k] = True
        out.append((1, k) if k < n_h else (0, k - n_h))
        for kb in dst_l[starts[k]:starts[k + 1]]:
            need[kb] -= 1
            if need[kb] == 0 and not placed[kb]:
                heapq.heappush(heap, (end_l[kb], 1 if kb < n_h else 0, kb))
    return out


def _self_waits(g: StepGraph) -> np.ndarray:
    """Per device node, whether the call that launched it also waits for it."""
    out = np.zeros(len(g.d_start), dtype=bool)
    for i in np.flatnonzero(g.h_wait_on >= 0).tolist():
        mine = _awaited(g, i)
        out[mine[g.d_launch[mine] == i]] = True
    return out


def replay(g: StepGraph, scales: dict[str, dict], order=None, info: dict | None = None) -> dict[str, float]:
    """The step's duration (µs) under each named change {id: {part: factor}}.

    A training loop's steps are a pipeline: the host may run ahead of the device by a
    step's worth of launches, but not by more (a sync every iteration, the launch queue).
    So a step takes at least its own device work, replayed with no host in the way. A
    trace whose device fell behind within the step (its own work spills past the step's
    end) shows a backlog the steady pipeline would not have; it is measured with no
    change and taken off every floor, so that replaying no change gives back the step.
    """
    order = order if order is not None else topo_order(g)
    parts = set(present(g)) | {"slack"}
    memo: dict = {}

    def run(scale: dict, own_only: bool) -> float:
        # Parts the step lacks, and factors of 1, change nothing: equal changes replay once.
        eff = tuple(sorted((p, f) for p, f in scale.items() if f != 1.0 and p in parts))
        if (eff, own_only) not in memo:
            memo[eff, own_only] = _replay(g, dict(eff), order, own_only=own_only)
        return memo[eff, own_only]

    own_scale = {"data": 0.0, "host": 0.0, "launch": 0.0, "sync": 0.0, "slack": 0.0}
    backlog = max(0.0, run(own_scale, True) - run({}, False))
    if info is not None:
        info["backlog_us"] = backlog
    # The step's own device work, end to end, is at most the sum of its durations: where the
    # whole step is longer, the floor cannot bind and is not replayed.
    own_us: dict[str, float] = {}
    for j, cls in enumerate(g.d_cls):
        if g.d_launch[j] >= 0:
            own_us[cls] = own_us.get(cls, 0.0) + float(g.d_end[j] - g.d_start[j])
    out = {}
    for cid, scale in scales.items():
        full = run(scale or {}, False)
        bound = sum(us * float((scale or {}).get(cls, 1.0)) for cls, us in own_us.items()) - backlog
        out[cid] = max(full, run({**(scale or {}), **own_scale}, True) - backlog) if bound > full else full
    return out


def _prep(g: StepGraph) -> tuple:
    """The graph's per-node constants as Python lists (a replay reads them node by node,
    where list indexing is several times cheaper than numpy's), computed once per graph."""
    if g.prepped is not None:
        return g.prepped
    lo = g.lo
    prev_end = np.concatenate(([lo], g.h_end[:-1]))
    waits = (g.h_wait_on >= 0) & (g.d_end[np.maximum(g.h_wait_on, 0)] > g.h_start) if len(g.d_end) \
        else np.zeros(g.n_host, bool)
    host = (g.h_gap_data.tolist(), (g.h_start - prev_end - g.h_gap_data).tolist(), (g.h_end - g.h_start).tolist(),
            np.where(waits, g.h_end - g.d_end[np.maximum(g.h_wait_on, 0)] if len(g.d_end) else 0.0, 0.0).tolist(),
            waits.tolist())
    n = len(g.d_start)
    launched, self_wait = g.d_launch >= 0, _self_waits(g)
    # Ready when the launching call returns, or when it starts where that call waits for it.
    call = np.maximum(g.d_launch, 0)
    at_call = np.where(self_wait, g.h_start[call], g.h_end[call]) if g.n_host else lo
    ready = np.where(launched, at_call, np.minimum(lo, g.d_start))
    for dep in (g.d_pred, g.d_xdep):
        ready = np.where(dep >= 0, np.maximum(ready, g.d_end[np.maximum(dep, 0)] if n else 0.0), ready)
    dev = (g.d_launch.tolist(), g.d_pred.tolist(), g.d_xdep.tolist(), np.maximum(0.0, g.d_start - ready).tolist(),
           (g.d_end - g.d_start).tolist(), g.d_end.tolist(), np.minimum(lo, g.d_start).tolist(), self_wait.tolist())
    g.prepped = (host, dev)
    return g.prepped


def _replay(g: StepGraph, scale: dict | None, order, own_only: bool = False) -> float:
    s = {p: 1.0 for p in PARTS}
    s.update(scale or {})
    if g.n_host == 0:
        span = g.hi - g.lo
        return span * s["host"]  # no device activity launched in the step: host time only
    order = order if order is not None else topo_order(g)
    (gap_data, gap_host, call, sync_extra, waits), (d_launch, d_pred, d_xdep, slack, dur, d_end, early,
                                                    self_wait) = _prep(g)
    f_data, f_host, f_launch, f_sync, f_slack = s["data"], s["host"], s["launch"], s["sync"], s["slack"]
    f_dev = [s[c] for c in g.d_cls]
    lo = g.lo
    # A step stretched over its device work began its host part while the device still ran the
    # step before; a change to that work belongs to the step before, not to this one.
    queue_fixed = g.host_end < g.hi
    # Its duration counts from where the step before ended.
    origin = g.window_lo if queue_fixed and g.window_lo is not None else lo
    # Each node's replayed end, None until replayed (plain lists: the loop reads them node by node).
    new_h: list[Any] = [None] * g.n_host
    new_d: list[Any] = [None] * len(d_end)
    for kind, i in order:
        if kind == 1:
            prev = (new_h[i - 1] if new_h[i - 1] is not None else g.h_end[i - 1]) if i > 0 else lo
            start = prev + gap_data[i] * f_data + gap_host[i] * f_host
            if waits[i]:
                # Work not replayed yet is work this call cannot have waited for (topo_order).
                dev = max((new_d[j] for j in _awaited(g, i).tolist() if new_d[j] is not None), default=start)
                new_h[i] = (start if start > dev else dev) + sync_extra[i] * f_sync
            else:
                new_h[i] = start + call[i] * f_launch
        else:
            lk = d_launch[i]
            if lk >= 0 and self_wait[i]:  # its call waits for it: ready when the call starts
                prev = (new_h[lk - 1] if new_h[lk - 1] is not None else g.h_end[lk - 1]) if lk > 0 else lo
                ready = prev + gap_data[lk] * f_data + gap_host[lk] * f_host
            elif lk >= 0:
                ready = new_h[lk]
                if ready is None:
                    ready = g.h_end[lk]
            elif own_only:  # the previous step's work: not part of this step's own device time
                new_d[i] = lo
                continue
            elif queue_fixed:  # the previous step's work, which that step's replay changes
                new_d[i] = d_end[i]
                continue
            else:  # launched before the step: as measured, ready at the step's start at the latest
                ready = early[i]
            p = d_pred[i]
            if p >= 0:
                t = new_d[p] if new_d[p] is not None else d_end[p]
                if t > ready:
                    ready = t
            x = d_xdep[i]
            if x >= 0:
                t = new_d[x] if new_d[x] is not None else d_end[x]
                if t > ready:
                    ready = t
            new_d[i] = ready + slack[i] * f_slack + dur[i] * f_dev[i]
    if own_only:  # the device span of the step's own launches
        own = [new_d[j] for j in range(len(d_end)) if d_launch[j] >= 0]
        return float(max(own) - origin) if own else 0.0
    tail = g.host_end - g.h_end[-1]
    end = new_h[-1] + g.tail_data * s["data"] + (tail - g.tail_data) * s["host"]
    if g.host_end < g.hi:  # stretched over its device work: the step ends when that work does
        own = [new_d[j] for j in range(len(d_end)) if d_launch[j] >= 0]
        end = max([end, *own])
    return float(end - origin)


def host_us(g: StepGraph) -> float:
    """The step's `host` part as the replay counts it: the host's time between runtime calls
    and after the last, less what lies in DataLoader spans."""
    if g.n_host == 0:
        return float(g.hi - g.lo)
    prev_end = np.concatenate(([g.lo], g.h_end[:-1]))
    return float(np.sum(g.h_start - prev_end - g.h_gap_data) + (g.host_end - g.h_end[-1] - g.tail_data))


def _awaited(g: StepGraph, i: int) -> np.ndarray:
    """The device nodes blocking call i waits for: all launched before it for a device-wide
    synchronise, else the one it returned after."""
    if g.h_wait_all[i]:
        return np.flatnonzero(g.d_launch <= i)
    return np.array([g.h_wait_on[i]], dtype=np.int64)


def present(g: StepGraph) -> list[str]:
    """The parts with time in the step (a change acting on none of them predicts nothing)."""
    out = {"host", "launch"} if g.n_host else {"host"}
    if float(np.sum(g.h_gap_data)) + g.tail_data > 0:
        out.add("data")
    if np.any(g.h_wait_on >= 0):
        out.add("sync")
    out.update(g.d_cls[j] for j in range(len(g.d_cls)) if g.d_launch[j] >= 0)
    return sorted(out)


def critical_path(g: StepGraph) -> dict:
    """The critical path of the measured step, walked back from its end: µs per class, and
    its length (the measured step's duration when the graph explains the whole step).

    A step stretched over its device work began where the step before it ended (`window_lo`):
    the path is cut there, as the work before belongs to that step."""
    out: dict = defaultdict(float)
    if g.n_host == 0:
        out["host"] = g.hi - g.lo
        return {"length_us": g.hi - g.lo, "by_class_us": dict(out), "nodes": 0}
    cut = g.window_lo if g.window_lo is not None and g.host_end < g.hi else -np.inf

    def part(a: float, b: float) -> float:
        return max(0.0, b - max(a, cut))

    last = g.n_host - 1
    mode, i, nodes = "host", last, 0
    if g.last_own_device_node() >= 0:  # the step ends with device work the host ran ahead of
        mode, i = "dev", g.last_own_device_node()
    else:
        out["data"] += g.tail_data
        out["host"] += (g.host_end - g.h_end[last]) - g.tail_data
    # A valid walk visits each call and each device node at most once; timestamps that make a
    # dependency cycle would walk it forever.
    bound = 2 * (g.n_host + len(g.d_cls)) + 2
    while True:
        nodes += 1
        if nodes > bound:
            raise ValueError(f"the step's dependency graph has a cycle (more than {bound} nodes on its critical "
                             "path): its timestamps contradict each other")
        if mode == "host":
            if i < 0 or g.h_end[i] <= cut:
                break
            a = g.h_wait_on[i]
            if a >= 0 and g.d_end[a] > g.h_start[i]:
                out["host"] += part(g.d_end[a], g.h_end[i])  # the blocking call's own part, after the wait
                mode, i = "dev", int(a)
                continue
            _host_call(out, g, i, cut)
            i -= 1
            continue
        k = i
        out[g.d_cls[k]] += part(g.d_start[k], g.d_end[k])
        lk, p, x = g.d_launch[k], g.d_pred[k], g.d_xdep[k]
        # A copy that blocks its own call (pageable memory) begins with the call, not after it:
        # the call outlasts the copy's start.
        own_wait = lk >= 0 and (g.h_wait_on[lk] == k or g.h_end[lk] > g.d_start[k])
        best, kind = ((g.h_start[lk] if own_wait else g.h_end[lk]), "launch") if lk >= 0 else (g.lo, "before")
        if p >= 0 and g.d_end[p] > best:
            best, kind = g.d_end[p], "pred"
        if x >= 0 and g.d_end[x] > best:
            best, kind = g.d_end[x], "xdep"
        out["host"] += part(best, g.d_start[k])  # launch latency, or the device idle between ops
        if kind == "before" or best <= cut:  # the path begins here
            break
        if kind == "launch":
            # The launching call itself ended the wait: continue along the host chain from it
            # (from the gap before it, where the call's own time is the copy just counted).
            _host_call(out, g, lk, cut, gap_only=own_wait)
            mode, i = "host", int(lk) - 1
        else:
            i = int(p if kind == "pred" else x)
    length = float(sum(out.values()))
    return {"length_us": length, "by_class_us": {c: float(v) for c, v in out.items() if v}, "nodes": nodes}


def _host_call(out: dict, g: StepGraph, i: int, cut: float = -np.inf, gap_only: bool = False) -> None:
    """Host call i on the critical path: the call itself (unless `gap_only`), and the gap
    before it (DataLoader time as data, the rest as host), from `cut` on."""
    prev = g.h_end[i - 1] if i > 0 else g.lo
    data = g.h_gap_data[i]
    if prev < cut:
        prev = cut
        data = min(data, max(0.0, g.h_start[i] - cut))
    out["host"] += (0.0 if gap_only else g.h_end[i] - g.h_start[i]) + (g.h_start[i] - prev) - data
    out["data"] += data
