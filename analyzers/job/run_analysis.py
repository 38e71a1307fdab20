"""The facts of the analysis document (diag.analysis/1) of a run directory written by the agent.

Every step is measured, labelled with its evidence:
- "trace": the step was inside a profiler window, and the trace analyzer attributed
  each moment of it (the window summaries in `rank-N/windows/`);
- "sampled": outside windows, from what the agent always measures and the composition
  of the most recent window (diag.analyzers.job.sampled).
The verdicts of the steps and ranks are the diagnosis's (`diagnosis.rank.judge_run_rank`),
on each rank's dict and the `RankInputs` beside it.

The job part holds the ranks absent (`missing_ranks`) and when each rank present last
reported and whether it closed (`reports`); which of those stopped before the job ended
(killed, hung, out of memory) is the diagnosis's call (diagnosis/reporting.py).
Pure: reads the run directory, returns plain data.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import msgspec
import numpy as np

from diag import rundir
from diag.analyzers.analysis_types import (
    AnalysisFacts,
    CauseFacts,
    JobFacts,
    RankFacts,
    RunRankFacts,
    RunStepFacts,
    TraceRankFacts,
    WindowFacts,
    trace_facts_from_document,
)
from diag.analyzers.job import waits
from diag.analyzers.job.sampled import (
    NO_SAMPLE,
    SampledSteps,
    nearest_samples,
    record_seconds,
    sample_utilization,
    sampled_steps,
    window_composition,
)
from diag.analyzers.model import CLASSES, FactSettings, share_ratios
from diag.analyzers.numbers import dict_at, finite
from diag.analyzers.numbers import median as _median
from diag.analyzers.trace import host_device
from diag.analyzers.trace.analysis import trace_facts
from diag.analyzers.whatif import rank as what_if
from diag.run_documents import RankRecords, RunRecords, WindowSummary
from diag.step_record import StepRecord

FINAL_STATUSES = rundir.FINAL_STATUSES
_STEP_EXTRAS = ("start_unix", "samples", "tokens", "peak_mem_bytes", "mfu")  # step record fields kept as they are
TOP_N = 20


# -- one rank ---------------------------------------------------------------------------


def _finite(x) -> TypeGuard[float]:
    """Whether x is a finite real number (so the checker reads it as a float after the test)."""
    return finite(x) is not None


def _sorted_quantile(vals: list, q: float):
    if not vals:
        return None
    return vals[min(len(vals) - 1, int(q * (len(vals) - 1) + 0.5))]


@dataclass(frozen=True)
class RankInputs:
    """What the diagnosis judges a run directory's rank by, beside its rank dict."""
    windows: list[WindowFacts]  # its profiler windows, their trace analyses' waits split
    sampled: SampledSteps  # its steps outside windows, as the tree's measurements


def _merge_table(tables: list[list[dict]]) -> list[dict]:
    merged: dict[str, dict] = {}
    for table in tables:
        for row in table:
            name = row.get("name")
            if name is None:
                continue
            if name not in merged:
                merged[name] = {k: v for k, v in row.items() if k not in ("time_ms", "count", "pct")}
                merged[name].update(time_ms=0.0, count=0)
            merged[name]["time_ms"] += float(row.get("time_ms") or 0.0)
            merged[name]["count"] += int(row.get("count") or 0)
    rows = sorted(merged.values(), key=lambda r: -r["time_ms"])
    total = sum(r["time_ms"] for r in rows)
    for r in rows:
        r["pct"] = 100.0 * r["time_ms"] / total if total > 0 else 0.0
    return rows[:TOP_N]


def _merge_gpu_time(analyses: list[TraceRankFacts]) -> dict:
    acc: dict[str, float] = {}
    weight: dict[str, float] = {}
    for a in analyses:
        g = a.gpu_time or {}
        wt = sum(float(s.get("duration_ms") or 0.0) for s in a.steps) or 1.0
        for k, v in g.items():
            if _finite(v):
                acc[k] = acc.get(k, 0.0) + float(v) * wt
                weight[k] = weight.get(k, 0.0) + wt
    keys = ("idle_pct", "compute_pct", "non_compute_pct", "comm_compute_overlap_pct")
    out = {k: (acc[k] / weight[k] if weight.get(k) else None) for k in keys}
    out.update({k: acc[k] / weight[k] for k in acc if k not in out})
    return out


