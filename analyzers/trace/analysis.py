"""One rank's Kineto trace -> the facts of its rank dict (schema diag.analysis/1).

`trace_facts(path, settings)` loads the trace (`trace_load`), classifies its events
(`event_classes`, `roofline`), attributes every step's wall time to data / host / comm /
memory / compute (`attribution`), measures what the decision tree asks of each step and
of the rank, replays each step's dependency graph (`whatif`), and adds HTA's GPU-time
breakdown (`gpu_time`), MFU, top kernels and ops, and the rank's collective records
(`collectives`) for cross-rank matching. The verdicts and findings are the diagnosis's
(`diag.analyzers.diagnosis.rank.judge_trace`); the facade's `analyze_trace` does both.
"""

from __future__ import annotations

import os
import re

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.analysis_types import SYNC_OP_NAMES, CauseFacts, TraceRankFacts, TraceStepFacts
from diag.analyzers.dtypes import element_bytes
from diag.analyzers.model import FactSettings
from diag.analyzers.numbers import dict_at
from diag.analyzers.trace import (
    accumulation,
    call_sites,
    devices,
    fusion,
    gpu_time,
    host_device,
    matrix_ops,
    memory_traffic,
    optimizer,
    overlap,
    precision,
    python_gaps,
    roofline,
)
from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace import removals as removal_measures
from diag.analyzers.trace.iterations import steady_iterations
from diag.analyzers.trace.load import Trace, load_trace, step_windows
from diag.analyzers.trace.timeline import (
    Ops,
    Rates,
    Timeline,
    attributed_timeline,
    name_mask,
    step_records,
    window_rates,
)
from diag.analyzers.whatif import rank as what_if
from diag.errors import DiagInputError
from diag.rundir import rank_number, world_size_number

TOP_N = 10


def trace_facts(path, settings: FactSettings, rank: int | None = None, workers: int | None = 1,
                host_peaks: dict | None = None, step_range: tuple[int, int] | None = None) -> TraceRankFacts:
    """The facts of one rank of the diag.analysis/1 document from one Kineto trace file,
    measured by `settings` (the what-if changes to replay among them; a tree's are `tree.facts`).

    workers: decoding processes for a large file (1: serial, the default; None: by file
    size and idle CPUs, as `diag analyze` does).
    host_peaks: the host CPU's calibration (`diag calibrate`'s document) for a trace with no
    device; without it, CPU ops are not placed on a roofline. Never read from a cache here:
    the same trace gives the same analysis on every machine.
    step_range: (first, last), the steps the recording rank completed in this window: a trace
    cut by the job's end holds the step then in progress (its marker around the exit's own
    work), which is no training step, and per-step facts divide by the steps kept.
    """
    trace = load_trace(path, workers=workers)
    if step_range is not None:
        trace.keep_steps(*step_range)
    return facts_of_loaded(trace, settings, rank=rank, host=devices.host_device(host_peaks))



def _uses_nccl(trace, dist: dict) -> bool:
    """Whether the process ran NCCL: its process group's backend, or a host op nccl:*."""
    if str(dist.get("backend") or "").lower() == "nccl":
        return True
    ids = [i for i, name in enumerate(trace.names) if name.startswith("nccl:")]
    return bool(ids) and bool(np.isin(trace.cpu_name, ids).any())

def _what_if(trace: Trace, changes: tuple, steps: list[TraceStepFacts], windows, classes, layers, att, on_device: bool,
             removals: dict):
    """(critical path, what-if entries, the error that stopped them or None), each step updated with its own."""
    what_if_error = None
    try:
        if on_device:
            per_step = what_if.rank_steps(changes, windows, trace=trace, dev_classes=classes,
                                          data_spans=layers["data"], removals=removals)
        else:
            per_step = what_if.rank_steps(changes, windows, att=att, layers=layers, removals=removals)
    except Exception as exc:  # a graph this trace cannot give must not cost its analysis
        per_step, what_if_error = {}, f"{type(exc).__name__}: {exc}"
    for k, extra in per_step.items():
        steps[k].update(extra)
    critical_path, entries = what_if.summarize(steps, changes)
    return critical_path, entries, what_if_error


