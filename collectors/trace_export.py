"""Writing a profiler window's trace without stalling the training: in a forked child, or in a
thread where that stalls it less (ExportRoute), and the partial files a killed writer leaves.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from diag import rundir

# A child writing a trace that has not finished in this long is stuck (a lock another thread
# held at the fork): it is killed and the window counts as failed.
EXPORT_CHILD_TIMEOUT_S = 600.0



class ExportFailed(RuntimeError):
    pass


# A window's trace is several MB of JSON before it is compressed: with less free than this,
# a trace that was not written was refused by its disk.
FULL_DISK_BYTES = 16 << 20


def missing_trace(path: Path) -> OSError:
    """Why a trace the profiler was told to write is not there. Kineto's writer logs a failed
    write and returns, so the error is lost; with its disk nearly full, it was the disk."""
    try:
        st = os.statvfs(path.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and free < FULL_DISK_BYTES:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)", str(path))
    return OSError(errno.ENOENT, "the profiler wrote no trace", str(path))


def _die_with_parent(parent: int) -> None:
    """In a forked child: be killed when the parent dies (Linux's PR_SET_PDEATHSIG), so a writer
    never outlives a rank killed mid-window with its partial trace; gone already, leave now."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


# A window's trace while it is written (`.window-N.tmp`, and Kineto's own `.window-N.tmp.tmp`):
# the run directory's rule for a file being written, by a window's name.
_PARTIAL_PREFIX = ".window-"


def partial_traces(trace_dir: Path) -> list[Path]:
    """The traces of a folder being written, or left half-written by a writer killed mid-window."""
    try:
        return [p for p in trace_dir.iterdir() if p.name.startswith(_PARTIAL_PREFIX) and rundir.is_leftover(p.name)]
    except OSError:
        return []


def remove_partials(trace_dir: Path) -> int:
    """Delete the partial traces of a trace folder (a writer killed mid-window left them); their count."""
    n = 0
    for p in partial_traces(trace_dir):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def write_in_child(prof, path: Path, timeout_s: float = EXPORT_CHILD_TIMEOUT_S) -> tuple[float, float]:
    """Write the trace from a forked copy of this process; return (seconds the fork took,
    seconds the child's write took).

    A child has its own interpreter and the window's events in its copy of memory; it writes
    the file and leaves with os._exit (no atexit handlers, no flushed buffers, no CUDA call),
    while this thread only waits for it, without the GIL. The fork itself holds the GIL while
    the kernel copies the page tables, in proportion to the process's memory."""
    read_end, write_end = os.pipe()
    t0 = time.perf_counter()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: write, report the time it took, then leave whatever happens
        code = 1
        try:
            _die_with_parent(parent)
            os.close(read_end)
            os.nice(10)  # background work: behind the training and its data loaders
            t = time.perf_counter()
            prof.export_chrome_trace(str(path))
            os.write(write_end, f"{time.perf_counter() - t:.6f}".encode())
            code = 0
        finally:
            os._exit(code)
    fork_s = time.perf_counter() - t0
    os.close(write_end)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise ExportFailed(f"the process writing the trace did not finish in {timeout_s:.0f} s")
            time.sleep(0.02)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not path.exists():
            raise ExportFailed(f"the process writing the trace exited with {code}")
        try:
            write_s = float(os.read(read_end, 64) or b"nan")
        except ValueError:
            write_s = float("nan")
    finally:
        os.close(read_end)
    return fork_s, write_s


class ExportRoute:
    """Where the next trace is written, by which stalls the training thread less.

    torch writes a trace in C++ without releasing the GIL, so a writing thread stops the
    training thread for the whole write: 0.77 s for an 86 MB trace here, during which training
    ran at under 1% of its speed (bench/bench_trace_export.py). A forked child stops it only
    for the fork, tens of ms for a process of a few GB. Small traces are the other way round.
    Both costs are measured as windows are written (a child times its own write, which is
    what a thread would have stalled) and the smaller last one decides; the first window goes
    to a child, which measures both."""

    def __init__(self, child_allowed: bool):
        self.child_allowed = child_allowed
        self.write_s: float | None = None
        self.fork_s: float | None = None

    def use_child(self) -> bool:
        if not self.child_allowed:
            return False
        if self.write_s is None or self.fork_s is None:
            return True
        return not self.write_s <= self.fork_s  # an unknown (NaN) write time: the child again

    def wrote(self, seconds: float, fork_s: float | None = None) -> None:
        self.write_s = seconds
        if fork_s is not None:
            self.fork_s = fork_s
