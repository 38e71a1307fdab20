"""The facade: the whole analysis document (schema diag.analysis/1) from files, trace
directories and run directories, with its diagnosis.

`analyze_paths` expands directories into per-rank trace files and runs the stages in
their order, every fact before any judgement:
1. facts: the traces in parallel worker processes (as many as memory allows,
   `trace.analysis.trace_facts`), run directories by `job.run_analysis.analyze_run`,
   waiting for peers apart from transfer (`job.waits`), and the cross-rank facts
   (`job.cross_rank.analyze_job`);
2. judgement: each rank's and step's verdicts (`diagnosis.rank`), ranks bound by their
   peer resolved across the job (`diagnosis.peers`), and the diagnosis
   (`diagnosis.document.build_diagnosis`): the job block's verdict is the diagnosis's, and
   the whole diagnosis document is under "diagnosis".
A bad file becomes an entry in "errors"; the others are still analysed. Pure: nothing is
printed or written.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import msgspec

from diag import atomic_io, rundir
from diag.analyzers.analysis_types import (
    Analysis,
    AnalysisFacts,
    Job,
    JobFacts,
    JudgedRank,
    RankFacts,
    RunRankFacts,
    TraceRankFacts,
    json_safe,
)
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis import peers
from diag.analyzers.diagnosis.document import build_diagnosis
from diag.analyzers.diagnosis.rank import judge_run_rank, judge_trace
from diag.analyzers.job import waits
from diag.analyzers.job.cross_rank import analyze_job
from diag.analyzers.job.run_analysis import analyze_run
from diag.analyzers.run_records import ranks_from_windows, read_records, with_steps_and_nccl
from diag.analyzers.trace.analysis import trace_facts
from diag.errors import DiagInputError
from diag.run_documents import RunRecords

S = TypeVar("S", bound=msgspec.Struct)
TRACE_SUFFIXES = (".json", ".json.gz")
# Per worker: interpreter + numpy (~150 MB) plus columns and decode buffers, which grow
# with the trace; gzip traces expand about tenfold.
_BASE_BYTES = 200 << 20
_GZ_EXPANSION = 10
_PER_JSON_BYTE = 0.6


def analyze_paths(paths, tree: dt.Tree | None = None, jobs: int | None = None, progress=None, pool=None,
                  host_peaks: dict | None = None) -> Analysis:
    """Analyse traces and run directories; returns the diag.analysis/1 document.

    progress: optional callable(done, total, source) called as each trace finishes.
    pool: optional executor of the per-trace analyses (diag.ray_pool.RayPool) in place of
    the local processes: `pool.analyze(files, fn, args, memory_of, progress)`.
    host_peaks: the host CPU's calibration (`diag calibrate`'s document) for CPU traces; a
    run directory's ranks use the one their agent recorded, when they have one.
    """
    tree = tree or dt.load_tree()
    errors: list[dict] = []
    warnings: list[dict] = []
    files: list[str] = []
    runs: list[RunFacts] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            if rundir.is_run_dir(p):
                try:
                    runs.append(run_facts(p, tree, host_peaks=host_peaks))
                except DiagInputError as exc:
                    errors.append({"source": exc.source or p, "error": _msg(exc)})
                continue
            found = trace_files_in(p)
            if not found:
                errors.append({"source": p, "error": "directory holds no trace files (*.json, *.json.gz)"})
            files.extend(found)
        elif os.path.exists(p):
            files.append(p)
        else:
            errors.append({"source": p, "error": "no such file or directory"})

    trace_ranks = _analyze_files(files, tree, jobs, progress, errors, pool, host_peaks)
    refuse_mixed_jobs(trace_ranks)
    for run in runs:
        errors.extend(run.doc.errors)
        warnings.extend(run.doc.warnings or [])
    trace_ranks = _settled_ranks(trace_ranks, [r for run in runs for r in run.doc.ranks], warnings)
    trace_ranks = split_waits(trace_ranks)
    one_run = len(runs) == 1 and not files
    all_facts = sorted([*trace_ranks, *(r for run in runs for r in run.doc.ranks)], key=lambda r: _rank_key(r.rank))
    job = job_facts(all_facts, tree, runs[0].doc.job if one_run else None)
    facts = AnalysisFacts(ranks=all_facts, job=job, errors=errors, warnings=warnings)
    # One run directory: its records for the diagnosis.
    return with_diagnosis(facts, _in_rank_order(judged_ranks(trace_ranks, tree, runs)), tree,
                          runs[0].records if one_run else None)


def _in_rank_order(ranks: Sequence[JudgedRank]) -> list[JudgedRank]:
    return sorted(ranks, key=lambda r: _rank_key(r.rank))


def _rank_key(rank: int | None) -> tuple[bool, int]:
    """Ranks in order, those without a number last."""
    return rank is None, rank if rank is not None else 0


def analyze_trace(path, tree: dt.Tree | None = None, rank: int | None = None, workers: int | None = 1,
                  host_peaks: dict | None = None, step_range: tuple[int, int] | None = None) -> JudgedRank:
    """One trace file's rank of the diag.analysis/1 document: its facts and verdicts."""
    tree = tree or dt.load_tree()
    return judge_trace(trace_facts(path, tree.facts, rank=rank, workers=workers, host_peaks=host_peaks,
                                   step_range=step_range), tree)