def rank_from_name(path: str) -> int | None:
    """Rank from a file name such as rank-3.json.gz, rank3.pt.trace.json, worker_3.pt.trace.json."""
    base = os.path.basename(str(path))
    m = re.search(r"rank[-_]?(\d+)", base, re.IGNORECASE)
    if m:
        return int(m.group(1))
    # "<name>_3.pt.trace.json"; not "<host>_<pid>.<timestamp>.pt.trace.json" (torch's default).
    m = re.search(r"_(\d+)\.pt\.trace\.json", base)
    if m:
        return int(m.group(1))
    return None


def _rank_of(trace: Trace, rank: int | None) -> tuple[int | None, str | None, dict]:
    """(rank, where it came from, the trace's distributedInfo with a rank or world size that
    cannot be one left out)."""
    meta = trace.meta
    dist = dict_at(meta, "distributedInfo")
    dist = {k: v for k, v in dist.items() if k not in ("rank", "world_size")} | {
        "rank": rank_number(dist.get("rank")), "world_size": world_size_number(dist.get("world_size"))}
    rank_from = "argument" if rank is not None else None
    if rank is None and dist["rank"] is not None:
        rank, rank_from = dist["rank"], "distributedInfo"
    if rank is None:
        rank = rank_number(rank_from_name(trace.source))
        rank_from = "file name" if rank is not None else None
    return rank, rank_from, dist


def _cause_facts(trace: Trace, tl: Timeline, rates: Rates, settings: FactSettings,
                 rank_shares: dict) -> tuple[CauseFacts, dict]:
    """(the cause rules' facts per traced step, in the document's order; what removing each
    cause would take away from each window, for the what-ifs)."""
    win, classes, on_device, device, att = tl.win, tl.classes, tl.on_device, tl.device, tl.att

    def worth(*phases: str) -> bool:
        """Whether a phase covers enough of this rank's time for its detailed facts to be worth
        their cost on a large trace (`cause_facts_min_share`: no cause rule names less)."""
        return any(rank_shares.get(p, 0.0) >= settings.cause_facts_min_share for p in phases)

    chains, chain_saving = fusion.elementwise_chains(trace, win) if worth("memory") else ([], None)
    math, math_saving = precision.math_facts(trace, classes, win, device) if on_device and worth("compute") \
        else (None, None)
    traffic, traffic_saving = memory_traffic.traffic_facts(
        trace, classes, win, device, settings.bandwidth_target_peak, settings.bandwidth_slow_peak,
        settings.bandwidth_min_call_mb * 1e6) if on_device and worth("memory") else (None, None)
    coll_records = _exposed(_tag_steps(collectives(trace, classes), tl.windows), att["parts"].get("comm"))
    if worth("comm", "wait"):
        coll_records = overlap.mark_after_backward(coll_records, trace, win, on_device)
    matrix, matrix_saving = matrix_ops.matrix_facts(trace, tl.op_info, win, rates.comp_t, device, on_device,
                                                    settings.cpu_half_precision_speedup,
                                                    att["parts"].get("compute", iv.EMPTY)) if worth("compute") \
        else (None, None)
    host_facts = on_device and worth("host")
    # The training thread's stretches outside every op: its facts and its what-if both read them.
    gaps = python_gaps.python_gaps(trace, win, settings.python_gap_min_us, settings.cpu_work_min_op_coverage) \
        if host_facts else iv.EMPTY
    passes = accumulation.ddp_passes(trace, win) if coll_records else None
    removals = removal_measures.per_window(trace, win, classes, att, tl.layers, chain_saving, math_saving,
                                           coll_records, matrix_saving, traffic_saving, host_calls=host_facts,
                                           cpu_work_coverage=settings.cpu_work_min_op_coverage, python_gaps=gaps,
                                           redundant_reduce=accumulation.redundant_share(passes))
    facts = CauseFacts(
        copies=host_device.copy_facts(trace, win) if on_device and worth("data", "host") else [],
        launches=host_device.launch_facts(trace, win) if host_facts else None,
        allocator=host_device.allocator_facts(trace, win) if host_facts else [],
        cpu_work=host_device.cpu_work_facts(trace, win, settings.cpu_work_min_op_coverage) if host_facts else [],
        python_gaps=python_gaps.python_gap_facts(trace, win, gaps) if host_facts else None,
        math=math,
        memory_traffic=traffic,
        matrix_ops=matrix,
        optimizer=optimizer.optimizer_facts(trace, win),
        accumulation=accumulation.accumulation_facts(passes),
        fsdp=overlap.fsdp_facts(trace, win),
        elementwise_chains=chains,
        # The job's own frames that call the ops pulling values to the host (windows with stacks).
        sync_sites=call_sites.call_sites(trace, win, SYNC_OP_NAMES),
        collectives=coll_records,
    )
    return facts, removals


