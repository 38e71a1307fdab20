"""The facade: the whole analysis document (schema diag.analysis/1) from files, trace
directories and run directories, with its diagnosis.

`analyze_paths` expands directories into per-rank trace files, analyses the traces in
parallel worker processes (as many as memory allows), delegates run directories to
`diag.analyzers.job.run_analysis.analyze_run`, adds the cross-rank facts from
`diag.analyzers.job.cross_rank.analyze_job`, and then the diagnosis
(`diag.analyzers.diagnosis.document.build_diagnosis`): the job block's verdict is the
diagnosis's, and the whole diagnosis document is under "diagnosis". A bad file becomes an
entry in "errors"; the others are still analysed. Pure: nothing is printed or written.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from diag.analyzers.diagnosis import decision_tree as dt
from diag.errors import DiagInputError

SCHEMA = "diag.analysis/1"
TRACE_SUFFIXES = (".json", ".json.gz")
# Per worker: interpreter + numpy (~150 MB) plus columns and decode buffers, which grow
# with the trace; gzip traces expand about tenfold.
_BASE_BYTES = 200 << 20
_GZ_EXPANSION = 10
_PER_JSON_BYTE = 0.6


def analyze_paths(paths, tree: dt.Tree | None = None, jobs: int | None = None, progress=None, pool=None) -> dict:
    """Analyse traces and run directories; returns the document of contract A.

    progress: optional callable(done, total, source) called as each trace finishes.
    pool: optional executor of the per-trace analyses (diag.ray_pool.RayPool) in place of
    the local processes: `pool.analyze(files, fn, args, memory_of, progress)`.
    """
    tree = tree or dt.load_tree()
    errors: list[dict] = []
    warnings: list[dict] = []
    files: list[str] = []
    run_docs: list[dict] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            if _is_run_dir(p):
                doc = _analyze_run_dir(p, tree, errors)
                if doc is not None:
                    run_docs.append(doc)
                continue
            found = trace_files_in(p)
            if not found:
                errors.append({"source": p, "error": "directory holds no trace files (*.json, *.json.gz)"})
            files.extend(found)
        elif os.path.exists(p):
            files.append(p)
        else:
            errors.append({"source": p, "error": "no such file or directory"})

    ranks = _analyze_files(files, tree, jobs, progress, errors, pool)
    for doc in run_docs:
        ranks.extend(doc.get("ranks") or [])
        errors.extend(doc.get("errors") or [])
        warnings.extend(doc.get("warnings") or [])
    _settle_ranks(ranks, warnings)
    ranks.sort(key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0))
    if len(run_docs) == 1 and not files:
        cross = run_docs[0].get("job") or cross_rank_facts(ranks, tree)
    else:
        cross = cross_rank_facts(ranks, tree)
    doc = {"schema": SCHEMA, "ranks": ranks, "job": cross, "errors": errors, "warnings": warnings}
    return with_diagnosis(doc, tree)


def analyze_run_dir(path, tree: dt.Tree | None = None) -> dict:
    """The analysis document of one run directory, with its diagnosis."""
    from diag.analyzers.job.run_analysis import analyze_run

    tree = tree or dt.load_tree()
    return with_diagnosis(analyze_run(path, tree=tree), tree)


def with_diagnosis(doc: dict, tree) -> dict:
    """The document with its job block's verdict and the diagnosis under "diagnosis"."""
    from diag.analyzers.diagnosis.document import build_diagnosis

    diagnosis = build_diagnosis(doc, None, tree)
    doc["job"] = diagnosis.pop("job")
    doc["diagnosis"] = diagnosis
    return doc


def trace_files_in(directory: str) -> list[str]:
    """Kineto trace files in a directory (not recursive), in rank-then-name order."""
    out = []
    for entry in sorted(Path(directory).iterdir()):
        if entry.is_file() and entry.name.endswith(TRACE_SUFFIXES) and not entry.name.startswith("."):
            out.append(str(entry))
    return out


def _is_run_dir(path: str) -> bool:
    from diag import rundir

    return rundir.is_run_dir(path)


def _analyze_run_dir(path: str, tree, errors: list) -> dict | None:
    from diag.analyzers.job.run_analysis import analyze_run

    try:
        return analyze_run(path, tree=tree)
    except DiagInputError as exc:
        errors.append({"source": exc.source or path, "error": _msg(exc)})
        return None


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