def _warmup_cut(steps: list[dict], windows: list[WindowFacts], settings: FactSettings) -> int:
    """First step number that counts for the rank's verdict (start-up steps are atypical):
    the first profiler window's, else the one warm-up rule (model.warmup_steps)."""
    if windows:
        return min(w.first_step or 0 for w in windows)
    return steps[0]["step"] + settings.warmup_steps(len(steps)) if steps else 0


def _unsummarised_windows(rd: rundir.RunDir, rank: int, info: dict, windows: list[WindowSummary],
                          settings: FactSettings, errors: list, host_peaks: dict | None) -> list[WindowFacts]:
    """Traces whose background analysis never finished (the rank exited or was killed first).
    CPU traces use the calibration the rank's agent recorded (rank.json's `info`), else `host_peaks`."""
    host_peaks = info.get("host_peaks") or host_peaks
    # The steps the rank finished, where it closed and so recorded its last one: a trace cut
    # by the job's end holds the step then in progress.
    last = info.get("last_step")
    closed = info.get("status") not in (None, "running")
    done = (0, last) if closed and isinstance(last, int) and not isinstance(last, bool) else None
    named = {w.trace for w in windows}
    named |= {str(n)[: -len(".gz")] for n in named if str(n).endswith(".gz")}
    out = []
    for path in rd.traces(rank):
        if path.name in named or path.name.startswith("."):
            continue
        try:
            a = trace_facts(str(path), settings, rank=rank, host_peaks=host_peaks, step_range=done)
        except Exception as exc:
            errors.append({"source": str(path), "error": f"{type(exc).__name__}: {exc}"})
            continue
        nums = [s["step"] for s in a.steps if isinstance(s.get("step"), int)]
        if nums:
            out.append(WindowFacts(first_step=min(nums), last_step=max(nums), trace=path.name, facts=a))
    return out


def window_facts(w: WindowSummary) -> WindowFacts:
    """A window summary as the run analysis reads it: its trace's facts read back from their
    document form."""
    facts = trace_facts_from_document(w.analysis) if w.analysis is not None else None
    return WindowFacts(first_step=w.first_step, last_step=w.last_step, trace=w.trace, facts=facts, error=w.error)


def rank_windows(rd: rundir.RunDir, rank: int, records: RankRecords, settings: FactSettings, errors: list,
                 host_peaks: dict | None = None) -> list[WindowFacts]:
    """A rank's profiler windows, in step order, with their trace analyses where there are any:
    its window summaries (in `records`) and its traces that have none."""
    extra = _unsummarised_windows(rd, rank, records.info, records.windows, settings, errors, host_peaks)
    return sorted([window_facts(w) for w in records.windows] + extra, key=lambda w: w.first_step or 0)