def split_waits(trace_ranks: Sequence[TraceRankFacts]) -> list[TraceRankFacts]:
    """The traces' facts with each rank's waiting for its peers split from transfer (new values)."""
    if not trace_ranks:
        return []
    by_rank: dict[int, list[TraceRankFacts]] = {}
    for r in trace_ranks:
        by_rank.setdefault(cast(int, r.rank), []).append(r)  # settled: every trace has its number
    split, _ = waits.split_waits(by_rank)
    return [r for docs in split.values() for r in docs]


def judged_ranks(trace_ranks: Sequence[TraceRankFacts], tree, runs: Sequence[RunFacts] = ()) -> list[JudgedRank]:
    """The ranks of one job with their verdicts: the traces' facts (their waits split) and the
    run directories' ranks, each judged on its own, then every rank bound by its peer resolved."""
    judged = [judge_trace(r, tree) for r in trace_ranks]
    for run in runs:
        judged += run.judged(tree)
    return peers.resolve(judged, tree)


def job_facts(ranks: Sequence[RankFacts], tree, run_job: JobFacts | Job | None = None) -> JobFacts:
    """The cross-rank facts of the ranks (the diagnosis adds the verdict), with a run
    directory's own: the ranks missing from it, its ranks' last reports and its world size."""
    job = analyze_job(ranks, tree.what_if) if ranks else JobFacts()
    if run_job is None:
        return job
    return msgspec.structs.replace(job, missing_ranks=run_job.missing_ranks, reports=run_job.reports,
                                   findings=run_job.findings + job.findings,
                                   world_size=run_job.world_size or job.world_size)


def analyze_run_dir(path, tree: dt.Tree | None = None, progress=None) -> Analysis:
    """The analysis document of one run directory, with its diagnosis."""
    return analyze_run_with_records(path, tree, progress)[0]


def analyze_run_with_records(path, tree: dt.Tree | None = None, progress=None) -> tuple[Analysis, RunRecords]:
    """(analysis document with its diagnosis, the run's records) of one run directory: the
    report draws its charts from the same records the diagnosis was built on. Without a
    tree, the run's own recorded settings decide."""
    tree = tree or tree_for_run(path)
    run = run_facts(path, tree, progress)
    facts = msgspec.structs.replace(run.doc, job=job_facts(run.doc.ranks, tree, run.doc.job))
    return with_diagnosis(facts, peers.resolve(run.judged(tree), tree), tree, run.records), run.records


def tree_for_run(path, config=None, overrides: dict | None = None) -> dt.Tree:
    """The tree a run directory is judged by: the settings its agent recorded (thresholds
    passed to diag.Agent, its config file), then `config` and `overrides` on top."""
    try:
        return dt.load_tree(config, overrides, recorded=recorded_tree_settings(path))
    except dt.TreeError as exc:
        raise DiagInputError(str(exc), source=str(Path(path) / rundir.TREE_SETTINGS)) from None


def recorded_tree_settings(path) -> dict | None:
    """The decision-tree settings a run directory recorded, or None (traces, older runs)."""
    file = Path(path) / rundir.TREE_SETTINGS
    if not Path(path).is_dir() or not file.exists():
        return None
    problems: list[str] = []
    settings = atomic_io.read_json(file, problems)
    if settings is None:
        raise DiagInputError(f"cannot read the recorded decision-tree settings ({'; '.join(problems)})",
                             source=str(file))
    return settings


