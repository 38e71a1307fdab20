"""Background analysis of one profiler window, run as its own process by the agent.

    python -m diag.window_worker --serve      # one JSON job per line on stdin

Each job names a raw trace, where its summary goes, the rank and window's steps, the
decision-tree settings the agent resolved ("tree", diag.tree_settings/1) and the host's
calibration ("host_peaks"). It compresses the raw trace (gzip, atomically; the raw file is
removed), analyses it with the trace analyzer, and writes the small window summary of the
run-directory format (`diag.run_documents.WindowSummary`: the window's steps, its trace's
name, and the rank's trace facts or why there are none). It holds facts only: the agent
judges them for its live views, and the run's analysis judges them once the ranks' waits
are split. The training process keeps only that summary; the big trace never enters its
memory. Told to stop (SIGTERM), it removes what it was half-way through writing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from diag import atomic_io
from diag.analyzers.analysis_types import facts_document
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.trace.analysis import trace_facts
from diag.run_documents import WindowSummary, window_json


def compress(raw: Path) -> Path:
    if raw.name.endswith(".gz"):
        return raw
    dest = raw.with_name(raw.name + ".gz")
    tmp = raw.with_name(f".{raw.name}.gz.tmp")
    try:
        with open(raw, "rb") as src, gzip.open(tmp, "wb", compresslevel=3) as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, dest)
    except BaseException:
        # A full disk: the raw trace stays (it is whole), the half-written copy goes.
        tmp.unlink(missing_ok=True)
        raise
    raw.unlink()
    return dest


def summarise(trace: Path, rank: int, first: int, last: int, tree_settings: dict | None,
              host_peaks: dict | None = None) -> WindowSummary:
    created = time.time()
    error = None
    try:
        trace = compress(trace)
    except OSError as exc:
        error = f"{trace}: could not compress ({exc.strerror or exc})"
    analysis = None
    try:
        tree = load_tree(recorded=tree_settings) if tree_settings else load_tree()
        # The window's own steps only: the trace may hold a partial step at either edge.
        analysis = facts_document(trace_facts(str(trace), tree.facts, rank=rank, host_peaks=host_peaks,
                                              step_range=(first, last)))
    except Exception as exc:
        error = f"{trace}: analysis failed ({type(exc).__name__}: {exc})"
    return WindowSummary(first_step=first, last_step=last, trace=trace.name, created_unix=created, analysis=analysis,
                         error=error)


def run_job(job: dict) -> int:
    doc = summarise(Path(job["trace"]), int(job["rank"]), int(job["first"]), int(job["last"]), job.get("tree"),
                    job.get("host_peaks"))
    try:
        atomic_io.atomic_write_json(job["out"], window_json(doc))
    except OSError as exc:
        print(f"diag window worker: {job['out']}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return 1
    return 0 if doc.analysis is not None else 3


def serve(stream) -> int:
    """One job per JSON line until the agent closes the pipe (or dies: the pipe closes too).

    The agent keeps one such process for the whole run, so only the first window pays
    for starting Python and importing the analyzers.
    """
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            job = json.loads(line)
            run_job(job)
        except Exception as exc:  # one bad window must not end the service
            print(f"diag window worker: job failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 0


def _exit_on_sigterm(signum, _frame) -> None:
    # The agent ends a worker still busy at the job's end with SIGTERM: unwinding removes the
    # half-written compressed copy (compress), which SIGTERM's default action would leave behind.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diag.window_worker")
    p.add_argument("--serve", action="store_true", required=True, help="read jobs as JSON lines on stdin")
    p.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return serve(sys.stdin)


if __name__ == "__main__":
    sys.exit(main())
