"""`diag export RUN_DIR`: serve a run directory's metrics to Prometheus from its files.

For runs whose agents had the endpoint off (DIAG_EXPORTER=0, a firewall between the
nodes and Prometheus, a shared filesystem readable from a login node) and for finished
runs. One endpoint serves every rank, told apart by the identity labels, exactly as the
agents' own endpoints would have. Each scrape first reads what was written since the
previous one: segment files are renamed into place whole, so a new file name is a
complete new batch of records.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from diag.analyzers.diagnosis.decision_tree import Tree, load_tree
from diag.atomic_io import read_json
from diag.diagnosis_document import diagnosis_in_summary
from diag.errors import DiagInputError
from diag.exporter.registry import render_text
from diag.exporter.runtime import DEFAULT_PORT_BASE, Handle
from diag.exporter.server import MetricsServer
from diag.live_verdict import LiveVerdicts, window_record
from diag.report import SUMMARY_JSON
from diag.run_documents import window_summary
from diag.rundir import NCCL_BENCH, RunDir, is_run_dir
from diag.segments import read_segment
from diag.step_record import from_json_record

HELP = "serve a run directory's metrics to Prometheus"


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by the agent")
    p.add_argument("--port", type=int, default=DEFAULT_PORT_BASE,
                   help=f"port to listen on (default: {DEFAULT_PORT_BASE}; 0 = any free port)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    p.add_argument("--once", action="store_true",
                   help="print the metrics in the Prometheus text format and exit instead of serving")


def _identity(run: RunDir, rank: int) -> dict:
    info = run.rank_info(rank) or {}
    manifest = run.manifest()
    device = info.get("device")
    gpu = device.get("index") if isinstance(device, dict) else None
    return {
        "run": info.get("run_id") or manifest.get("run_id") or run.path.name,
        "rank": rank,
        "local_rank": info.get("local_rank", ""),
        "host": info.get("host", ""),
        "gpu": gpu,
    }


class RunDirExport:
    """One Handle per rank, fed incrementally from the rank's files."""

    def __init__(self, path: str | Path):
        self.run = RunDir(path)
        self.handles: dict[int, Handle] = {}
        self._seen: dict[tuple[int, str], set[str]] = {}
        self._mtimes: dict[str, float] = {}
        self._lock = threading.Lock()
        self._live: dict[int, LiveVerdicts] = {}
        self._tree_loaded: Tree | None = None

    def refresh(self) -> list:
        with self._lock:
            for rank in self.run.ranks():
                h = self.handles.get(rank)
                if h is None:
                    info = self.run.rank_info(rank) or {}
                    h = self.handles[rank] = Handle(_identity(self.run, rank),
                                                    start_time=info.get("started_unix"))
                self._feed(rank, h)
            self._feed_nccl()
            return [h.state for _, h in sorted(self.handles.items())]

    def _new_files(self, rank: int, folder: str, pattern: str) -> list[Path]:
        d = self.run.rank_path(rank) / folder
        if not d.is_dir():
            return []
        seen = self._seen.setdefault((rank, folder), set())
        new = [p for p in sorted(d.glob(pattern)) if p.name not in seen]
        seen.update(p.name for p in new)
        return new

    def _feed(self, rank: int, h: Handle) -> None:
        """The rank's new records and windows, each step and window judged as the rank's own
        agent judges them live (the run directory holds facts only)."""
        live = self._live.get(rank)
        if live is None:
            live = self._live[rank] = LiveVerdicts(self._tree(), lambda msg: None)
        for win in self._new_files(rank, "windows", "window-*.json"):
            summary = window_summary(read_json(win, self.run.problems))
            facts = summary.analysis if summary is not None else None
            if facts is not None:
                judged = live.window_done(facts)
                h.observe_window(window_record(judged, facts))
        for seg in self._new_files(rank, "samples", "samples-*.jsonl"):
            for rec in read_segment(seg, self.run.problems):
                h.observe_sample(rec)
                live.latest_sample = rec
        for seg in self._new_files(rank, "steps", "steps-*.jsonl"):
            for raw in read_segment(seg, self.run.problems):
                rec = from_json_record(raw, self.run.problems, f"rank {rank}: ")
                if rec is None:
                    continue
                rec, verdict = live.judge(rec)
                h.observe_step(rec, verdict.get("bound"))
        for seg in self._new_files(rank, "events", "events-*.jsonl"):
            for rec in read_segment(seg, self.run.problems):
                h.observe_event(rec)

    def _tree(self):
        """The thresholds the run's agents resolved (decision_tree.json), else the defaults."""
        if self._tree_loaded is None:
            recorded = read_json(self.run.path / "decision_tree.json", self.run.problems)
            try:
                self._tree_loaded = load_tree(recorded=recorded) if recorded else load_tree()
            except Exception:
                self._tree_loaded = load_tree()
        return self._tree_loaded

    def _feed_nccl(self) -> None:
        """The job's files: bus bandwidth for every rank; the job verdict from the report
        summary (the diagnosis) on the lowest rank, where rank 0's agent would serve it."""
        doc = self._changed(NCCL_BENCH)
        if doc:
            for h in self.handles.values():
                h.observe_nccl(doc)
        summary = self._changed(SUMMARY_JSON)
        diagnosis = diagnosis_in_summary(summary)
        if diagnosis is not None and self.handles:
            self.handles[min(self.handles)].observe_diagnosis(diagnosis)

    def _changed(self, name: str) -> dict | None:
        """A job-level JSON file of the run directory, when it is new or changed since the last read."""
        path = self.run.path / name
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        if mtime == self._mtimes.get(name):
            return None
        self._mtimes[name] = mtime
        return read_json(path, self.run.problems)


def run(args) -> int:
    path = Path(args.run_dir)
    if not path.exists():
        raise DiagInputError("no such run directory", source=str(path))
    if not is_run_dir(path):
        raise DiagInputError("not a diag run directory (no manifest.json, no rank-NNNNN folders)",
                             source=str(path))
    export = RunDirExport(path)
    if not export.refresh():
        raise DiagInputError("run directory holds no ranks", source=str(path))
    for problem in export.run.problems:
        print(f"diag: warning: {problem}", file=sys.stderr)
    if args.once:
        sys.stdout.write(render_text(export.refresh).decode("utf-8"))
        return 0
    try:
        server = MetricsServer((args.bind, args.port), lambda: render_text(export.refresh)).start()
    except OSError as exc:
        raise DiagInputError(f"cannot listen on {args.bind}:{args.port} ({exc.strerror or exc})") from None
    print(f"diag: serving {len(export.handles)} rank(s) of {path} on "
          f"http://{args.bind}:{server.port}/metrics (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        while server.thread is not None and server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