def facts_of_loaded(trace: Trace, settings: FactSettings, rank: int | None = None, host: devices.Device | None = None
                    ) -> TraceRankFacts:
    """The facts of one rank of the diag.analysis/1 document from a loaded trace."""
    rank, rank_from, dist = _rank_of(trace, rank)
    props = trace.meta.get("deviceProperties") or []
    props = props[0] if isinstance(props, list) and props and isinstance(props[0], dict) else None
    on_device = trace.has_device
    device = devices.lookup(props) if on_device else host
    windows = step_windows(trace)
    if not windows:
        raise DiagInputError("trace has no timed events", source=trace.source)
    iterations = None
    if not trace.steps:  # no ProfilerStep spans: the steady iterations, found from repeating markers
        iterations = steady_iterations(trace, windows[0][1:], settings)
        windows = iterations.windows
    tl = attributed_timeline(trace, windows, on_device, device)
    rates = window_rates(trace, tl)
    steps, rank_shares, total_time = step_records(tl, rates)
    # Per traced step: the cause rules' facts, and what removing each cause would take away;
    # then each step's critical path and its duration under each what-if change.
    cause_facts, removals = _cause_facts(trace, tl, rates, settings, rank_shares)
    critical_path, what_if_entries, what_if_error = _what_if(trace, settings.what_if, steps, windows, tl.classes,
                                                             tl.layers, tl.att, on_device, removals)
    rank_m = rates.measurements(rank_shares, None, total_time, device)
    mem_frac = _memory_used_frac(trace, props)
    if mem_frac is not None:
        rank_m["memory_used_frac"] = mem_frac
    dev_info = _device_info(props, device, on_device)
    return TraceRankFacts(
        rank=rank,
        rank_from=rank_from,
        source=trace.source,
        device=dev_info["name"] or ("cpu" if not on_device else "gpu"),
        device_info=dev_info,
        world_size=dist["world_size"],
        backend=dist.get("backend"),
        shares=rank_shares,
        measurements=rank_m,
        steps=steps,
        gpu_time=(gpu_time.breakdown(trace) if on_device else None) or {
            "idle_pct": None, "compute_pct": None, "non_compute_pct": None, "comm_compute_overlap_pct": None},
        top_kernels=_top_kernels(trace, tl.classes, tl.op_info) if on_device else [],
        top_ops=_top_ops(trace),
        causes=cause_facts,
        mfu=rank_m.get("mfu"),
        timeline="device" if on_device else "cpu",
        # The process used a GPU (its properties, or runtime calls that launch work) but the trace
        # holds no device events: another CUPTI client (Nsight Systems) held the device's
        # activity, or it was filtered out. Its CPU attribution says nothing about the device.
        # NCCL runs only on GPUs: a process group on it, or its collectives' nccl:* ops, make a
        # GPU process too.
        device_events_missing=not on_device and (props is not None or len(trace.rt_ts) > 0
                                                  or _uses_nccl(trace, dist)),
        # The share of the host events the profiler numbered that the trace holds (None: not numbered).
        op_coverage=trace.op_coverage,
        # Without ProfilerStep spans: which iterations were judged, found how (None: the trace has steps).
        iterations=iterations.facts() if iterations is not None else None,
        n_events=trace.n_events,
        repairs=trace.repairs,
        attribution_order=list(tl.order) + ["host"],
        critical_path=critical_path,
        what_if=what_if_entries,
        what_if_error=what_if_error,
    )