@dataclass(frozen=True)
class RunFacts:
    """A run directory's facts: its analysis document (ranks and job block, no verdicts), what
    each rank is judged by besides (`RankInputs`; none where its ranks came from the window
    summaries alone), and its records."""
    doc: AnalysisFacts
    inputs: dict
    records: RunRecords

    def judged(self, tree) -> list[JudgedRank]:
        """The run's ranks, each judged on its own. A bug in judging the run analysis costs the
        precise verdict, not the report: the ranks of the window summaries are judged instead."""
        if not self.inputs:  # the ranks of the window summaries
            return [judge_trace(cast(TraceRankFacts, r), tree) for r in self.doc.ranks]
        try:  # the run analysis's ranks, each with what it is judged by
            return [judge_run_rank(cast(RunRankFacts, r), self.inputs[r.rank].windows, self.inputs[r.rank].sampled,
                                   tree) for r in self.doc.ranks]
        except Exception as exc:  # noqa: BLE001
            self.records.problems.append(f"{self.records.path or 'run'}: judging the run analysis failed "
                                         f"({type(exc).__name__}: {exc})")
            return [judge_trace(r, tree) for r in ranks_from_windows(self.records.ranks)]


def run_facts(path, tree, progress=None, host_peaks: dict | None = None) -> RunFacts:
    """The facts of one run directory: its analysis (or, where that failed, its ranks from
    their window summaries) and its records."""
    path = Path(path)
    if not path.exists():
        raise DiagInputError("no such run directory", source=str(path))
    if not path.is_dir() or not rundir.is_run_dir(path):
        raise DiagInputError("not a diag run directory (no manifest.json and no rank-NNNNN folders)",
                             source=str(path))
    problems: list[str] = []
    rd = rundir.RunDir(path)
    records = read_records(rd, progress)
    try:
        doc, inputs = analyze_run(rd, records, tree.facts, host_peaks=host_peaks)
    except Exception as exc:  # noqa: BLE001 - a bug in the run analysis costs the precise verdict, not the report
        problems.append(f"{path}: run analysis failed ({type(exc).__name__}: {exc})")
        doc, inputs = AnalysisFacts(job=JobFacts(reports=None)), {}
    records = with_steps_and_nccl(rd, records, doc)
    if not doc.ranks:
        doc, inputs = msgspec.structs.replace(doc, ranks=ranks_from_windows(records.ranks)), {}
    problems = list(dict.fromkeys(problems + records.problems))
    return RunFacts(doc, inputs, msgspec.structs.replace(records, problems=problems))


def with_diagnosis(facts: AnalysisFacts, ranks: list[JudgedRank], tree, records: RunRecords | None = None
                   ) -> Analysis:
    """The analysis document of `facts`, with `ranks` (its ranks judged), the job block's
    verdict and the diagnosis, built once on them and the run's records when there are any.
    The diagnosis is JSON-safe as built, so every view serialises the same bytes."""
    job, diagnosis = build_diagnosis(ranks, facts.job, records, tree)
    return Analysis(source=facts.source, run=facts.run, ranks=ranks, job=_json_safe_fields(job),
                    errors=facts.errors, warnings=facts.warnings, diagnosis=_json_safe_fields(diagnosis))


def _json_safe_fields(document: S) -> S:
    """A typed document whose fields' values are JSON-safe (`json_safe`)."""
    return msgspec.structs.replace(document, **{name: json_safe(getattr(document, name))
                                                for name in document.__struct_fields__})


def trace_files_in(directory: str) -> list[str]:
    """Kineto trace files in a directory (not recursive), in rank-then-name order."""
    out = []
    for entry in sorted(Path(directory).iterdir()):
        if entry.is_file() and entry.name.endswith(TRACE_SUFFIXES) and not entry.name.startswith("."):
            out.append(str(entry))
    return out


def _msg(exc: DiagInputError) -> str:
    text = str(exc)
    prefix = f"{exc.source}: " if exc.source else ""
    return text[len(prefix):] if prefix and text.startswith(prefix) else text


