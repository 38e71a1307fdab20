"""A run directory's records beside its analysis: what each rank wrote (rank.json, step,
sample and event records, window summaries), the NCCL logs and `diag nccl` results.

The facade reads them once, and the diagnosis is built on them; the report's charts draw
them. The dict returned is the `run` argument of `build_diagnosis` and of the page model
(its keys are `diag.analyzers.views.report_model.RUN_KEYS`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from diag import atomic_io, rundir
from diag.analyzers.analysis_types import TraceRankFacts
from diag.analyzers.nccl import expected as nccl_expected
from diag.analyzers.nccl import log as nccl_log
from diag.errors import DiagInputError
from diag.step_record import to_json_record


def read_records(path, doc: dict, progress=None) -> dict:
    """The records of run directory `path`; step records only for the ranks whose steps the
    analysis `doc` does not already hold."""
    rd = rundir.RunDir(Path(path))
    covered = {r.get("rank") for r in doc.get("ranks") or []
               if isinstance(r, dict) and isinstance(r.get("evidence"), dict) and r.get("steps")}
    ranks = {}
    for rank in _progress(rd.ranks(), progress, "reading ranks"):
        ranks[rank] = {
            "info": rd.rank_info(rank) or {},
            # As JSON objects: the diagnosis reads the records of a rank its analysis left out.
            "steps": [] if rank in covered else [to_json_record(r) for r in rd.steps(rank)],
            "samples": rd.samples(rank),
            "events": rd.events(rank),
            "windows": rd.windows(rank),
            "traces": len(rd.traces(rank)),
            "nccl_logs": len(rd.nccl_logs(rank)),
        }
    run = {
        "path": os.fspath(path),
        "manifest": rd.manifest(),
        "ranks": ranks,
        "missing_ranks": rd.missing_ranks(),
        "problems": list(dict.fromkeys(rd.problems)),
    }
    _read_nccl(rd, run)
    return run


def _progress(items, progress, desc):
    return items if progress is None else progress(items, desc=desc)


def _read_nccl(rd: rundir.RunDir, run: dict) -> None:
    bench = atomic_io.read_json(rd.path / rundir.NCCL_BENCH, run["problems"])
    if bench is not None:
        if bench.get("schema") == "diag.nccl_bench/1":
            run["nccl_bench"] = bench
        else:
            run["problems"].append(f"{rd.path / rundir.NCCL_BENCH}: not a diag.nccl_bench/1 document")
    logs = [p for r in run["ranks"] for p in rd.nccl_logs(r)]
    # `diag run -- <launcher>` routes every rank's log into RUN_DIR/nccl/ and parses them
    # into RUN_DIR/nccl_log.json; the raw logs are parsed again when present (a newer parser
    # may find more), the saved document is the fallback.
    job_dir = rd.path / rundir.NCCL
    if job_dir.is_dir():
        logs += sorted(p for p in job_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if logs:
        try:
            run["nccl_log"] = nccl_log.parse_files([os.fspath(p) for p in logs])
        except DiagInputError as exc:
            run["problems"].append(str(exc))
    elif (rd.path / rundir.NCCL_LOG_DOC).exists():
        saved = atomic_io.read_json(rd.path / rundir.NCCL_LOG_DOC, run["problems"])
        if saved is not None and str(saved.get("schema", "")).startswith("diag.nccl_log/"):
            run["nccl_log"] = saved
        elif saved is not None:
            run["problems"].append(f"{rd.path / rundir.NCCL_LOG_DOC}: not a diag.nccl_log document")
    if run.get("nccl_bench"):
        try:
            run["nccl_bandwidth"] = bench_bandwidth(run["nccl_bench"], run.get("nccl_log"))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # an edited or damaged file
            run["problems"].append(f"{rd.path / rundir.NCCL_BENCH}: cannot be read as benchmark results ({exc})")


def bench_bandwidth(bench: dict, log: dict | None) -> list[dict]:
    """Each benchmark test's measured bus bandwidth beside the one its topology should reach
    (the topology `diag nccl` recorded, refined by the job's NCCL log)."""
    # The topology `diag nccl` recorded (flags, nvidia-smi), refined by what the job's NCCL log shows.
    saved = bench.get("topology") if isinstance(bench.get("topology"), dict) else None
    topo = nccl_expected.merge_topology(saved, nccl_expected.topology_from_nccl_log(log) if log else None)
    out = []
    for test in bench.get("tests") or []:
        if not isinstance(test, dict) or test.get("skipped"):
            continue
        view = test
        if not (test.get("hosts") or test.get("devices")) and bench.get("hosts"):
            view = {**test, "hosts": bench["hosts"]}
        out.append({"collective": test.get("collective"), **nccl_expected.bandwidth_facts(view, topo)})
    return out


def ranks_from_windows(ranks: dict) -> list[TraceRankFacts]:
    """Without a run analysis (it failed): each rank's last window summary the agent saved,
    holding the steps of all its windows."""
    out = []
    for rank, data in ranks.items():
        analyses = [w.get("analysis") for w in data["windows"] if isinstance(w.get("analysis"), dict)]
        if not analyses:
            continue
        last = {**analyses[-1], "rank": rank}
        last["steps"] = [{"evidence": "trace", **s} for a in analyses for s in (a.get("steps") or [])
                         if isinstance(s, dict)]
        out.append(cast(TraceRankFacts, last))  # a window's trace facts, read back from its summary
    return out
