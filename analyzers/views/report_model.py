"""The bottleneck report's data model: what the HTML, Markdown and JSON reports show.

`build_model(doc, run)` is pure: it takes an analysis document (schema diag.analysis/1)
with its diagnosis, and the records of its run directory already read into memory (`run`, a
`diag.run_documents.RunRecords`), and returns plain data. Nothing here reads files, prints or plots.

The judgement (verdict, headline, confidence, decision path, phase shares, evidence,
recommendations and their gains, findings, memory advice) is the document's "diagnosis",
which the facade built once on the same records; the model carries it as it is (under
"diagnosis", and its parts at the top level for the pages) and adds only what a page
needs: chart series, tables and what data was missing.

Big runs are aggregated so the report stays small and fast: per-step series are
bucketed to at most `Limits.series_points` points, heatmaps to `Limits.heatmap_columns`
columns, metric timelines of many ranks become min/median/max bands; each such
reduction is written into "notes" so the page says so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.analyzers.analysis_types import Analysis
from diag.analyzers.diagnosis.inputs import (
    CLASSES,
    Ranks,
    Steps,
    concat,
    job_steps,
    mean,
    measured_rates,
    merge_ranks,
    mode_bound,
    num,
    rank_shares,
)
from diag.analyzers.views.report_charts import (
    busbw_chart,
    lateness_heatmap,
    phase_series,
    step_heatmap,
    throughput_series,
    timelines,
    wait_heatmap,
)
from diag.diagnosis_document import SCHEMA as DIAGNOSIS_SCHEMA
from diag.diagnosis_document import Diagnosis
from diag.errors import DiagInputError
from diag.run_documents import RunRecords

MODEL_SCHEMA = "diag.report/1"
@dataclass(frozen=True)
class Limits:
    series_points: int = 500  # points per step-indexed chart
    heatmap_columns: int = 200  # step (or collective) buckets per heatmap row
    timeline_points: int = 600  # points per metric timeline
    rank_lines: int = 8  # above this many ranks, timelines become min/median/max bands
    table_rows: int = 20  # kernels and ops
    rank_rows: int = 256  # per-rank table rows


def build_model(doc: Analysis, run: RunRecords | None = None, limits: Limits | None = None) -> dict:
    """The report model from an analysis document with its diagnosis (the facade's, built on
    the same run records) and a run directory's records."""
    diagnosis = doc.diagnosis
    if diagnosis is None:
        raise DiagInputError(f"the analysis document has no {DIAGNOSIS_SCHEMA} diagnosis; "
                             "analyse the traces or run directory again with this diag")
    run = run or RunRecords()
    limits = limits or Limits()
    notes: list[str] = []

    ranks = merge_ranks(doc.ranks, run)
    world = _world_size(diagnosis, ranks)
    allt = concat(ranks)
    steps = job_steps(ranks)
    busbw = busbw_chart(run)
    charts = {
        "phases": phase_series(steps, limits, notes),
        "throughput": throughput_series(ranks, steps, limits, notes),
        "heatmap_step": step_heatmap(ranks, limits, notes),
        "heatmap_wait": wait_heatmap(ranks, limits, notes),
        "heatmap_lateness": lateness_heatmap(diagnosis.straggler_episodes),
        "timelines": timelines(ranks, limits, notes),
        "nccl_busbw": busbw,
    }
    nccl = dict(diagnosis.nccl)
    if busbw:
        nccl["bench_tests"] = [{"collective": s["collective"], "name": s["name"], "status": s["status"],
                                "max_busbw_gbps": max(s["y"])} for s in busbw["series"]]
    judged = {k: getattr(diagnosis, k) for k in _FROM_DIAGNOSIS}
    analysed = doc.ranks  # every analysed rank, a rank two traces claim twice
    return {
        "schema": MODEL_SCHEMA,
        "diagnosis": diagnosis,
        "run": _run_meta(doc, run, ranks, world, steps, diagnosis.missing_ranks),
        **judged,
        "ranks": _rank_rows(ranks, diagnosis.stragglers, limits, notes),
        "step_stats": _step_stats(steps),
        "throughput": diagnosis.run_figures.get("throughput") or {},  # absent only from a damaged saved one
        "top_kernels": _top_table([r.facts.top_kernels for r in analysed], limits),
        "top_ops": _top_table([r.facts.top_ops for r in analysed], limits),
        "nccl": nccl,
        "charts": charts,
        "missing": _missing(run, diagnosis, world, ranks, allt, nccl, busbw),
        "problems": _problems(doc, run),
        "notes": notes,
    }


# The diagnosis document's parts that the page shows as they are.
_FROM_DIAGNOSIS = ("bound", "headline", "confidence", "decision_path", "phase_shares", "measurements", "evidence",
                   "recommendations", "causes", "stragglers", "straggler_episodes", "findings", "memory",
                   "what_if")


