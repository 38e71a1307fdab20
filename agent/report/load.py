"""Reads a run directory into the in-memory form `diag.analyzers.views.report_model` takes.

The other parts of diag (run analysis, NCCL log parser, expected bandwidth table) are
imported lazily: when one is absent or fails, the report is still written and says
which part was unavailable and why.
"""

from __future__ import annotations

import os
from pathlib import Path

from diag import rundir
from diag.errors import DiagInputError

NCCL_BENCH_FILE = "nccl_bench.json"
NCCL_LOG_FILE = "nccl_log.json"  # written by `diag run`


def load_run(run_dir, tree=None, progress=None) -> tuple[dict, dict]:
    """(analysis document, run data) for `report_model.build_model`."""
    path = Path(run_dir)
    if not path.exists():
        raise DiagInputError("no such run directory", source=str(path))
    if not path.is_dir() or not rundir.is_run_dir(path):
        raise DiagInputError("not a diag run directory (no manifest.json and no rank-NNNNN folders)",
                             source=str(path))
    rd = rundir.RunDir(path)
    unavailable: dict[str, str] = {}
    manifest = rd.manifest()
    problems: list[str] = []
    doc = _analyse(path, tree, rd, unavailable, problems)
    covered = {r.get("rank") for r in doc.get("ranks") or []
               if isinstance(r, dict) and isinstance(r.get("evidence"), dict) and r.get("steps")}
    ranks = {}
    for rank in _progress(rd.ranks(), progress, "reading ranks"):
        ranks[rank] = {
            "info": rd.rank_info(rank) or {},
            # The run analysis already holds the step records of the ranks it covers.
            "steps": [] if rank in covered else rd.steps(rank),
            "samples": rd.samples(rank),
            "events": rd.events(rank),
            "windows": rd.windows(rank),
            "traces": len(rd.traces(rank)),
            "nccl_logs": len(rd.nccl_logs(rank)),
        }
    if not covered and not doc.get("ranks"):
        doc = _from_windows(ranks)
    run = {
        "path": os.fspath(path),
        "manifest": manifest,
        "ranks": ranks,
        "missing_ranks": rd.missing_ranks(),
        "problems": _dedupe(problems + rd.problems),
        "unavailable": unavailable,
    }
    _load_nccl(rd, run, unavailable)
    return doc, run


def load_analysis_json(path) -> dict:
    """A saved `diag analyze --json` document."""
    import json

    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise DiagInputError(f"not a readable JSON file ({exc})", source=str(path)) from None
    if not isinstance(doc, dict) or doc.get("schema") != "diag.analysis/1":
        raise DiagInputError("not a diag.analysis/1 document (expected the output of diag analyze --json)",
                             source=str(path))
    return doc


def _progress(items, progress, desc):
    if progress is None:
        return items
    return progress(items, desc=desc)


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _analyse(path: Path, tree, rd, unavailable: dict, problems: list) -> dict:
    """The run analysis (contract A), or an empty document when it cannot be had."""
    empty = {"schema": "diag.analysis/1", "ranks": [], "job": {}, "errors": []}
    try:
        from diag.analyzers.job.run_analysis import analyze_run
    except ImportError as exc:
        unavailable["run_analysis"] = f"diag.analyzers.job.run_analysis is not available ({exc})"
        return empty
    try:
        doc = analyze_run(path, tree=tree)
        if isinstance(doc, dict):
            return doc
        problems.append(f"{path}: run analysis returned no document")
    except DiagInputError as exc:
        problems.append(str(exc))
    except Exception as exc:  # a bug elsewhere must not cost the user the report
        problems.append(f"{path}: run analysis failed ({type(exc).__name__}: {exc})")
    return empty


def _from_windows(ranks: dict) -> dict:
    """Without the run analysis: the per-window rank summaries the agent saved (contract C)."""
    out_ranks = []
    for rank, data in ranks.items():
        analyses = [w.get("analysis") for w in data["windows"] if isinstance(w.get("analysis"), dict)]
        if not analyses:
            continue
        last = dict(analyses[-1])
        last["rank"] = rank
        last["steps"] = [dict(s) for a in analyses for s in (a.get("steps") or []) if isinstance(s, dict)]
        for s in last["steps"]:
            s.setdefault("evidence", "trace")
        out_ranks.append(last)
    return {"schema": "diag.analysis/1", "ranks": out_ranks, "job": {}, "errors": []}