def analyze_rank(rd: rundir.RunDir, rank: int, settings: FactSettings, errors: list | None = None,
                 windows: list[WindowFacts] | None = None,
                 rank_records: RankRecords | None = None) -> tuple[RunRankFacts, RankInputs]:
    """One rank of a run directory: (its rank dict, of step records measured by their profiler
    windows or by the sampled measurements and the rank's measurements over its counted
    steps; what the diagnosis judges it by besides). `rank_records`: what the rank wrote
    besides its steps, where already read."""
    read = rank_records if rank_records is not None else rd.rank_records(rank)
    info = read.info
    records = sorted(rd.steps(rank), key=lambda r: r.step)
    if windows is None:
        windows = rank_windows(rd, rank, read, settings, errors if errors is not None else [])
    analysed = [w for w in windows if w.facts is not None]
    analyses = [a for w in analysed if (a := w.facts) is not None]
    samples = sorted((s for s in read.samples if _finite(s.get("t"))), key=lambda s: s["t"])
    trace_steps, comps = _window_steps(analysed)
    steps_out, sampled = _rank_steps(records, trace_steps, comps, samples)
    cut = _warmup_cut(steps_out, analysed, settings)
    counted = [s for s in steps_out if s["step"] >= cut] or steps_out
    shares = _time_weighted_shares(counted)
    split = [a.wait_split or {} for a in analyses]
    measurements = _rank_measurements(counted, shares, any(x.get("measured") for x in split), comps, analyses,
                                      samples, info)
    critical_path, what_if_entries = what_if.summarize([s for s in counted if s["evidence"] == "trace"],
                                                       settings.what_if)
    dev = dict_at(info, "device")
    device = dev.get("name") or next((a.device for a in reversed(analyses) if a.device), None)
    model = info.get("model")
    traced = [(a, len(a.steps)) for a in analyses]
    return RunRankFacts(
        rank=rank,
        source=str(rd.rank_path(rank)),
        device=device,
        # The device's peaks and host link, as the newest window that read them recorded them.
        device_info=next((a.device_info for a in reversed(analyses) if a.device_info), None),
        world_size=info.get("world_size"),
        backend=info.get("backend") or next((a.backend for a in analyses if a.backend), None),
        host=info.get("host"),
        status=info.get("status"),
        # What ended the rank, where it did not finish (the exception its training raised, the signal).
        error=str(info["error"])[:2000] if isinstance(info.get("error"), str) else None,
        steps=cast(list[RunStepFacts], steps_out),  # built key by key (_rank_steps)
        gpu_time=_merge_gpu_time(analyses),
        top_kernels=_merge_table([a.top_kernels for a in analyses]),
        top_ops=_merge_table([a.top_ops for a in analyses]),
        causes=_merged_cause_facts(traced),
        mfu=measurements.get("mfu"),
        shares={b: measurements.get(f"{b}_share", 0.0) for b in CLASSES} if shares else None,
        measurements=measurements,
        wait_split=next((x for x in split if x.get("measured")), split[0] if split else
                        {"measured": False, "reason": "no profiler window analysed"}),
        waits_for=_most_common(a.waits_for for a in analyses),
        wait_share=measurements.get("wait_share"),
        evidence={
            "trace_steps": sum(1 for s in steps_out if s["evidence"] == "trace"),
            "sampled_steps": sum(1 for s in steps_out if s["evidence"] == "sampled"),
            "windows": [{"first_step": w.first_step, "last_step": w.last_step, "trace": w.trace} for w in windows],
            "samples": len(samples),
            "warmup_steps_excluded": sum(1 for s in steps_out if s["step"] < cut),
        },
        **_step_time_and_throughput(counted),
        # What the live model and optimizer held (diag.collectors.model_facts), and the rates measured.
        model=model if isinstance(model, dict) else None,
        # The settings of the DataLoader the agent wrapped (diag.collectors.loader_facts).
        loader=info.get("loader") if isinstance(info.get("loader"), dict) else None,
        critical_path=critical_path,
        what_if=what_if_entries,
        rates=measured_rates([trace_steps[n] for n in sorted(trace_steps)], {r.step: r for r in records},
                             [s["duration_ms"] for s in counted if s["evidence"] == "sampled"]),
    ), RankInputs(windows, sampled)


# The cause facts of the windows, merged in the document's order: lists of items (each with its
# per-step figures) item by item, the others as one figure set per step.
_MERGED_LISTS = ("copies", "allocator", "cpu_work", "elementwise_chains", "sync_sites")
_MERGED_ORDER = ("copies", "launches", "allocator", "cpu_work", "python_gaps", "math", "memory_traffic", "matrix_ops",
                 "optimizer", "accumulation", "fsdp", "elementwise_chains", "sync_sites")


def _merged_cause_facts(traced: list[tuple[TraceRankFacts, int]]) -> CauseFacts:
    """The cause facts of a rank's analysed windows (each with its count of steps), merged."""
    return CauseFacts(**cast(dict[str, Any], {k: (host_device.merge_list if k in _MERGED_LISTS else host_device.merge_per_step)(
        [(getattr(a.causes, k), n) for a, n in traced]) for k in _MERGED_ORDER}),
        collectives=[c for a, _ in traced for c in a.causes.collectives])


def _window_steps(analysed: list[WindowFacts]) -> tuple[dict[int, dict], list[tuple[int, dict]]]:
    """The profiled steps of a rank's analysed windows by number, and each window's composition
    (how its steps split their non-data time) by its first step."""
    trace_steps: dict[int, Any] = {}
    comps: list[tuple[int, dict]] = []
    for w in analysed:
        a = w.facts
        if a is None or a.device_events_missing:
            continue  # a GPU process's window without its device events: its steps stay sampled
        for s in a.steps:
            if isinstance(s.get("step"), int):
                trace_steps[s["step"]] = s
        c = window_composition(a)
        if c is not None:
            comps.append((w.first_step or 0, c))
    return trace_steps, comps


