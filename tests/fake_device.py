"""A device timeline, behind the methods of torch.cuda.Event that diag's device clock calls,
for tests on machines without a GPU: in real time, or in a VirtualClock's time, where every
wait lasts exactly as long as asked, however busy the machine.

Work launched on the device runs in stream order after the work before it; an event
completes when the device reaches it (at once when it is idle). Like the real class, an
event refuses `elapsed_time` unless both events were recorded and have completed, and it
has no other public methods than the real one's that the clock uses.
"""

from __future__ import annotations

import threading
import time


class VirtualClock:
    """Time that moves only when someone sleeps: the host's waits and the device's work last
    exactly their nominal length."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class FakeDevice:
    """One stream: `launch(seconds)` queues work; `queue_limit_s` bounds the queued work as
    a full launch queue does (the host blocks in the launch). `sleep` waits in the clock's time."""

    def __init__(self, queue_limit_s: float | None = None, clock=time.perf_counter):
        self.clock = clock
        self.sleep = getattr(clock, "sleep", time.sleep)
        self.free_at = clock()  # when the queued work ends
        self.queue_limit_s = queue_limit_s
        self.busy_s = 0.0
        self._lock = threading.Lock()

    def launch(self, seconds: float) -> None:
        if self.queue_limit_s is not None:
            backlog = self.free_at - self.clock()
            if backlog > self.queue_limit_s:
                self.sleep(backlog - self.queue_limit_s)
        with self._lock:
            self.free_at = max(self.free_at, self.clock()) + seconds
            self.busy_s += seconds

    def synchronize(self) -> None:
        wait = self.free_at - self.clock()
        if wait > 0:
            self.sleep(wait)

    def event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing)


class FakeEvent:
    def __init__(self, device: FakeDevice, enable_timing: bool = False):
        self._device = device
        self._timing = enable_timing
        self._at: float | None = None  # when the device reaches it

    def record(self, stream=None) -> None:
        d = self._device
        with d._lock:
            self._at = max(d.free_at, d.clock())

    def query(self) -> bool:
        return self._at is None or self._at <= self._device.clock()  # an unrecorded event is complete

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if not (self._timing and end_event._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._at is None or end_event._at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (end_event._at - self._at) * 1e3