# ---------------------------------------------------------------------------- tables, summary


def _top_table(per_rank: list[list[dict]], limits: Limits) -> list[dict]:
    """Kernels or ops (each rank's table of them) merged across ranks: mean time per rank that
    ran them."""
    acc: dict[str, dict] = {}
    n_ranks = 0
    for rows in per_rank:
        if not rows:
            continue
        n_ranks += 1
        for row in rows:
            if not isinstance(row, dict):
                continue
            name = str(row.get("name", "?"))
            a = acc.setdefault(name, {"name": name, "class": str(row.get("class") or ""), "time_ms": 0.0,
                                      "count": 0, "pct": [], "intensity": [], "ranks": 0})
            a["time_ms"] += num(row.get("time_ms")) or 0.0
            a["count"] += int(num(row.get("count")) or 0)
            if num(row.get("pct")) is not None:
                a["pct"].append(row["pct"])
            if num(row.get("intensity")) is not None:
                a["intensity"].append(row["intensity"])
            a["ranks"] += 1
    out = []
    for a in acc.values():
        out.append({
            "name": a["name"], "class": a["class"], "time_ms": a["time_ms"] / max(a["ranks"], 1),
            "count": a["count"], "pct": mean(a["pct"]), "intensity": mean(a["intensity"]),
            "ranks": a["ranks"],
        })
    out.sort(key=lambda x: -x["time_ms"])
    return out[: limits.table_rows]


def _rank_rows(ranks: Ranks, stragglers, limits, notes) -> list[dict]:
    late = {s["rank"] for s in stragglers}
    rows: list[dict[str, Any]] = []
    for r in ranks.values():
        durs = r.step_table.dur[~np.isnan(r.step_table.dur)]
        sh = rank_shares(r)
        if sh is not None and not (r.facts.wait_split or {}).get("measured"):
            sh = {**sh, "wait": None}  # not measured (no peers matched), which is not zero
        bound = r.verdict.bound if r.verdict.bound in CLASSES else mode_bound(r.step_table.bound)
        rows.append({
            "rank": r.rank, "host": r.host, "device": r.device, "bound": bound,
            "steps": len(r.step_table),
            "median_step_ms": float(np.median(durs)) * 1000 if len(durs) else None,
            "shares": sh,
            "trace_steps": int(r.step_table.traced.sum()),
            "windows": len(r.windows), "samples": len(r.samples),
            "straggler": r.rank in late,
            "bound_via": r.verdict.bound_via if isinstance(r.verdict.bound_via, int) else None,
            "mfu": num(r.facts.mfu),
        })
    if len(rows) > limits.rank_rows:
        notes.append(f"Per-rank table: {len(rows)} ranks; the {limits.rank_rows} slowest are listed.")
        rows.sort(key=lambda x: -(x["median_step_ms"] or 0))
        rows = sorted(rows[: limits.rank_rows], key=lambda x: x["rank"])
    return rows


def _step_stats(steps: Steps) -> dict | None:
    d = steps.dur[~np.isnan(steps.dur)]
    if not len(d):
        return None
    med = float(np.median(d))
    dev = steps.device[~np.isnan(steps.device)]
    return {"steps": int(len(d)), "median_ms": med * 1000, "mad_ms": float(np.median(np.abs(d - med))) * 1000,
            "p10_ms": float(np.percentile(d, 10)) * 1000, "p90_ms": float(np.percentile(d, 90)) * 1000,
            "mean_ms": float(d.mean()) * 1000, "total_s": float(d.sum()),
            # The device's own step time, from timing events (GPU runs of the agent).
            "device_median_ms": float(np.median(dev)) * 1000 if len(dev) else None,
            "device_steps": int(len(dev))}


def _run_meta(doc: Analysis, run: RunRecords, ranks: Ranks, world, steps, missing: list[int]) -> dict:
    man = run.manifest
    hosts = sorted({r.host for r in ranks.values() if r.host})
    if not hosts and isinstance(man.get("hosts"), list):
        hosts = [str(h if not isinstance(h, dict) else h.get("hostname", h.get("host", "?")))
                 for h in man["hosts"]]
    devices = Counter(r.device for r in ranks.values() if r.device)
    return {
        "path": run.path,
        "name": man.get("run") or man.get("name") or _name_from(run.path or doc.source_path, ranks),
        "world_size": world,
        "ranks_present": sorted(ranks),
        "missing_ranks": list(missing),
        "hosts": hosts[:64],
        "host_count": len(hosts),
        "devices": [f"{n} x {d}" for d, n in devices.most_common()],
        "backend": _backend(run, ranks),
        "nccl_applicable": _nccl_applicable(run, ranks),
        "start_unix": num(man.get("started_unix")) or num(man.get("start_unix")),
        "end_unix": num(man.get("ended_unix")) or num(man.get("end_unix")),
        "steps": int(len(steps)),
        "sources": sorted({r.facts.source for r in ranks.values() if r.facts.source})[:8],
    }