def _memory_used_frac(trace: Trace, props) -> float | None:
    if not trace.peak_allocated or not props or not props.get("totalGlobalMem"):
        return None
    return float(max(trace.peak_allocated.values()) / float(props["totalGlobalMem"]))


def _device_info(props, device, on_device: bool) -> dict:
    if not on_device:
        return {"type": "cpu", "name": device.name if device else "CPU", "peaks": device.as_dict() if device else None}
    out = {"type": "gpu", "name": props.get("name") if props else None,
           "peaks": device.as_dict() if device else None,
           # The host link's rate each way (bytes/s): what a pinned host-to-device copy can reach.
           "host_link_bw": devices.HOST_LINK_BW.get(device.key) if device else None}
    if props:
        out["memory_bytes"] = props.get("totalGlobalMem")
        out["warp_size"] = props.get("warpSize")
        out["sm_count"] = props.get("numSms")
    return out


# --- tables ------------------------------------------------------------------------------


def _top_kernels(trace: Trace, cls: np.ndarray, ops: Ops) -> list[dict]:
    if not len(trace.dev_ts):
        return []
    total = float(trace.dev_dur.sum()) or 1.0
    t = np.bincount(trace.dev_name, weights=trace.dev_dur, minlength=len(trace.names))
    c = np.bincount(trace.dev_name, minlength=len(trace.names))
    out = []
    for nid in np.argsort(-t)[:TOP_N].tolist():
        if c[nid] == 0:
            break
        sel = np.flatnonzero(trace.dev_name == nid)
        ks = cls[sel]
        kc = int(np.bincount(ks, minlength=5).argmax())
        ais = []
        for i in sel[:256].tolist():
            j = ops.ext_to_row.get(int(trace.dev_ext[i]))
            if j is not None and np.isfinite(ops.ai[j]):
                ais.append(float(ops.ai[j]))
        out.append({"name": trace.names[nid], "class": ec.CLASS_NAMES[kc], "time_ms": float(t[nid]) / 1e3,
                    "count": int(c[nid]), "pct": 100.0 * float(t[nid]) / total,
                    "intensity": float(np.median(ais)) if ais else None})
    return out


def _top_ops(trace: Trace) -> list[dict]:
    rows = np.flatnonzero(trace.cpu_kind == 0)
    if not len(rows):
        return []
    ids = trace.cpu_name[rows]
    t = np.bincount(ids, weights=trace.cpu_dur[rows], minlength=len(trace.names))
    c = np.bincount(ids, minlength=len(trace.names))
    total = float(trace.cpu_dur[rows].sum()) or 1.0
    out: list[dict] = []
    for nid in np.argsort(-t).tolist():
        if len(out) >= TOP_N or c[nid] == 0:
            break
        name = trace.names[nid]
        if name.startswith("ProfilerStep"):
            continue
        out.append({"name": name, "class": ec.cpu_op_class(name), "time_ms": float(t[nid]) / 1e3,
                    "count": int(c[nid]), "pct": 100.0 * float(t[nid]) / total})
    return out


# --- collective records: {name, pg, seq, step, ts_us, dur_us, bytes, on} -------------------


