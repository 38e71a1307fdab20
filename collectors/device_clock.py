"""Device step time and the device's idle time within data waits, without a synchronisation.

The training thread records a timing event on the current stream at every step boundary
and around every wait for the next batch (CUDA, or HIP through the same torch API); a
background thread later asks which events have completed and reads their device times.
Nothing waits for the device.

Why the events around a data wait measure the device's idle time in it: no work is queued
between them. The first completes when the device has drained the work queued before the
wait (at once when it was already idle); the second as soon as the host records it, the
device having nothing else to do. So the time between them is the part of the wait in
which the device had no work, which is what the trace path calls data: the host waited
for the next batch while the device was idle. A data wait hidden behind queued device
work costs nothing, and the sampled verdicts no longer call such a job data-bound.

One clock per process, for the stream current at each boundary (the training stream).
Work on other streams (NCCL's) is not seen: the idle time is the training stream's.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

MAX_PENDING = 256  # steps whose events have not completed; beyond it new steps are not measured


@dataclass(frozen=True, slots=True)
class DeviceStep:
    step: int
    device_s: float | None  # device time between the step's boundary events (None: no start event)
    data_idle_s: float  # device idle time within the step's data waits


class DeviceClock:
    """Timing events at step boundaries and around data waits; `completed()` reads them.

    `new_event` makes a timing event with the real API's methods (`record()`, `query()`,
    `elapsed_time(end)` in ms); `capturing()` says whether the current stream is being
    captured into a CUDA graph, where an event record would become part of the graph.
    `for_torch()` gives the clock of the process's CUDA or HIP device, or None.
    """

    def __init__(self, new_event, capturing=lambda: False, log=None, reader_setup=lambda: None):
        self._new_event = new_event
        self._capturing = capturing
        # Run once on the thread that reads the events: a CUDA call on a thread whose current
        # device is another one would create a context there (GPU 0 by default).
        self._reader_setup = reader_setup
        self._reader: int | None = None
        self._log = log or (lambda msg: None)
        self._free: list = []
        self._start = None  # the event that opened the current step
        self._waits: list = []  # (begin, end) events of the current step's data waits
        self._begin = None
        self._pending: deque = deque()  # (step, start event or None, end event, waits)
        self.dropped = 0  # steps not measured because too many were pending
        self.off: str | None = None

    @classmethod
    def for_torch(cls, log=None) -> DeviceClock | None:
        """The clock of torch's CUDA (or ROCm) device, once torch has initialised it (the
        clock never creates a device context); None when there is none yet."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        try:
            if cuda is None or not cuda.is_initialized():
                return None
            capturing = getattr(cuda, "is_current_stream_capturing", lambda: False)
            device = cuda.current_device()
            return cls(lambda: cuda.Event(enable_timing=True), capturing, log, lambda: cuda.set_device(device))
        except Exception:
            return None

    # -- the training thread: a few microseconds each ------------------------------------

    def _record(self):
        ev = self._free.pop() if self._free else self._new_event()
        ev.record()
        return ev

    def data_begin(self) -> None:
        if self.off is None:
            self._guard(self._data_begin)

    def _data_begin(self) -> None:
        self._begin = None if self._capturing() else self._record()

    def data_end(self) -> None:
        if self.off is None and self._begin is not None:
            self._guard(self._data_end)

    def _data_end(self) -> None:
        self._waits.append((self._begin, self._record()))
        self._begin = None

    def step_end(self, step: int) -> None:
        if self.off is None:
            self._guard(self._step_end, step)

    def _step_end(self, step: int) -> None:
        if self._capturing():
            self._waits, self._start = [], None
            return
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            self._free += [e for pair in self._waits for e in pair]
            self._waits, self._start = [], None
            return
        end = self._record()
        self._pending.append((step, self._start, end, self._waits))
        self._start, self._waits = end, []

    def rebase(self) -> None:
        """Start the next step's device time now: the host spent the time since the last
        boundary on diag's own work (a profiler window stopping, which also drains the queue),
        as the host step timer leaves it out too."""
        if self.off is None:
            self._guard(self._rebase)

    def _rebase(self) -> None:
        # The previous start stays the previous step's end (pending); it just leaves the pool.
        self._start = None if self._capturing() else self._record()

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # never the training's problem: off for the rest of the run
            self._switch_off(exc)

    def _switch_off(self, exc: Exception) -> None:
        self.off = f"{type(exc).__name__}: {exc}"
        self._log(f"agent: device step timing switched off ({self.off})")

    # -- the background thread -------------------------------------------------------------

    def awaits(self, step: int) -> bool:
        """Whether the step's events are recorded and not yet read."""
        pending = self._pending
        try:
            return self.off is None and pending[0][0] <= step <= pending[-1][0]
        except IndexError:
            return False

    def _as_reader(self) -> None:
        if self._reader != threading.get_ident():
            self._reader_setup()
            self._reader = threading.get_ident()

    def settle(self, timeout_s: float) -> None:
        """Wait (polling, never synchronising) up to timeout_s for the recorded events to
        complete: at the end of the run, so its last steps keep their device times."""
        deadline = time.monotonic() + timeout_s
        try:
            self._as_reader()
            while self.off is None and self._pending and not self._pending[-1][2].query():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
        except Exception:
            return

    def completed(self) -> list[DeviceStep]:
        """The steps whose events have all completed, in order; each is returned once."""
        out: list[DeviceStep] = []
        pending = self._pending
        try:
            self._as_reader()
            while pending:
                step, start, end, waits = pending[0]
                if not end.query():  # in stream order: the waits and the start are done too
                    break
                pending.popleft()
                device_s = start.elapsed_time(end) / 1e3 if start is not None else None
                idle = sum(b.elapsed_time(e) for b, e in waits) / 1e3
                out.append(DeviceStep(step, device_s, max(idle, 0.0)))
                # The start was the previous step's end: free now; this step's end opens the next.
                self._free += [x for pair in waits for x in pair] + ([start] if start is not None else [])
        except Exception as exc:
            self._switch_off(exc)
        return out


HOLD_S = 5.0  # longest a step record waits for its device numbers


class HeldSteps:
    """Step records held back until the clock has read their device times (at most HOLD_S:
    a device far behind, or a hung one, delays the records no longer than that)."""

    def __init__(self):
        self._items: deque = deque()  # (step, item, monotonic time it arrived)
        self._device: dict[int, DeviceStep] = {}

    def add(self, step: int, item, now: float) -> None:
        self._items.append((step, item, now))

    def ready(self, clock: DeviceClock | None, now: float, final: bool = False) -> list[tuple]:
        """(item, DeviceStep or None) of the records that need wait no longer, in order."""
        if clock is not None:
            self._device.update((d.step, d) for d in clock.completed())
        out = []
        items = self._items
        while items:
            step, item, since = items[0]
            dev = self._device.pop(step, None)
            if dev is None and not final and clock is not None and clock.awaits(step) and now - since < HOLD_S:
                break
            items.popleft()
            out.append((item, dev))
        if len(self._device) > MAX_PENDING:  # device times of steps whose records went without them
            for step in sorted(self._device)[: len(self._device) - MAX_PENDING]:
                del self._device[step]
        return out
