"""Progress bars for long report work: tqdm on a terminal, silent otherwise."""

from __future__ import annotations

import sys


def progress_factory(stream=None, enabled: bool | None = None):
    """A callable `(iterable, desc=...) -> iterable`, or None when no bar should be drawn.

    A bar is drawn only when the stream (stderr by default) is a terminal, so logs,
    pipes and CI output stay clean.
    """
    stream = stream or sys.stderr
    if enabled is None:
        enabled = bool(getattr(stream, "isatty", lambda: False)())
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    def bar(iterable, desc: str = "", total: int | None = None):
        return tqdm(iterable, desc=desc, total=total, file=stream, leave=False, unit="item")

    return bar


class Stages:
    """A bar over the named stages of one report (read, analyse, render, write)."""

    def __init__(self, names: list[str], stream=None, enabled: bool | None = None):
        self.names = names
        self._bar = None
        self._started = False
        factory = progress_factory(stream, enabled)
        if factory is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=len(names), file=stream or sys.stderr, leave=False, unit="stage")

    def advance(self, name: str) -> None:
        """The previous stage is done; `name` starts."""
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._started = True
            self._bar.set_description(name)

    def close(self) -> None:
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._bar.close()
            self._bar = None