def worker_count(files: list[str], jobs: int | None) -> int:
    """Parallel processes: the user's --jobs, else as many as CPUs and free memory allow."""
    if len(files) <= 1:
        return len(files)
    if jobs:
        return max(1, min(int(jobs), len(files)))
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:
        avail = 2 << 30
    need = max(_estimate_bytes(f) for f in files)
    by_mem = max(1, int(avail * 0.7 // need))
    return max(1, min(os.cpu_count() or 1, by_mem, len(files)))


def _estimate_bytes(path: str) -> float:
    try:
        size = os.path.getsize(path)
    except OSError:
        return _BASE_BYTES
    raw = size * _GZ_EXPANSION if path.endswith(".gz") else size
    return _BASE_BYTES + raw * _PER_JSON_BYTE


def _analyze_one(path: str, tree, decode_workers: int | None = None, host_peaks: dict | None = None
                 ) -> tuple[str, object]:
    try:
        return "ok", trace_facts(path, tree.facts, workers=decode_workers, host_peaks=host_peaks)
    except DiagInputError as exc:
        return "error", _msg(exc)
    except MemoryError:
        return "error", "out of memory while analysing this trace (try --jobs 1)"


def _analyze_files(files, tree, jobs, progress, errors, pool=None, host_peaks=None) -> list[TraceRankFacts]:
    ranks: list[TraceRankFacts] = []
    n = worker_count(files, jobs)
    if not files:
        return ranks
    results = []
    if pool is not None:
        results = pool.analyze(files, _analyze_one, (tree, 1, host_peaks), _estimate_bytes, progress)
    elif n <= 1 or len(files) == 1:
        for i, f in enumerate(files):
            # One file at a time: a large one may use decoding workers (idle CPUs only).
            results.append((f, _analyze_one(f, tree, None, host_peaks)))
            if progress:
                progress(i + 1, len(files), f)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor  # only here: a single trace needs no pool

        ctx = mp.get_context("spawn") if os.name != "posix" else mp.get_context("forkserver")
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            # One process per file already: no nested decoding pools.
            futures = [(f, pool.submit(_analyze_one, f, tree, 1, host_peaks)) for f in files]
            for i, (f, fut) in enumerate(futures):
                try:
                    results.append((f, fut.result()))
                except Exception as exc:  # a crashed worker (e.g. killed for memory)
                    results.append((f, ("error", f"analysis process failed ({type(exc).__name__}: {exc})")))
                if progress:
                    progress(i + 1, len(files), f)
    for f, (status, value) in results:
        if status == "ok":  # trace_facts's, back from its process
            ranks.append(cast(TraceRankFacts, value))
        else:
            errors.append({"source": f, "error": value})
    return ranks


def refuse_mixed_jobs(trace_ranks: Sequence[TraceRankFacts]) -> None:
    """One document is one job: traces whose own distributedInfo states different world sizes,
    or several traces of a world of one, come from different jobs. Raises DiagInputError naming
    each job's files; a trace that states no world size joins any job (nothing says otherwise)."""
    by_world: dict[int, list[str]] = {}
    for r in trace_ranks:
        world = r.world_size
        if isinstance(world, int) and not isinstance(world, bool):
            by_world.setdefault(world, []).append(os.path.basename(r.source or "?"))
    if len(by_world) > 1 or len(by_world.get(1, ())) > 1:
        jobs = "; ".join(f"world size {w} ({', '.join(sorted(names))})" for w, names in sorted(by_world.items()))
        raise DiagInputError(f"these traces come from different jobs: {jobs}; analyse each job's traces on their own")


def _settled_ranks(trace_ranks: list[TraceRankFacts], run_ranks: Sequence[RankFacts], warnings: list
                   ) -> list[TraceRankFacts]:
    """The traces' facts, each with an integer rank: distributedInfo, else file name, else order
    (a new value where one is given). What the job's ranks disagree on goes to `warnings`."""
    from diag.analyzers.trace.analysis import rank_from_name

    taken = {r.rank for r in [*trace_ranks, *run_ranks] if isinstance(r.rank, int)}
    multi = len(trace_ranks) + len(run_ranks) > 1
    nxt = 0
    settled: list[TraceRankFacts] = []
    for r in trace_ranks:
        if not isinstance(r.rank, int):
            guess = rank_from_name(r.source)
            if guess is not None and guess not in taken:
                number, how = guess, "file name"
            else:
                while nxt in taken:
                    nxt += 1
                number, how = nxt, "order"
            r = msgspec.structs.replace(r, rank=number, rank_from=how)
            taken.add(number)
            if multi:
                warnings.append({"source": r.source,
                                 "warning": f"no distributedInfo in the trace; rank {r.rank} taken from the "
                                            f"{r.rank_from}"})
        settled.append(r)
    ranks = [*settled, *run_ranks]
    counts = Counter(r.rank for r in ranks)
    for rank, c in counts.items():
        if c > 1:
            warnings.append({"source": None, "warning": f"{c} traces claim rank {rank}; they may come from different runs"})
    sizes = {size for r in ranks if (size := r.world_size)}
    if len(sizes) > 1:
        warnings.append({"source": None, "warning": f"traces disagree on world size: {sorted(sizes)}"})
    return settled