def _bytes_of(args: dict) -> int | None:
    n = args.get("in_nelems")
    size = element_bytes(str(args.get("dtype") or ""))
    if isinstance(n, int) and size:
        return n * size
    dims_raw = args.get("input_dims")
    if dims_raw:
        dims, types = roofline.parse_shapes(dims_raw, args.get("input_type"))
        total = 0
        for i, d in enumerate(dims):
            t = types[i] if i < len(types) else None
            if isinstance(d, list) and d and all(isinstance(x, int) for x in d) and (elt := element_bytes(t)):
                total += int(np.prod(d)) * elt
            elif isinstance(d, list) and d and all(isinstance(x, list) for x in d) and t == "TensorList":
                pass
        return total or None
    return None


def _seq(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _tag_steps(records: list[dict], windows) -> list[dict]:
    """Add each collective's ProfilerStep number: the last step that began at or before it.

    No upper bound: device kernels run after the host-side step annotation that launched them.
    """
    if not records:
        return records
    starts = np.array([w[1] for w in windows], dtype=np.float64)
    k = np.searchsorted(starts, np.array([r["ts_us"] for r in records]), side="right") - 1
    for rec, i in zip(records, k.tolist()):
        rec["step"] = windows[i][0] if i >= 0 else None
    return records


def _exposed(records: list[dict], comm: np.ndarray | None) -> list[dict]:
    """Add each collective's exposed part: where its span is the step's exposed communication
    (nothing of higher priority runs beside it), as [start, end] pairs in the trace's clock.
    Where calls of one collective and process group run at once (a prefetched all-gather beside
    the current one), the time is the earlier-started call's, so the parts of a group add up to
    the time it exposes; calls of different groups each keep their own. The job analysis splits
    these into waiting for peers and transfer once it knows how long each rank waited
    (diag.analyzers.job.waits)."""
    if not records:
        return records
    comm = comm if comm is not None and len(comm) else iv.EMPTY
    lo = np.array([r["ts_us"] for r in records], dtype=np.float64)
    hi = lo + np.array([r["dur_us"] for r in records], dtype=np.float64)
    start = _after_earlier_calls(records, lo, hi)
    # Intervals of the (sorted, disjoint) comm set that may overlap each record's part.
    first = np.searchsorted(comm[:, 1], start, side="right") if len(comm) else np.zeros(len(lo), np.int64)
    last = np.searchsorted(comm[:, 0], hi, side="left") if len(comm) else np.zeros(len(lo), np.int64)
    for rec, a, b, i, j in zip(records, start.tolist(), hi.tolist(), first.tolist(), last.tolist()):
        rec["exposed"] = [[max(a, float(x)), min(b, float(y))] for x, y in comm[i:j].tolist() if min(b, y) > max(a, x)]
    return records


def _after_earlier_calls(records: list[dict], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Where each call's own part of its span begins: in start order within its (name, process
    group), where the earlier calls' spans end (what lies before, an earlier call holds)."""
    start = lo.copy()
    groups: dict[tuple, list[int]] = {}
    for k, r in enumerate(records):
        groups.setdefault((r["name"], r.get("pg")), []).append(k)
    for rows in groups.values():
        idx = np.array(rows)[np.argsort(lo[rows], kind="stable")]
        reached = np.maximum.accumulate(hi[idx])
        start[idx[1:]] = np.maximum(lo[idx[1:]], reached[:-1])
    return start


def collectives(trace: Trace, cls: np.ndarray | None) -> list[dict]:
    """Collective records in trace order: device NCCL/RCCL kernels, else host gloo spans."""
    out = []
    if cls is not None and np.any(cls == ec.COMM):
        # Host-side parameters (record_param_comms, nccl:* annotations), by External id.
        host_args = {}
        for (where, i), a in trace.coll_args.items():
            if where == "cpu":
                op = trace.names[trace.cpu_name[i]]
                host_args[int(trace.cpu_ext[i])] = {**a, "host_collective": ec.collective_name(op.split(":")[-1])}
        # Fallback link: the kernel's launch (same correlation id) inside a host collective span.
        host_rows = sorted((i for (where, i) in trace.coll_args if where == "cpu"), key=lambda i: trace.cpu_ts[i])
        host_ts = trace.cpu_ts[np.array(host_rows, dtype=np.int64)]
        host_end = (host_ts + trace.cpu_dur[np.array(host_rows, dtype=np.int64)]).tolist()
        host_ext = trace.cpu_ext[np.array(host_rows, dtype=np.int64)].tolist()
        # Vectorised lookups for all communication kernels at once: launch row, launch time,
        # and the last host collective span starting at or before it.
        rows = np.flatnonzero(cls == ec.COMM)
        corr = trace.dev_corr[rows]
        launch = np.full(len(rows), -1, dtype=np.int64)
        if len(trace.rt_corr):
            rt_order = np.argsort(trace.rt_corr, kind="stable")
            rt_sorted = trace.rt_corr[rt_order]
            k = np.searchsorted(rt_sorted, corr)
            kk = np.minimum(k, len(rt_sorted) - 1)
            hit = (corr >= 0) & (k < len(rt_sorted)) & (rt_sorted[kk] == corr)
            launch[hit] = rt_order[kk[hit]]
        t_launch = np.where(launch >= 0, trace.rt_ts[np.maximum(launch, 0)] if len(trace.rt_ts) else 0.0, 0.0)
        k_host = (np.searchsorted(host_ts, t_launch, side="right") - 1).tolist()
        host_ts_l = host_ts.tolist()
        ext_l, launch_l, t_l = trace.dev_ext[rows].tolist(), launch.tolist(), t_launch.tolist()
        for n, i in enumerate(rows.tolist()):
            kname = trace.names[trace.dev_name[i]]
            a = dict(trace.coll_args.get(("dev", i)) or {})
            ext = ext_l[n]
            linked = [host_args.get(e) for e in (ext, ext - 1, ext - 2)]  # nccl:* annotation, record_param_comms
            if launch_l[n] >= 0 and host_rows:
                t = t_l[n]
                k = k_host[n]
                for r in range(k, max(0, k - 8) - 1, -1):
                    if host_ts_l[r] <= t <= host_end[r]:
                        linked.append(host_args.get(host_ext[r]))
            for h in linked:
                if h:
                    for key, v in h.items():
                        if a.get(key) is None and v is not None:
                            a[key] = v
            name = (ec.collective_name(a.get("collective")) or a.get("host_collective")
                    or ec.collective_name(kname) or "unknown")
            out.append({"name": name, "pg": a.get("pg"), "seq": _seq(a.get("seq")),
                        "ts_us": float(trace.dev_ts[i]), "dur_us": float(trace.dev_dur[i]),
                        "bytes": _bytes_of(a), "on": "device", "kernel": kname})
        return out
    # CPU-only: gloo:* spans on gloo's threads are the collectives' execution.
    prefer = ("gloo:",), ("record_param_comms",), ("c10d::",)
    for prefixes in prefer:
        rows = np.flatnonzero(name_mask(trace, trace.cpu_name, lambda n, p=prefixes: n.startswith(p)))
        if not len(rows):
            continue
        rows = rows[np.argsort(trace.cpu_ts[rows], kind="stable")]
        for i in rows.tolist():
            a = trace.coll_args.get(("cpu", i), {})
            nm = trace.names[trace.cpu_name[i]]
            name = ec.collective_name(a.get("collective")) or ec.collective_name(nm.split(":")[-1]) or "unknown"
            out.append({"name": name, "pg": a.get("pg"), "seq": _seq(a.get("seq")),
                        "ts_us": float(trace.cpu_ts[i]), "dur_us": float(trace.cpu_dur[i]),
                        "bytes": _bytes_of(a), "on": "host", "op": nm})
        break
    return out
