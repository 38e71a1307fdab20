"""How a training loop ended: what it raised, or a stop from outside (SIGTERM: a scheduler's
time limit, torchrun, Kubernetes).

Where the job has no SIGTERM handler of its own, the signal unwinds the training loop as
Ctrl-C does (Terminated), the agent closes the rank as terminated, and the process then ends
by the signal itself, as it would have without the agent. A job's own handler is left alone.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable

_EXCEPTION_TEXT = re.compile(r"\A([A-Za-z_][\w.]*)(?:: (.*))?\Z", re.S)  # "OutOfMemoryError: CUDA out of memory"


def loop_exception(recorded: tuple | None, status: str, error: str | None) -> tuple[str, str] | None:
    """(type, text) of what the loop raised: as recorded, or read from close(status, "Type: text")
    of a framework callback (Lightning's on_exception)."""
    if recorded is None and error and status in ("failed", "interrupted"):
        m = _EXCEPTION_TEXT.match(error)
        if m:
            return (m.group(1), m.group(2) or "")
    return recorded


class Terminated(SystemExit):
    """Raised in the training thread when the process is told to stop (SIGTERM) and the job has
    no handler of its own: the loop unwinds as for Ctrl-C, the agent records the end, and the
    process then ends by the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return (f"{signal.Signals(self.signum).name}: the process was told to stop (a scheduler's time limit, "
                "torchrun or Kubernetes)")


class StopSignal:
    """The agent's SIGTERM handler, while installed, and the signal being handled."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self._handler: Callable | None = None
        self.received: int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._handler is not None:
            return
        try:
            if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                self._log("agent: SIGTERM has the job's own handler; a stop from outside is recorded when it "
                          "closes the agent")
                return
            signal.signal(signal.SIGTERM, self._on_term)
            self._handler = self._on_term
        except (ValueError, OSError):
            pass

    def _on_term(self, signum, frame) -> None:
        if self.received is not None:
            return  # already unwinding
        self.received = signum
        raise Terminated(signum)

    def uninstall(self) -> None:
        if self._handler is None:
            return
        try:
            if signal.getsignal(signal.SIGTERM) is self._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        self._handler = None

    def end_process(self) -> None:
        """After a SIGTERM the agent turned into Terminated: end the process by that signal."""
        signum, self.received = self.received, None
        if signum is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            sys.stderr.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        except (ValueError, OSError):
            pass
