"""torch.profiler windows on a schedule or on demand, saved per rank within a size budget.

Schedule: the first `skip_first` steps are never profiled (start-up, compilation,
allocator warm-up); then a window of `active` steps, preceded by `warmup` steps in
which the profiler runs but discards events, starts every `every` steps. Windows are
placed on absolute step numbers, so every rank profiles the same steps and the
cross-rank analysis can match them.

On demand: SIGUSR2 to any rank, or touching `RUN_DIR/profile.trigger`, profiles one
window on every rank. The first rank to see a trigger writes the step at which the
window starts (a few steps ahead) into a file created with O_EXCL; all ranks read the
same number, so the on-demand window lines up too.

Each step of a window is marked with a `ProfilerStep#<step>` range carrying the
training step number, exactly as torch.profiler's own schedule marks steps.
A profiler that fails (CUPTI refused, disk full on export) switches profiling off for
the run; the training goes on. The job's own profilers come first (profiler_guard.py): a
window gives way to one that starts, and none opens while one runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag import atomic_io, rundir
from diag.collectors.profiler_guard import ProfilerGuard
from diag.collectors.trace_export import (
    ExportFailed,
    ExportRoute,
    missing_trace,
    partial_traces,
    remove_partials,
    write_in_child,
)

TRIGGER_FILE = rundir.TRIGGER_FILE
TRACE_SUFFIX = ".pt.trace.json"
def trace_name(first_step: int) -> str:
    return f"window-{first_step:06d}{TRACE_SUFFIX}"


def default_activities():
    """CPU, and CUDA (which also covers HIP on ROCm builds) once the process has initialised
    its device: asked at each window, since a job initialises CUDA after the agent starts,
    and a CPU job on a GPU node (the demo) must neither start CUPTI nor, when the window
    stops, synchronise (and so create a context on) GPU 0."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            acts.append(ProfilerActivity.CUDA)
    except Exception:
        pass
    return acts


# The default schedule, shared with diag.Agent's signature so the two cannot drift apart.
# A window every 1000 steps keeps the profiler's cost under 2% of a run.
SKIP_FIRST, WARMUP, ACTIVE, EVERY = 10, 1, 3, 1000


@dataclass(frozen=True)
class WindowSettings:
    """When windows record (torch.profiler's schedule, in steps), what they record, and how
    much trace the rank keeps."""
    skip_first: int = SKIP_FIRST
    warmup: int = WARMUP
    active: int = ACTIVE
    every: int = EVERY
    record_shapes: bool = True
    with_flops: bool = True
    profile_memory: bool = False
    with_stack: bool = False  # every window records Python call stacks
    stack_windows: int = 1  # ... or only the first this many (the causes' call sites, at one window's cost)
    budget_bytes: int = 1 << 30  # traces kept on disk per rank
    lead_steps: int = 5  # an on-demand window starts this many steps after the request
    export_in_child: bool = True  # let a forked process write traces when that stalls training less