def _analyze_one(path: str, tree, decode_workers: int | None = None) -> tuple[str, object]:
    from diag.analyzers.trace.analysis import analyze_trace

    try:
        return "ok", analyze_trace(path, tree=tree, workers=decode_workers)
    except DiagInputError as exc:
        return "error", _msg(exc)
    except MemoryError:
        return "error", "out of memory while analysing this trace (try --jobs 1)"


def _analyze_files(files, tree, jobs, progress, errors, pool=None) -> list[dict]:
    ranks = []
    n = worker_count(files, jobs)
    if not files:
        return ranks
    results = []
    if pool is not None:
        results = pool.analyze(files, _analyze_one, (tree, 1), _estimate_bytes, progress)
    elif n <= 1 or len(files) == 1:
        for i, f in enumerate(files):
            # One file at a time: a large one may use decoding workers (idle CPUs only).
            results.append((f, _analyze_one(f, tree, None)))
            if progress:
                progress(i + 1, len(files), f)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor  # only here: a single trace needs no pool

        ctx = mp.get_context("spawn") if os.name != "posix" else mp.get_context("forkserver")
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            # One process per file already: no nested decoding pools.
            futures = [(f, pool.submit(_analyze_one, f, tree, 1)) for f in files]
            for i, (f, fut) in enumerate(futures):
                try:
                    results.append((f, fut.result()))
                except Exception as exc:  # a crashed worker (e.g. killed for memory)
                    results.append((f, ("error", f"analysis process failed ({type(exc).__name__}: {exc})")))
                if progress:
                    progress(i + 1, len(files), f)
    for f, (status, value) in results:
        if status == "ok":
            ranks.append(value)
        else:
            errors.append({"source": f, "error": value})
    return ranks


def _settle_ranks(ranks: list[dict], warnings: list) -> None:
    """Every rank dict gets an integer rank: distributedInfo, else file name, else order."""
    from diag.analyzers.trace.analysis import rank_from_name

    taken = {r["rank"] for r in ranks if isinstance(r.get("rank"), int)}
    multi = len(ranks) > 1
    nxt = 0
    for r in ranks:
        if isinstance(r.get("rank"), int):
            continue
        guess = rank_from_name(r.get("source", ""))
        if guess is not None and guess not in taken:
            r["rank"], r["rank_from"] = guess, "file name"
        else:
            while nxt in taken:
                nxt += 1
            r["rank"], r["rank_from"] = nxt, "order"
        taken.add(r["rank"])
        if multi:
            warnings.append({"source": r.get("source"),
                             "warning": f"no distributedInfo in the trace; rank {r['rank']} taken from the "
                                        f"{r['rank_from']}"})
    counts = Counter(r["rank"] for r in ranks)
    for rank, c in counts.items():
        if c > 1:
            warnings.append({"source": None, "warning": f"{c} traces claim rank {rank}; they may come from different runs"})
    sizes = {r.get("world_size") for r in ranks if r.get("world_size")}
    if len(sizes) > 1:
        warnings.append({"source": None, "warning": f"traces disagree on world size: {sorted(sizes)}"})


def cross_rank_facts(ranks: list[dict], tree) -> dict:
    """The cross-rank facts of the ranks analysed (the diagnosis adds the verdict)."""
    if not ranks:
        return {"stragglers": [], "findings": [], "world_size": None}
    from diag.analyzers.job import waits
    from diag.analyzers.job.cross_rank import analyze_job

    # Waiting for peers apart from transfer first: the facts below read the split shares.
    fresh = [r for r in ranks if isinstance(r.get("rank"), int) and "wait_split" not in r]
    if fresh:
        by_rank: dict[int, list[dict]] = {}
        for r in fresh:
            by_rank.setdefault(r["rank"], []).append(r)
        waits.split_waits(by_rank, tree)
        waits.resolve_peer_verdicts(ranks, tree)
    return analyze_job(ranks, tree)


def json_safe(obj):
    """The document with non-finite floats as null (JSON has no inf/NaN) and numpy scalars as Python."""
    t = type(obj)  # exact types first: a large document is mostly plain leaves
    if t is str or t is int or t is bool or obj is None:
        return obj
    if t is float:
        return obj if obj - obj == 0.0 else None  # NaN and +-inf give NaN
    if t is dict:
        return {k if type(k) is str else str(k): json_safe(v) for k, v in obj.items()}
    if t is list:
        return [json_safe(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        return json_safe(obj.item())
    return obj
