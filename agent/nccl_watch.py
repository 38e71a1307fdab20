"""The agent's live view of NCCL on one rank: `diag nccl` results in the run directory and
this rank's NCCL log, handed to the exporter when they change.

NCCL writes its log while communicators start, then (without COLL tracing) stays quiet:
the log is parsed once a change has settled for a few seconds. A log that keeps growing
(COLL tracing) is left to `diag report`, as is a very large one.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from diag import atomic_io, rundir
from diag.analyzers.nccl.log import parse_files

NCCL_LOG_PARSE_MAX = 16 << 20  # bytes; larger NCCL logs are parsed by `diag report`, not live
NCCL_LOG_SETTLE_S = 3.0  # a NCCL log is parsed live once it has not changed for this long


class NcclWatch:
    def __init__(self, run_path: Path, rank_path: Path, exporter, log: Callable[[str], None]):
        self.bench = run_path / rundir.NCCL_BENCH
        self.log_dir = rank_path / rundir.NCCL
        self.job_log_dir = run_path / rundir.NCCL  # where `diag run` sends every process's log
        self.exporter = exporter
        self.log = log
        self._seen: dict[str, tuple[float, int]] = {}  # file -> (mtime, size) last handed on
        self._log_changed: float | None = None  # when the log last changed, until parsed

    def poll(self) -> None:
        if self._changed(self.bench):
            doc = atomic_io.read_json(self.bench)
            if isinstance(doc, dict) and str(doc.get("schema") or "").startswith("diag.nccl_bench/"):
                self.exporter.observe_nccl(doc)
        logs = self._own_logs()
        now = time.monotonic()
        if any([self._changed(p) for p in logs]):
            self._log_changed = now
        if self._log_changed is None or now - self._log_changed < NCCL_LOG_SETTLE_S:
            return
        self._log_changed = None
        sized = [p for p in logs if p.is_file() and p.stat().st_size <= NCCL_LOG_PARSE_MAX]
        if len(sized) < len(logs):
            self.log(f"nccl: a log over {NCCL_LOG_PARSE_MAX >> 20} MB is left to `diag report`")
        if sized:
            self.exporter.observe_nccl(parse_files([str(p) for p in sized]))

    def _own_logs(self) -> list[Path]:
        """This rank's NCCL logs: those the agent routed into the rank's folder, and this
        process's file in the job's folder (NCCL names it by host and pid: nccl.%h.%p.log)."""
        try:
            logs = [self.log_dir / n for n in os.listdir(self.log_dir)] if self.log_dir.is_dir() else []
            # Two names at most: no listing of a folder that holds every process's log.
            host = socket.gethostname()
            mine = dict.fromkeys(f"nccl.{h}.{os.getpid()}.log" for h in (host, host.split(".")[0]))
            logs += [p for p in (self.job_log_dir / n for n in mine) if p.is_file()]
        except OSError:
            return []
        return logs

    def _changed(self, path: Path) -> bool:
        try:
            st = path.stat()
        except OSError:
            return False
        sig = (st.st_mtime, st.st_size)
        if self._seen.get(str(path)) == sig:
            return False
        self._seen[str(path)] = sig
        return True
