"""A run directory's records beside its analysis: what each rank wrote (rank.json, step,
sample and event records, window summaries), the NCCL logs and `diag nccl` results.

The facade reads them once, and the diagnosis is built on them; the report's charts draw
them. The `diag.run_documents.RunRecords` returned is the `run` argument of `build_diagnosis`
and of the page model.
"""

from __future__ import annotations

import os

import msgspec

from diag import atomic_io, rundir
from diag.analyzers.analysis_types import (
    AnalysisFacts,
    RunRankFacts,
    TraceRankFacts,
    trace_facts_from_document,
)
from diag.analyzers.nccl import expected as nccl_expected
from diag.analyzers.nccl import log as nccl_log
from diag.errors import DiagInputError
from diag.run_documents import RankRecords, RunRecords


def read_records(rd: rundir.RunDir, progress=None) -> RunRecords:
    """What run directory `rd` holds besides its step records, traces and NCCL files, each
    file read once: the run analysis and the diagnosis both read these."""
    ranks = {rank: rd.rank_records(rank) for rank in _progress(rd.ranks(), progress, "reading ranks")}
    manifest = rd.manifest()
    world = rundir.expected_world_size(manifest, [r.info for r in ranks.values()])
    return RunRecords(path=os.fspath(rd.path), manifest=manifest, ranks=ranks,
                      missing_ranks=rundir.missing_ranks(world, list(ranks)))


def with_steps_and_nccl(rd: rundir.RunDir, run: RunRecords, facts: AnalysisFacts) -> RunRecords:
    """`run` with the step records of the ranks whose steps the run analysis `facts` do not
    already hold, the problems met reading them all, and the NCCL results."""
    covered = {r.rank for r in facts.ranks if isinstance(r, RunRankFacts) and r.steps}
    ranks = {rank: rec if rank in covered else msgspec.structs.replace(rec, steps=rd.steps(rank))
             for rank, rec in run.ranks.items()}
    return _with_nccl(rd, msgspec.structs.replace(run, ranks=ranks, problems=list(dict.fromkeys(rd.problems))))


def _progress(items, progress, desc):
    return items if progress is None else progress(items, desc=desc)


def _with_nccl(rd: rundir.RunDir, run: RunRecords) -> RunRecords:
    """The run's records with its NCCL log facts and `diag nccl` results, where it has them."""
    problems = list(run.problems)
    bench = atomic_io.read_json(rd.path / rundir.NCCL_BENCH, problems)
    if bench is not None and bench.get("schema") != "diag.nccl_bench/1":
        problems.append(f"{rd.path / rundir.NCCL_BENCH}: not a diag.nccl_bench/1 document")
        bench = None
    log = _nccl_log(rd, list(run.ranks), problems)
    bandwidth: list[dict] = []
    if bench:
        try:
            bandwidth = bench_bandwidth(bench, log)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # an edited or damaged file
            problems.append(f"{rd.path / rundir.NCCL_BENCH}: cannot be read as benchmark results ({exc})")
    return msgspec.structs.replace(run, nccl_bench=bench, nccl_log=log, nccl_bandwidth=bandwidth, problems=problems)


def _nccl_log(rd: rundir.RunDir, ranks: list[int], problems: list[str]) -> dict | None:
    """The facts of the run's NCCL logs, parsed again where the raw logs are kept (a newer
    parser may find more), else the document the run saved."""
    logs = [p for r in ranks for p in rd.nccl_logs(r)]
    # `diag run -- <launcher>` routes every rank's log into RUN_DIR/nccl/ and parses them
    # into RUN_DIR/nccl_log.json.
    job_dir = rd.path / rundir.NCCL
    if job_dir.is_dir():
        logs += sorted(p for p in job_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if logs:
        try:
            return nccl_log.parse_files([os.fspath(p) for p in logs])
        except DiagInputError as exc:
            problems.append(str(exc))
            return None
    if not (rd.path / rundir.NCCL_LOG_DOC).exists():
        return None
    saved = atomic_io.read_json(rd.path / rundir.NCCL_LOG_DOC, problems)
    if saved is not None and str(saved.get("schema", "")).startswith("diag.nccl_log/"):
        return saved
    if saved is not None:
        problems.append(f"{rd.path / rundir.NCCL_LOG_DOC}: not a diag.nccl_log document")
    return None


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


def ranks_from_windows(ranks: dict[int, RankRecords]) -> list[TraceRankFacts]:
    """Without a run analysis (it failed): each rank's last window summary the agent saved,
    holding the steps of all its windows."""
    out = []
    for rank, data in ranks.items():
        analyses = [trace_facts_from_document(w.analysis) for w in data.windows if w.analysis is not None]
        if not analyses:
            continue
        steps = [{"evidence": "trace", **s} for a in analyses for s in a.steps if isinstance(s, dict)]
        out.append(msgspec.structs.replace(analyses[-1], rank=rank, steps=steps))
    return out
