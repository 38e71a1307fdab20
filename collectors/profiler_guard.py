"""diag's profiler windows give way to every other torch profiler in the process.

torch allows one profiler session per process: a second one started while another runs
fails ("Profiler is already enabled on this thread") or cancels the first one's trace, and
interleaving two sessions' starts and stops has crashed the process. The job's own
profiler (a `torch.profiler.profile` in the loop, the HF Trainer's or Lightning's
profiler) must never fail or lose its trace because of diag. So:

- every profiler session in the process begins with `torch.autograd.profiler.profile.
  _prepare_trace` (`torch.profiler.profile` and `with torch.autograd.profiler.profile()`
  both call it) and ends with its `__exit__`; `ProfilerGuard.install()` wraps the two to
  see the job's sessions come and go. diag's own calls are made inside `ours()`;
- when the job's session is about to start while a diag window is open, the window is
  closed first (its steps so far dropped), then the job's session starts as if diag were
  not there;
- while a session of the job's is open, diag opens no window; the window is skipped and
  the skip logged once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager


def _profiler_enabled() -> bool:
    """torch's own flag: a profiler session records on this process now."""
    module = sys.modules.get("torch.autograd.profiler")
    return bool(getattr(module, "_is_profiler_enabled", False))


class ProfilerGuard:
    def __init__(self, log: Callable[[str], None] | None = None):
        self._log = log or (lambda msg: None)
        self._local = threading.local()
        self._theirs: set[int] = set()  # ids of the job's open profiler sessions
        self._lock = threading.Lock()
        self._installed: tuple | None = None  # (class, original _prepare_trace, original __exit__)
        self.on_their_start: Callable[[], None] | None = None  # closes diag's open window
        self.their_sessions = 0  # sessions of the job's seen, for the run's events

    @property
    def theirs_open(self) -> bool:
        """A session of the job's is open: seen starting, or (started before the guard was
        installed) enabled now while diag has none open, which the caller knows."""
        return bool(self._theirs) or _profiler_enabled()

    @contextmanager
    def ours(self):
        """diag's own profiler calls: not the job's sessions."""
        self._local.ours = True
        try:
            yield
        finally:
            self._local.ours = False

    def _is_ours(self) -> bool:
        return getattr(self._local, "ours", False)

    def install(self) -> bool:
        """Wrap torch's profiler session class (once per process); False where it cannot."""
        try:
            from torch.autograd import profiler as autograd_profiler

            cls = autograd_profiler.profile
            prepare, exit_ = cls._prepare_trace, cls.__exit__
        except Exception as exc:
            self._log(f"profiler: cannot watch the job's own profilers ({type(exc).__name__}: {exc})")
            return False
        if getattr(prepare, "_diag_guard", None) is not None:
            return True  # another agent in this process installed it: one guard is enough
        guard = self

        def _prepare_trace(prof, *args, **kwargs):
            if not guard._is_ours():
                guard._their_start(prof)
            return prepare(prof, *args, **kwargs)

        def __exit__(prof, *args, **kwargs):
            try:
                return exit_(prof, *args, **kwargs)
            finally:
                if not guard._is_ours():
                    with guard._lock:
                        guard._theirs.discard(id(prof))

        vars(_prepare_trace)["_diag_guard"] = guard  # how a later install or uninstall knows it
        cls._prepare_trace, cls.__exit__ = _prepare_trace, __exit__
        self._installed = (cls, prepare, exit_)
        return True

    def uninstall(self) -> None:
        if self._installed is not None:
            cls, prepare, exit_ = self._installed
            if getattr(cls._prepare_trace, "_diag_guard", None) is self:
                cls._prepare_trace, cls.__exit__ = prepare, exit_
            self._installed = None

    def _their_start(self, prof) -> None:
        with self._lock:
            first = not self._theirs and self.their_sessions == 0
            self._theirs.add(id(prof))
            self.their_sessions += 1
        if first:
            self._log("profiler: the job runs its own torch profiler; diag's windows give way to it "
                      "(a window open when it starts is dropped, none opens while it runs)")
        if self.on_their_start is not None:
            try:
                self.on_their_start()
            except Exception as exc:  # the job's profiler starts regardless
                self._log(f"profiler: closing diag's window for the job's profiler failed ({exc})")