def _rank_steps(records: list[StepRecord], trace_steps: dict, comps: list, samples: list[dict]
                ) -> tuple[list[dict], SampledSteps]:
    """(every step of the rank, in step order: a profiled step as its window measured it, any
    other with the shares of its sampled measurements; the sampled steps' measurements)."""
    comp_starts = [c[0] for c in comps]
    sampled_recs = [r for r in records if r.step not in trace_steps]
    # A sample's utilisation is the device's over the second or so before it: one taken before
    # the first step began describes the idle start, not a step (a short run may have no other).
    starts = [r.start_unix for r in records if r.start_unix is not None]
    if starts:
        samples = [s for s in samples if s["t"] > min(starts)]
    mids = np.array([(r.start_unix or 0.0) + (r.duration_s or 0.0) / 2 for r in sampled_recs])
    nearest = nearest_samples(np.array([s["t"] for s in samples], dtype=float), mids).tolist()
    sample_util = sample_utilization(samples)
    util = np.array([sample_util[k] if k != NO_SAMPLE else np.nan for k in nearest])
    comp_of = []
    for r in sampled_recs:
        i = bisect.bisect_right(comp_starts, r.step) - 1
        comp_of.append(comps[i][1] if i >= 0 else (comps[0][1] if comps else None))
    sampled = sampled_steps(sampled_recs, [samples[k] if k != NO_SAMPLE else None for k in nearest], comp_of, util)

    steps_out: list[dict] = []
    j = -1  # index among the sampled records
    for rec in records:
        n = rec.step
        if n in trace_steps:
            entry = _profiled_step(trace_steps[n])
        else:
            j += 1
            length = record_seconds(rec)
            entry = {"step": n, "duration_ms": 1000.0 * float(length or 0.0),
                     "shares": sampled.shares[j], "evidence": "sampled"}
            # The host's own time, where the device clock paced the step (record_seconds took device_s).
            if rec.duration_s is not None and length is not rec.duration_s:
                entry["host_ms"] = 1000.0 * rec.duration_s
        entry["data_wait_ms"] = 1000.0 * rec.data_wait_s if rec.data_wait_s is not None else None
        for key, seconds in (("device_ms", rec.device_s), ("data_idle_ms", rec.data_idle_s),
                             ("collate_ms", rec.collate_s), ("cpu_ms", rec.cpu_s),
                             ("data_cpu_ms", rec.data_wait_cpu_s)):
            if seconds is not None:
                entry[key] = 1000.0 * seconds
        for k in _STEP_EXTRAS:
            v = getattr(rec, k)
            if v is not None:
                entry[k] = v
        steps_out.append(entry)
    # Trace steps the agent did not record (a window cut short by a crash) still count.
    recorded = {s["step"] for s in steps_out}
    for n in sorted(set(trace_steps) - recorded):
        t = trace_steps[n]
        steps_out.append({"step": n, "duration_ms": t.get("duration_ms"), "shares": t.get("shares"),
                          "evidence": "trace"})
    steps_out.sort(key=lambda s: s["step"])
    return steps_out, sampled


def _profiled_step(t: dict) -> dict:
    return {"step": t["step"], "duration_ms": t.get("duration_ms"), "shares": t.get("shares"), "evidence": "trace",
            **{k: t[k] for k in what_if.STEP_KEYS if k in t}}


def _time_weighted_shares(counted: list[dict]) -> dict | None:
    """The counted steps' class shares, weighted by their durations (None without shares)."""
    tot = 0.0
    a_data = a_host = a_comm = a_wait = a_memory = a_compute = 0.0  # summed step by step, in step order
    for s in counted:
        sh, d = s["shares"], s["duration_ms"]
        if isinstance(sh, dict) and _finite(d) and d > 0:
            tot += d
            g = sh.get
            a_data += float(g("data") or 0.0) * d
            a_host += float(g("host") or 0.0) * d
            a_comm += float(g("comm") or 0.0) * d
            a_wait += float(g("wait") or 0.0) * d
            a_memory += float(g("memory") or 0.0) * d
            a_compute += float(g("compute") or 0.0) * d
    if tot <= 0:
        return None
    acc = {"data": a_data, "host": a_host, "comm": a_comm, "wait": a_wait, "memory": a_memory, "compute": a_compute}
    return {b: acc[b] / tot for b in CLASSES}


