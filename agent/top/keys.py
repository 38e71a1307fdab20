"""Single key presses from a terminal, without waiting for Enter, for `diag top`.

The terminal goes to cbreak mode (keys arrive one at a time, unechoed; Ctrl-C still
interrupts) while `diag top` runs and is restored on exit, however it exits.
"""

from __future__ import annotations

import os
import select
import sys

# Escape sequences of the arrow keys (normal and application cursor mode).
_SEQUENCES = {"\x1b[A": "up", "\x1b[B": "down", "\x1bOA": "up", "\x1bOB": "down"}
_NAMES = {"\r": "enter", "\n": "enter", "\x1b": "escape"}


class KeyReader:
    """Context manager; `read(timeout_s)` returns the keys pressed within the timeout."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin
        self._fd: int | None = None
        self._saved = None

    def __enter__(self) -> KeyReader:
        try:
            import termios
            import tty

            fd = self.stream.fileno()
            if os.isatty(fd):
                self._saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self._fd = fd
        except (ImportError, OSError, ValueError):
            self._fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def read(self, timeout_s: float) -> list[str]:
        """The keys pressed before `timeout_s` ends (waits the whole timeout when none is)."""
        if self._fd is None:
            return []
        ready, _, _ = select.select([self._fd], [], [], max(timeout_s, 0.0))
        if not ready:
            return []
        data = os.read(self._fd, 64).decode("utf-8", "replace")
        return parse_keys(data)


def parse_keys(data: str) -> list[str]:
    """Key names of raw terminal input: arrows and enter by name, other keys as themselves."""
    keys, i = [], 0
    while i < len(data):
        seq = data[i:i + 3]
        if seq in _SEQUENCES:
            keys.append(_SEQUENCES[seq])
            i += 3
            continue
        keys.append(_NAMES.get(data[i], data[i]))
        i += 1
    return keys
