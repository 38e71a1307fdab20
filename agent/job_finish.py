"""What rank 0 does once its own part of the run is closed: wait for the other ranks, write the
job's manifest and report, and keep the final metrics served for a while."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from diag import atomic_io, rundir


def job_status(own: str, finals: list[str | None]) -> str:
    """The job's status from rank 0's own and every rank's final status (None: not closed)."""
    if own != "completed":
        return own
    if any(s not in rundir.FINAL_STATUSES for s in finals):
        return "incomplete"
    for worst in ("failed", "terminated", "interrupted"):
        if worst in finals:
            return worst
    return "completed"


def finish_job(writer, world: int, own_status: str, *, quick: bool, config, heartbeat_s: float,
               exporter=None, verbose: bool = False) -> dict | None:
    """Wait for the other ranks (briefly when `quick`: a kill may follow), write the manifest and,
    unless the report is off, the report; its paths, or None."""
    peers = writer.read_peers()
    if world > 1:
        wait = min(config.report.wait_s, 10.0) if quick else config.report.wait_s
        peers = writer.wait_for_peers(wait, stale_s=max(3 * heartbeat_s, 3.0))
    finals = [i.get("status") if i else None for i in peers.values()]
    writer.write_manifest(job_status(own_status, finals), peers)
    if not config.report.enabled or not writer.enabled:
        return None
    from diag.report import read_diagnosis, write_report

    paths = write_report(writer.path, writer.path)
    if exporter is not None and paths:
        # The job verdict as the report's diagnosis gives it, for the lingering endpoint.
        diagnosis = read_diagnosis(paths["summary"])
        if diagnosis is not None:
            exporter.observe_diagnosis(diagnosis)
    html = (paths or {}).get("html")
    if html and verbose:
        print(f"diag: report written to {html}", file=sys.stderr, flush=True)
    return paths


def read_summary(run_dir: Path | None, report_paths: dict | None, wait_s: float) -> dict | None:
    """summary.json with the report's paths under "report"; None while it does not exist (after
    waiting up to `wait_s` for it)."""
    path = run_dir / "summary.json" if run_dir is not None else None
    deadline = time.monotonic() + max(wait_s, 0.0)
    while path is not None:
        doc = atomic_io.read_json(path) if path.exists() else None
        if isinstance(doc, dict):
            paths = report_paths or {k: path.with_name(f"report.{k}") for k in ("html", "md")}
            return {**doc, "report": {k: str(v) for k, v in paths.items() if Path(v).exists()}}
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return None


def linger(exporter, seconds: float, stop: threading.Event, event: Callable[..., None]) -> None:
    """Serve the final metrics for `seconds`, or until `stop` is set (safe from a signal handler)."""
    port = getattr(exporter, "port", None)
    event("exporter", f"serving the final metrics on port {port} for {seconds:.0f} s")
    deadline = time.monotonic() + seconds
    try:
        # Short sleeps, so a signal handler calling stop_linger() ends it at once.
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
    except KeyboardInterrupt:
        pass