def _load_nccl(rd: rundir.RunDir, run: dict, unavailable: dict) -> None:
    bench = rundir.read_json(rd.path / NCCL_BENCH_FILE, run["problems"])
    if bench is not None:
        if bench.get("schema") == "diag.nccl_bench/1":
            run["nccl_bench"] = bench
        else:
            run["problems"].append(f"{rd.path / NCCL_BENCH_FILE}: not a diag.nccl_bench/1 document")
    logs = [p for r in run["ranks"] for p in rd.nccl_logs(r)]
    # `diag run -- <launcher>` routes every rank's log into RUN_DIR/nccl/ and parses them
    # into RUN_DIR/nccl_log.json; the raw logs are re-parsed when present (a newer parser
    # may find more), the saved document is the fallback.
    job_dir = rd.path / rundir.NCCL
    if job_dir.is_dir():
        logs += sorted(p for p in job_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if not logs:
        saved = rundir.read_json(rd.path / NCCL_LOG_FILE, run["problems"]) if (rd.path / NCCL_LOG_FILE).exists() \
            else None
        if saved is not None:
            if str(saved.get("schema", "")).startswith("diag.nccl_log/"):
                run["nccl_log"] = saved
                try:
                    from diag.analyzers.nccl import log as nccl_log

                    summarize = getattr(nccl_log, "summarize_for_diagnosis", None)
                    if summarize is not None:
                        run["nccl_log_summary"] = summarize(saved)
                except ImportError:
                    pass
                except Exception as exc:
                    run["problems"].append(f"{rd.path / NCCL_LOG_FILE}: cannot be summarised "
                                           f"({type(exc).__name__}: {exc})")
            else:
                run["problems"].append(f"{rd.path / NCCL_LOG_FILE}: not a diag.nccl_log/1 document")
    if logs:
        try:
            from diag.analyzers.nccl import log as nccl_log
        except ImportError as exc:
            unavailable["nccl_log"] = f"the NCCL log parser is not available ({exc})"
        else:
            try:
                doc = nccl_log.parse_files([os.fspath(p) for p in logs])
                run["nccl_log"] = doc
                summarize = getattr(nccl_log, "summarize_for_diagnosis", None)
                if summarize is not None:
                    run["nccl_log_summary"] = summarize(doc)
            except DiagInputError as exc:
                run["problems"].append(str(exc))
            except Exception as exc:
                run["problems"].append(f"NCCL logs: parser failed ({type(exc).__name__}: {exc})")
    if run.get("nccl_bench"):
        run["nccl_interpretation"] = interpret_bench(run["nccl_bench"], run.get("nccl_log"), unavailable)


def interpret_bench(bench: dict, log: dict | None, unavailable: dict) -> list[dict]:
    """Each benchmark test against the bandwidth its topology should reach (topology from the NCCL log)."""
    try:
        from diag.analyzers.nccl import expected as nccl_expected
    except ImportError as exc:
        unavailable["nccl_expected"] = f"the expected-bandwidth table is not available ({exc})"
        return []
    out = []
    try:
        # The topology `diag nccl` recorded (flags, nvidia-smi), refined by what the job's NCCL log shows.
        saved = bench.get("topology") if isinstance(bench.get("topology"), dict) else None
        topo = nccl_expected.merge_topology(saved, nccl_expected.topology_from_nccl_log(log) if log else None)
        for test in bench.get("tests") or []:
            if not isinstance(test, dict) or test.get("skipped"):
                continue
            view = test
            if not (test.get("hosts") or test.get("devices")) and bench.get("hosts"):
                view = {**test, "hosts": bench["hosts"]}
            out.append({"collective": test.get("collective"), "world_size": test.get("world_size"),
                        **nccl_expected.interpret(view, topo)})
    except Exception as exc:  # the report goes on without the expected line
        unavailable["nccl_expected"] = f"expected bandwidth could not be computed ({type(exc).__name__}: {exc})"
    return out