def _backend(run: RunRecords, ranks: Ranks) -> str | None:
    return run.manifest.get("backend") or next((r.info.get("backend") for r in ranks.values()
                                       if r.info.get("backend")), None)


def _nccl_applicable(run: RunRecords, ranks: Ranks) -> bool:
    """False for gloo/MPI jobs and for PyTorch builds without CUDA or ROCm (they cannot use NCCL)."""
    backend = _backend(run, ranks)
    if backend:
        return str(backend).lower() in ("nccl", "rccl")
    versions = run.manifest.get("versions")
    if isinstance(versions, dict) and "cuda" in versions and "hip" in versions:
        return bool(versions.get("cuda") or versions.get("hip"))
    return True


def _name_from(path, ranks: Ranks) -> str:
    """The run's directory name, else the trace file or folder the analysis came from."""
    if path:
        return str(path).rstrip("/").split("/")[-1]
    sources = sorted({r.facts.source for r in ranks.values() if r.facts.source})
    if len(sources) == 1:
        return sources[0].rstrip("/").split("/")[-1]
    if sources:
        parent = sources[0].rsplit("/", 1)[0] if "/" in sources[0] else ""
        return (parent.split("/")[-1] or "traces") + f" ({len(sources)} traces)"
    return "analysis"


def _problems(doc: Analysis, run: RunRecords) -> list[str]:
    out = list(run.problems)
    for e in doc.errors:
        out.append(f"{e.get('source', '?')}: {e.get('error', '?')}")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------- missing


def _missing(run: RunRecords, diagnosis: Diagnosis, world: int, ranks: Ranks, allt: Steps, nccl, busbw
             ) -> list[dict]:
    """What could not be measured, why it matters, and how to get it next time."""
    out = _missing_ranks(diagnosis.missing_ranks, diagnosis.stopped_ranks, world)
    if not ranks:
        out.append({"what": "No rank data at all.", "why": "Nothing to analyse.",
                    "how": "Run the training under diag.Agent(run_dir=...) so each rank writes its folder."})
        return out
    return (out + _missing_measurements(run, ranks, allt, world) + _missing_comm(run, ranks, world, nccl, busbw)
            + _missing_rates(ranks, allt))


def _world_size(diagnosis: Diagnosis, ranks: Ranks) -> int:
    """The job's world size as the diagnosis states it; a saved one that states none (damaged)
    has at least the ranks it holds."""
    world = diagnosis.world_size
    return world if isinstance(world, int) else max(len(ranks), 1)


def _missing_ranks(missing: list[int], stopped: list[int], world) -> list[dict]:
    """Ranks that left no data, and ranks that stopped reporting before the job ended."""
    out = []
    if missing:
        shown = ", ".join(str(r) for r in missing[:16]) + (" ..." if len(missing) > 16 else "")
        out.append({
            "what": f"Rank(s) {shown} left no data ({len(missing)} of {world}).",
            "why": "A missing rank may be the one that crashed, hung or straggled; the verdict covers only "
                   "the ranks present.",
            "how": "Check that rank's log for a crash or kill (OOM killer, NCCL timeout); make sure every "
                   "rank can write to the run directory.",
        })
    if stopped:
        shown = ", ".join(str(r) for r in stopped[:16]) + (" ..." if len(stopped) > 16 else "")
        out.append({
            "what": f"Rank(s) {shown} stopped reporting before the job ended.",
            "why": "Their data ends early; a rank that dies usually makes the others fail or hang in the next "
                   "collective.",
            "how": "Check the launcher's log and the host's kernel log (OOM killer, segfault, NCCL watchdog).",
        })
    return out


