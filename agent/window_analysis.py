"""The agent's window analysis: one niced background process that analyses each saved
profiler trace, so the training thread never pays for it.

Traces queue here as the profiler saves them (at most `QUEUE` waiting; beyond that the
oldest is left to `diag analyze`), go one at a time to the `diag.window_worker --serve`
process, and each finished summary (`rank-N/windows/window-NNNNNN.json`) is handed to
`on_done`. A process that keeps dying is given up after three starts; the traces stay.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from diag import atomic_io
from diag.run_documents import window_summary

QUEUE = 8
MAX_STARTS = 3
# How long a busy analysis process has, once told to stop, to remove its partial file and exit.
STOP_GRACE_S = 1.0


class WindowAnalysis:
    def __init__(self, windows_dir: Path, rank: int, tree_settings: dict | None, host_peaks: dict | None,
                 on_done: Callable[[int, int, dict], None], log: Callable[[str], None]):
        self.windows_dir = windows_dir
        self.rank = rank
        self.tree_settings = tree_settings  # the agent's resolved thresholds (diag.tree_settings/1)
        self.host_peaks = host_peaks  # the host's calibration, recorded in rank.json too
        self.on_done = on_done
        self.log = log
        self._server: subprocess.Popen | None = None
        self._starts = 0
        self._inflight: dict[Path, tuple[int, int, Path]] = {}  # summary being written -> (first, last, trace)
        self._pending: collections.deque = collections.deque(maxlen=QUEUE)

    def queue(self, first: int, last: int, path: Path) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.log("profiler: analysis queue full; the oldest pending window is analysed later by `diag analyze`")
        self._pending.append((first, last, path))

    def in_use(self) -> set[Path]:
        """Traces saved but not analysed yet: the trace budget must not delete them."""
        return {p for _, _, p in list(self._pending)} | {p for _, _, p in list(self._inflight.values())}

    def pids(self) -> list[int]:
        server = self._server
        return [server.pid] if server is not None else []

    @property
    def idle(self) -> bool:
        return not self._inflight

    def poll(self, submit: bool) -> None:
        """Collect finished analyses; with `submit`, hand the next trace to the process."""
        server = self._server
        self._collect()
        if server is not None and server.poll() is not None:
            self._server = None
            for out, (first, _last, _path) in list(self._inflight.items()):
                del self._inflight[out]
                self.log(f"profiler: the window analysis process exited ({server.returncode}) during window "
                         f"{first}; `diag analyze` analyses its trace later")
        while submit and self._pending and not self._inflight:
            first, last, path = self._pending.popleft()
            self._submit(first, last, path)

    def finish(self, timeout_s: float, beat: Callable[[], None] | None = None, beat_s: float = 1.0) -> None:
        """Give the last windows up to timeout_s, then end the analysis process.

        `beat` is called every `beat_s` while the windows are waited for. The training loop's
        heartbeat has stopped by now, and rank 0, waiting for its peers' final status, gives up
        on a rank whose heartbeat stands still: a rank busy with its last windows must not read
        as a rank that died.
        """
        started = time.monotonic()
        deadline, last_beat = started + timeout_s, started
        while (self._inflight or self._pending) and time.monotonic() < deadline:
            self.poll(submit=True)
            if self._server is None and self._starts >= MAX_STARTS:
                break
            if beat is not None and time.monotonic() - last_beat >= beat_s:
                last_beat = time.monotonic()
                beat()
            if self._inflight or self._pending:
                time.sleep(0.1)
        self._collect()
        left = sorted([f for f, _, _ in self._inflight.values()] + [f for f, _, _ in self._pending])
        if left:
            self.log(f"profiler: {len(left)} window(s) not analysed before exit (first steps {left}); "
                     "`diag analyze` analyses their traces")
        busy = bool(self._inflight)
        self._inflight.clear()
        self._pending.clear()
        server, self._server = self._server, None
        if server is not None:
            try:
                if server.stdin is not None:  # always, with stdin=PIPE
                    server.stdin.close()  # end of jobs: the service exits
            except OSError:
                pass
            try:
                server.wait(0.5 if busy else 5.0)
            except subprocess.TimeoutExpired:
                _stop(server)

    def _start_server(self) -> subprocess.Popen | None:
        if self._starts >= MAX_STARTS:
            return None  # it keeps dying: leave the traces to `diag analyze`
        self._starts += 1
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "diag.window_worker", "--serve"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=env, close_fds=True, text=True)
        except OSError as exc:
            self.log(f"profiler: cannot start the window analysis ({exc.strerror or exc}); traces are kept")
            return None
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, 10)  # behind the training
        except (OSError, AttributeError):
            pass
        return proc

    def _submit(self, first: int, last: int, path: Path) -> None:
        out = self.windows_dir / f"window-{first:06d}.json"
        if self._server is None:
            self._server = self._start_server()
            if self._server is None:
                return
        job = {"trace": str(path), "out": str(out), "rank": self.rank, "first": first, "last": last,
               "tree": self.tree_settings, "host_peaks": self.host_peaks}
        pipe = self._server.stdin  # always set, with stdin=PIPE
        try:
            if pipe is None:
                raise ValueError("the analysis process has no input")
            pipe.write(json.dumps(job) + "\n")
            pipe.flush()
        except (OSError, ValueError) as exc:
            self.log(f"profiler: the window analysis process is gone ({exc}); traces are kept")
            self._server = None
            return
        self._inflight[out] = (first, last, path)

    def _collect(self) -> None:
        for out, (first, last, _path) in list(self._inflight.items()):
            if out.exists():
                del self._inflight[out]
                self._done(first, last, out)

    def _done(self, first: int, last: int, out: Path) -> None:
        doc = window_summary(atomic_io.read_json(out))
        if doc is None:
            self.log(f"profiler: window {first} analysis wrote nothing")
            return
        if doc.analysis is None:
            self.log(f"profiler: window {first}: {doc.error or 'no analysis'}")
            return
        self.on_done(first, last, doc.analysis)


def _stop(server: subprocess.Popen) -> None:
    """End the analysis process: SIGTERM, so it removes what it was half-way through writing,
    then SIGKILL if it does not go within STOP_GRACE_S."""
    server.terminate()
    try:
        server.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        server.kill()
        try:
            server.wait(2.0)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible I/O): the OS reaps it; the job goes on