def _exposed_data_ms(step: dict):
    """The step's data wait in which the device was idle where timing events measured it,
    at most the wait (the events' record latency can add a few microseconds), as
    job/sampled.py counts it; else the whole wait."""
    idle, wait = step.get("data_idle_ms"), step.get("data_wait_ms")
    if not _finite(idle):
        return wait
    return min(idle, wait) if _finite(wait) else idle


def _rank_measurements(counted: list[dict], shares: dict | None, wait_measured: bool, comps: list,
                       analyses: list[TraceRankFacts], samples: list[dict], info: dict) -> dict:
    """The tree's measurements of a rank over its counted steps."""
    measurements: dict = {}
    if shares:
        measurements = {f"{b}_share": v for b, v in shares.items() if b != "wait" or wait_measured}
        measurements.update(share_ratios(shares))
        bw = next((c["achieved_bw_frac"] for _, c in reversed(comps) if c.get("achieved_bw_frac") is not None), None)
        if bw is not None:
            measurements["achieved_bw_frac"] = bw
    else:
        data = [_exposed_data_ms(s) / s["duration_ms"] for s in counted
                if _finite(_exposed_data_ms(s)) and _finite(s.get("duration_ms")) and s["duration_ms"] > 0]
        if data:
            measurements["data_share"] = statistics.fmean(data)
    mfu = _median(s.get("mfu") for s in counted)
    if mfu is None:
        mfu = _median(a.mfu for a in analyses)
    if mfu is not None:
        measurements["mfu"] = mfu
    mem_frac = _memory_used_frac(samples, info)
    if mem_frac is not None:
        measurements["memory_used_frac"] = mem_frac
    return measurements


def _step_time_and_throughput(counted: list[dict]) -> dict:
    durations = [s["duration_ms"] for s in counted if _finite(s.get("duration_ms"))]
    wall_s = sum(durations) / 1000.0
    samples_total = sum(float(s.get("samples") or 0) for s in counted)
    tokens_total = sum(float(s.get("tokens") or 0) for s in counted)
    return {
        # durations are all finite already: no second filtering pass
        "step_time_ms": {"p50": statistics.median(durations) if durations else None,
                         "p95": _sorted_quantile(sorted(durations), 0.95),
                         "mean": statistics.fmean(durations) if durations else None},
        "throughput": {
            "samples_per_s": samples_total / wall_s if wall_s > 0 and samples_total else None,
            "tokens_per_s": tokens_total / wall_s if wall_s > 0 and tokens_total else None,
        },
    }


def measured_rates(trace_steps: list[dict], records: dict[int, StepRecord], unprofiled_ms: list) -> dict | None:
    """FLOPs the profiled steps executed, and the rate of the device work that ran them.

    The rate divides the steps' FLOPs by their compute and memory-bound time (the device
    work a model's size scales), not by the whole step: data, host, communication and
    waiting are separate terms of a plan's step time. The profiler slows the steps it
    records (on CPUs by half or more); that time is taken out by scaling the work time by
    the unprofiled steps' median duration over the profiled ones'.
    """
    flops = work_s = 0.0
    samples = tokens = 0.0
    n = 0
    for s in trace_steps:
        f, sh, d = s.get("flops"), s.get("shares"), s.get("duration_ms")
        if not (_finite(f) and f > 0 and isinstance(sh, dict) and _finite(d) and d > 0):
            continue
        n += 1
        flops += f
        work_s += (float(sh.get("compute") or 0.0) + float(sh.get("memory") or 0.0)) * d / 1000.0
        rec = records.get(s["step"])
        if rec is not None:
            samples += float(rec.samples or 0.0)
            tokens += float(rec.tokens or 0.0)
    if not n:
        return None
    traced = _median(s.get("duration_ms") for s in trace_steps)
    plain = _median(unprofiled_ms)
    dilation = min(1.0, plain / traced) if plain and traced else 1.0
    work_s *= dilation
    return {
        "steps": n,
        "flops_per_step": flops / n,
        "achieved_flops_per_s": flops / work_s if work_s > 0 else None,
        "profiler_dilation": dilation,
        "flops_per_sample": flops / samples if samples else None,
        "flops_per_token": flops / tokens if tokens else None,
        "basis": "FLOPs of the profiled steps' operators (from their shapes) over their compute and "
                 "memory-bound time",
    }