def _missing_measurements(run: RunRecords, ranks: Ranks, allt: Steps, world) -> list[dict]:
    """Waits not split from transfer, no profiler window, no metric samples."""
    out = []
    path = run.path or "RUN_DIR"
    unsplit = [r for r in ranks.values() if r.facts.steps and not (r.facts.wait_split or {}).get("measured")]
    if world > 1 and unsplit:
        reason = (unsplit[0].facts.wait_split or {}).get("reason") or "no collective matched across ranks"
        out.append({
            "what": f"Waiting for other ranks is not measured on {len(unsplit)} of {world} rank(s) ({reason}).",
            "why": "Waiting for a late peer is told apart from transfer only by matching each collective across "
                   "ranks; without that, the communication share includes any waiting.",
            "how": "Analyse the traces of all ranks of the same steps together (`diag analyze` on the folder, or "
                   "the agent's run directory), so each collective is seen from every rank.",
        })
    has_trace = bool(allt.traced.any()) or any(r.windows for r in ranks.values())
    if not has_trace and run.ranks:
        out.append({
            "what": "No profiler window was captured or analysed.",
            "why": "Without a trace the device's time cannot be split into communication, bandwidth-bound "
                   "and compute kernels; verdicts rest on step time, data wait and utilisation samples.",
            "how": "Keep the agent's profiler schedule on and run past its first skipped steps, or profile a "
                   f"window on demand: touch {path}/profile.trigger (or send SIGUSR2 to the training "
                   f"process); then run `diag report {path}`.",
        })
    samples = [s for r in ranks.values() for s in r.samples]
    if run.ranks and not samples:
        out.append({
            "what": "No device or host metric samples.",
            "why": "Utilisation, memory, power, clock and throttle timelines are empty.",
            "how": "Keep the agent's sampler enabled (1 Hz by default); on GPUs install nvidia-ml-py "
                   "(NVIDIA) or amdsmi (ROCm).",
        })
    elif samples and not any(isinstance(s.get("gpu"), dict) for s in samples):
        out.append({
            "what": "No device metrics (no NVML or amdsmi samples).",
            "why": "Device utilisation, memory, power, clocks and throttle events are unknown; on a CPU-only "
                   "run this is expected.",
            "how": "On NVIDIA GPUs install nvidia-ml-py and make libnvidia-ml visible to the process; "
                   "on AMD install amdsmi.",
        })
    return out


def _missing_comm(run: RunRecords, ranks: Ranks, world, nccl, busbw) -> list[dict]:
    """No NCCL log where the job used NCCL, and no bus-bandwidth measurement."""
    out = []
    path = run.path or "RUN_DIR"
    if world > 1 and not nccl.get("log_findings") and not nccl.get("transports") and not nccl.get("version"):
        if not _nccl_applicable(run, ranks):
            pass  # a gloo or MPI job, or a CPU-only PyTorch build, has no NCCL log to miss
        else:
            has_logs = any(r.nccl_logs for r in ranks.values())
            how = ("Logs were found but could not be parsed: see the problems listed below." if has_logs else
                   "Start the agent before init_process_group (it sets NCCL_DEBUG=INFO and NCCL_DEBUG_FILE), "
                   "or launch with `diag run -- <launcher command>`.")
            out.append({
                "what": "No NCCL log.",
                "why": "Without it the report cannot say which transport (NVLink, InfiniBand, TCP sockets) "
                       "carried the collectives, or explain NCCL warnings and timeouts.",
                "how": how,
            })
    if world > 1 and not busbw:
        out.append({
            "what": "No bus-bandwidth measurement.",
            "why": "Without it the report cannot compare the network against what it should deliver.",
            "how": f"Run `diag nccl --nproc-per-node N --run-dir {path}` on the same nodes "
                   "(or nccl-tests, then `diag nccl parse`).",
        })
    return out


def _missing_rates(ranks: Ranks, allt: Steps) -> list[dict]:
    """No throughput, no MFU, no DataLoader waits."""
    out = []
    if len(allt) and not (np.nansum(allt.samples) > 0 or np.nansum(allt.tokens) > 0):
        out.append({
            "what": "No throughput figures (samples or tokens per step).",
            "why": "Throughput over time and scaling efficiency between runs need them.",
            "how": "Pass them each step: agent.step(samples=batch_size, tokens=tokens_in_batch).",
        })
    if not any(num(r.facts.mfu) is not None for r in ranks.values()) and np.isnan(allt.mfu).all():
        counted = any(num((measured_rates(r.facts) or {}).get("flops_per_step")) or
                      any(num(s.get("flops")) for s in r.facts.steps) for r in ranks.values())
        out.append({
            "what": "No MFU (model FLOPs utilisation).",
            "why": "MFU says how far the job is from the device's peak; it needs FLOPs per step and the peak.",
            "how": ("The traced steps' FLOPs were counted, but the device's peak is not known: on a CPU run "
                    "`diag calibrate` on the same machine first; a GPU needs a name diag knows." if counted else
                    "Enable with_flops (and record_shapes) in the agent's profiler settings, on a device with "
                    "a known peak (or run `diag calibrate` for CPUs)."),
        })
    if len(allt) and np.isnan(allt.wait).all():
        out.append({
            "what": "No DataLoader wait times.",
            "why": "Outside profiler windows, data-bound steps cannot be told from others.",
            "how": "Wrap the loader: `for batch in agent.loader(train_loader): ...`.",
        })
    return out