class ProfilerWindows:
    """Drives torch.profiler from the agent's step boundaries.

    The agent calls `begin(step)` when a step starts and `end(step)` when it ends; both
    are a single integer comparison outside windows.
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        settings: WindowSettings = WindowSettings(),
        *,
        trigger_dir: str | os.PathLike | None = None,
        on_trace: Callable[[int, int, Path], None] | None = None,
        log: Callable[[str], None] | None = None,
        activities=None,
        scheduled: bool = True,
        in_use: Callable[[], set[Path]] | None = None,
        guard: ProfilerGuard | None = None,
    ):
        s = settings
        skip_first, warmup, active = s.skip_first, s.warmup, s.active
        if active < 1 or warmup < 0 or skip_first < 0:
            raise ValueError("profiler schedule: active >= 1, warmup >= 0, skip_first >= 0")
        self.trace_dir = Path(trace_dir)
        # A rank killed mid-window left its partial trace: nothing will finish it.
        if remove_partials(self.trace_dir) and log is not None:
            log(f"profiler: removed partial traces left in {self.trace_dir} by an earlier run")
        # Traces the consumer still has to read (analysis pending): the budget spares them.
        # At most the consumer's queue of them, so the folder stays bounded.
        self.in_use = in_use
        self.skip_first = skip_first
        self.warmup, self.active = warmup, active
        self.every = max(s.every, warmup + active + 1)
        self.record_shapes = s.record_shapes
        self.with_flops = s.with_flops
        self.profile_memory = s.profile_memory
        self.with_stack = s.with_stack
        self.stack_windows = max(0, int(s.stack_windows))
        self.budget_bytes = s.budget_bytes
        self.export_route = ExportRoute(s.export_in_child and hasattr(os, "fork") and sys.platform == "linux")
        self.trigger_dir = Path(trigger_dir) if trigger_dir else None
        self.lead_steps = max(s.lead_steps, warmup + 1)
        self.on_trace = on_trace
        self._log = log or (lambda msg: None)
        self._activities = activities
        self.scheduled = scheduled

        self.enabled = True
        self.current_step = 0
        self.recording = False  # true during the active steps (the agent annotates data waits)
        self.windows_done = 0
        self._prof: Any = None  # torch.profiler.profile, while a window records
        self._step_rec: Any = None  # the open record_function of the step
        self._first: int | None = None  # active steps [first, last] of the window in progress
        self._last: int | None = None
        self._demand: int | None = None
        self._next_start = self._scheduled_after(0)
        self._signal_pending = False
        self._seen_trigger: int | None = self._trigger_mtime()
        self._old_handler: Any = None
        self._export_thread: threading.Thread | None = None
        self.guard = guard or ProfilerGuard(self._log)  # not installed: the agent installs its own
        self.guard.on_their_start = self._give_way

    # -- schedule ---------------------------------------------------------------------

    def _scheduled_first(self, n: int) -> int:
        return self.skip_first + self.warmup + n * self.every

    def _scheduled_after(self, step: int) -> int:
        """The step at which the next window's warm-up begins, at or after `step`."""
        candidates = []
        if self.scheduled:
            first0 = self._scheduled_first(0)
            n = 0 if step <= first0 - self.warmup else -(-(step - first0 + self.warmup) // self.every)
            candidates.append(self._scheduled_first(n) - self.warmup)
        if self._demand is not None:
            candidates.append(max(self._demand - self.warmup, step))
        return min(candidates) if candidates else 1 << 62

    @property
    def requested_step(self) -> int | None:
        """The first step of an on-demand window asked for and not yet begun, or None."""
        return self._demand

    @property
    def window_steps(self) -> tuple[int, int] | None:
        """The active steps (first, last) of the window being profiled, or None."""
        first, last = self._first, self._last
        return (first, last) if first is not None and last is not None else None

    def request(self, first_step: int | None = None) -> int:
        """Profile a window whose first active step is `first_step` (default: a few steps ahead)."""
        if first_step is None:
            first_step = self.current_step + self.lead_steps
        first_step = max(first_step, self.current_step + self.warmup + 1)
        self._demand = first_step
        if self._prof is None:
            self._next_start = self._scheduled_after(self.current_step + 1)
        return first_step

    # -- step hooks (training thread) -------------------------------------------------

    def begin(self, step: int) -> bool:
        """Returns True when the profiler did work (the caller keeps that out of step time)."""
        self.current_step = step
        if step < self._next_start and self._prof is None:
            return False
        if not self.enabled:
            return False
        if self._prof is None and self.guard.theirs_open:
            self._next_start = self._scheduled_after(step + 1)  # the guard said why, once
            return False
        try:
            if self._prof is None:
                self._start(step)
            if self._first is not None and step == self._first:
                with self.guard.ours():
                    self._prof.start_trace()
                self.recording = True
            if self.recording:
                from torch.autograd.profiler import record_function

                self._step_rec = record_function(f"ProfilerStep#{step}")
                self._step_rec.__enter__()
        except Exception as exc:
            self._fail("start", exc)
        return True

    def end(self, step: int) -> bool:
        if self._prof is None:
            return False
        try:
            if self._step_rec is not None:
                rec, self._step_rec = self._step_rec, None
                rec.__exit__(None, None, None)
            if self._last is not None and step >= self._last:
                self._finish()
        except Exception as exc:
            self._fail("stop", exc)
        return True

    def _start(self, step: int) -> None:
        if self._export_thread is not None and self._export_thread.is_alive():
            # The previous window is still being written; skip this one rather than wait.
            self._next_start = self._scheduled_after(step + 1)
            self._log("profiler: previous window still exporting; window skipped")
            return
        from torch.profiler import profile

        first = step + self.warmup
        self._first, self._last = first, first + self.active - 1
        if self._demand is not None and self._demand <= self._last:
            self._demand = None
        self._prof = profile(
            activities=self._activities or default_activities(),
            record_shapes=self.record_shapes or self.with_flops,
            with_flops=self.with_flops,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack or self.windows_done < self.stack_windows,
        )
        with self.guard.ours():
            self._prof.prepare_trace()  # warm-up: the profiler runs, events are dropped
        if self.warmup == 0:
            pass  # start_trace follows in begin() for this same step

    def _finish(self) -> None:
        prof, first, last = self._prof, self._first, self._last
        self._prof = None
        self._first = self._last = None
        self.recording = False
        if prof is None or first is None or last is None:  # no window in progress
            return
        self._next_start = self._scheduled_after(last + 1)
        with self.guard.ours():
            prof.stop_trace()
        self.windows_done += 1
        self._export_thread = threading.Thread(
            target=self._export, args=(prof, first, last), name="diag-trace-export", daemon=True
        )
        self._export_thread.start()

    def _export(self, prof, first: int, last: int) -> None:
        final = self.trace_dir / trace_name(first)
        tmp = self.trace_dir / f".window-{first:06d}.tmp"
        try:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            written = False
            if self.export_route.use_child():
                try:
                    fork_s, write_s = write_in_child(prof, tmp)
                    self.export_route.wrote(write_s, fork_s)
                    written = True
                except (ExportFailed, OSError) as exc:
                    # The child could not write (fork refused, the child failed or hung): threads
                    # write from now on, this window included, over whatever the child left.
                    self.export_route.child_allowed = False
                    self._log(f"profiler: writing the trace from a child process failed ({exc}); "
                              "traces are written by a thread from now on")
            if not written:
                t0 = time.perf_counter()
                prof.export_chrome_trace(str(tmp))
                self.export_route.wrote(time.perf_counter() - t0)
            if not tmp.exists():  # Kineto logs a failed write and returns
                raise missing_trace(tmp)
            os.replace(tmp, final)
        except Exception as exc:
            remove_partials(self.trace_dir)  # ours and Kineto's of it: one window is written at a time
            self._fail("export", exc)
            return
        self.enforce_budget(keep=final)
        if self.on_trace is not None:
            try:
                self.on_trace(first, last, final)
            except Exception as exc:  # the consumer's problem must not stop profiling
                self._log(f"profiler: window handler failed ({type(exc).__name__}: {exc})")

    def _fail(self, what: str, exc: Exception) -> None:
        self.enabled = False
        self.recording = False
        self._next_start = 1 << 62
        if self._step_rec is not None:
            try:
                self._step_rec.__exit__(None, None, None)
            except Exception:
                pass
            self._step_rec = None
        if self._prof is not None:
            try:
                with self.guard.ours():
                    self._prof.stop_trace()
            except Exception:
                pass
            self._prof = None
        self._log(f"profiler: {what} failed ({type(exc).__name__}: {exc}); profiling switched off, training goes on")

    def close(self) -> None:
        """End a window in progress (its steps so far are saved) and restore the signal handler."""
        if self._prof is not None and self.enabled:
            try:
                if self._step_rec is not None:
                    rec, self._step_rec = self._step_rec, None
                    rec.__exit__(None, None, None)
                # The step in progress at exit never completed: keep only finished steps.
                if self.recording and self._first is not None and self.current_step - 1 >= self._first:
                    self._last = self.current_step - 1
                    self._finish()
                else:
                    self._drop_window()
            except Exception as exc:
                self._fail("stop", exc)
        self.uninstall_signal()

    def _drop_window(self) -> None:
        """End the open window without a trace."""
        prof, self._prof = self._prof, None
        recording, self.recording = self.recording, False
        self._first = self._last = None
        with self.guard.ours():
            if not recording:
                # Still in warm-up (prepared, never started): torch warns on stderr when
                # such a session is stopped, so it is started and stopped at once, empty.
                prof.start_trace()
            prof.stop_trace()

    def _give_way(self) -> None:
        """The job's own profiler is starting: close diag's open window first, dropped."""
        if self._prof is None or not self.enabled:
            return
        if self._step_rec is not None:
            rec, self._step_rec = self._step_rec, None
            with self.guard.ours():
                rec.__exit__(None, None, None)
        try:
            self._drop_window()
        except Exception as exc:
            self._fail("stop", exc)
            return
        self._next_start = self._scheduled_after(self.current_step + 1)
        self._log(f"profiler: window at step {self.current_step} dropped for the job's own profiler")

    def wait_exported(self, timeout_s: float) -> None:
        t = self._export_thread
        if t is not None:
            t.join(timeout_s)

    # -- size budget ------------------------------------------------------------------

    def enforce_budget(self, keep: Path | None = None) -> list[Path]:
        """Delete the oldest traces while the folder is over budget (the newest is always kept)."""
        try:
            files = sorted(
                (p for p in self.trace_dir.iterdir() if p.is_file() and TRACE_SUFFIX in p.name),
                key=lambda p: p.name,
            )
        except OSError:
            return []
        sizes = {}
        for p in files:
            try:
                sizes[p] = p.stat().st_size
            except OSError:
                sizes[p] = 0
        total = sum(sizes.values())
        # A trace being written counts too: finished ones make room for it.
        for p in partial_traces(self.trace_dir):
            try:
                total += p.stat().st_size
            except OSError:
                pass
        try:
            busy = set(self.in_use()) if self.in_use is not None else set()
        except Exception:
            busy = set()
        removed = []
        for p in files[:-1]:
            if total <= self.budget_bytes:
                break
            if (keep is not None and p == keep) or p in busy:
                continue
            try:
                p.unlink()
                total -= sizes[p]
                removed.append(p)
            except OSError:
                pass
        if removed:
            self._log(f"profiler: trace budget {self.budget_bytes} bytes: deleted {len(removed)} oldest trace(s)")
        return removed

    # -- on demand --------------------------------------------------------------------

    def install_signal(self, signum: int = signal.SIGUSR2) -> bool:
        """Handle SIGUSR2 when nobody else does (never replace a user's handler)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            current = signal.getsignal(signum)
            if current not in (signal.SIG_DFL, None):
                self._log("profiler: SIGUSR2 already has a handler; on-demand windows use the trigger file only")
                return False
            self._old_handler = (signum, current)
            signal.signal(signum, self._on_signal)
            return True
        except (ValueError, OSError):
            return False

    def uninstall_signal(self) -> None:
        if self._old_handler is None:
            return
        signum, old = self._old_handler
        self._old_handler = None
        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signum, old if old is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: the agent's background thread does the work.
        self._signal_pending = True

    def _trigger_mtime(self) -> int | None:
        if self.trigger_dir is None:
            return None
        try:
            return (self.trigger_dir / TRIGGER_FILE).stat().st_mtime_ns
        except OSError:
            return None

    def poll_trigger(self) -> int | None:
        """Called about once a second off the training thread. Returns the first step of a
        window it requested, if any."""
        if not self.enabled:
            return None
        if self._signal_pending:
            self._signal_pending = False
            if self.trigger_dir is None:
                return self.request()
            try:
                (self.trigger_dir / TRIGGER_FILE).write_text(f"SIGUSR2 pid {os.getpid()} at {time.time():.3f}\n")
            except OSError:
                return self.request()
        mtime = self._trigger_mtime()
        if mtime is None or mtime == self._seen_trigger:
            return None
        self._seen_trigger = mtime
        return self.request(self._agreed_start(mtime))

    def _agreed_start(self, mtime: int) -> int:
        """The first rank to see trigger `mtime` chooses the step; the others read it."""
        proposal = self.current_step + self.lead_steps
        if self.trigger_dir is None:  # no trigger folder, so no peers to agree with
            return proposal
        path = self.trigger_dir / f".profile-trigger-{mtime}.step"
        try:
            # Written whole or not at all: a peer never reads a half-written step.
            if atomic_io.create_exclusive(path, str(proposal).encode()):
                return proposal
        except OSError:
            return proposal
        for _ in range(20):  # a file system slow to show the creator's file
            try:
                text = path.read_text().strip()
                if text:
                    return int(text)
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        return proposal