def _most_common(values):
    vals = [v for v in values if isinstance(v, int)]
    return max(set(vals), key=lambda v: (vals.count(v), -v)) if vals else None


def _memory_used_frac(samples: list[dict], info: dict) -> float | None:
    peak, total = None, None
    for s in samples:
        g = s.get("gpu")
        if isinstance(g, dict) and _finite(g.get("memory_used_bytes")):
            peak = max(peak or 0.0, float(g["memory_used_bytes"]))
            if _finite(g.get("memory_total_bytes")):
                total = float(g["memory_total_bytes"])
    dev = dict_at(info, "device")
    total = total or dev.get("memory_total_bytes")
    if peak is None or not total:
        return None
    return peak / float(total)


# -- the job ----------------------------------------------------------------------------


def rank_reports(run: RunRecords) -> dict:
    """When each rank present last reported, and whether it closed: the facts the diagnosis
    tells a stopped rank by (diagnosis/reporting.py)."""
    rows = []
    manifest = run.manifest
    for r, records in run.ranks.items():
        info = records.info
        readable = bool(info)
        beat = info.get("updated_unix")
        rows.append({"rank": r, "readable": readable, "status": info.get("status"),
                     "closed": info.get("status") in FINAL_STATUSES,
                     "last_heartbeat_unix": float(beat) if _finite(beat) else None,
                     "last_step": info.get("last_step"), "host": info.get("host")})
    return {"run_closed": manifest.get("status") not in (None, "running"),
            "ended_unix": manifest.get("ended_unix") if _finite(manifest.get("ended_unix")) else None,
            "ranks": rows}


def analyze_run(rd: rundir.RunDir, run: RunRecords, settings: FactSettings,
                host_peaks: dict | None = None) -> tuple[AnalysisFacts, dict[int, RankInputs]]:
    """(the facts of the analysis document (diag.analysis/1) of run directory `rd`, what the
    diagnosis judges each rank by besides); `run`: its records as `run_records.read_records`
    read them. `host_peaks` calibrates the CPU traces of ranks whose agent recorded no
    calibration. The job block holds the run's own job facts: the ranks missing and the
    world size; the facade adds the cross-rank facts."""
    manifest = run.manifest
    trace_errors: list[dict] = []
    windows = {r: rank_windows(rd, r, records, settings, trace_errors, host_peaks) for r, records in run.ranks.items()}
    windows = _split_window_waits(windows)
    ranks: list[RankFacts] = []
    inputs = {}
    for r, records in run.ranks.items():
        doc, inputs[r] = analyze_rank(rd, r, settings, errors=trace_errors, windows=windows[r], rank_records=records)
        ranks.append(doc)
    world = rundir.expected_world_size(manifest, [records.info for records in run.ranks.values()])
    job = JobFacts(missing_ranks=run.missing_ranks, world_size=world, reports=rank_reports(run))
    errors = [{"source": p.split(": ", 1)[0], "error": p.split(": ", 1)[-1]} for p in rd.problems] + trace_errors
    if not ranks:
        errors.append({"source": str(rd.path), "error": "no rank data in this run directory"})
    run_keys = ("run_id", "status", "started_unix", "ended_unix", "hosts", "versions", "config")
    return AnalysisFacts(source=str(rd.path), run={k: manifest.get(k) for k in run_keys}, ranks=ranks, job=job,
                         errors=errors), inputs


def _split_window_waits(windows: dict[int, list[WindowFacts]]) -> dict[int, list[WindowFacts]]:
    """Waiting for peers apart from transfer, in the windows' steps, before the ranks add them up."""
    analysed: dict[int, list[TraceRankFacts]] = {
        r: [a for w in ws if (a := w.facts) is not None] for r, ws in windows.items()}
    split, _ = waits.split_waits(analysed)
    out = {}
    for r, ws in windows.items():
        it = iter(split[r])
        out[r] = [msgspec.structs.replace(w, facts=next(it)) if w.facts is not None else w for w in ws]
    return out
