"""Always-on step timing: a monotonic clock and the data wait; and the device's peak memory.

Nothing here synchronises the device. The step time is host wall time between two
`agent.step()` calls; with asynchronous CUDA execution the host runs ahead by at most
the launch queue, and over many steps host time equals device time (the device's own
step time is collectors/device_clock.py's). Peak memory comes from the caching
allocator's counters (`max_memory_allocated`), host-side bookkeeping that does not
synchronise, read on the agent's thread and never reset: the peak is the process's, the
one the user's own code, the HF Trainer's memory tracker and Lightning's
DeviceStatsMonitor read too. It is read only when CUDA is already initialised, so a CPU
job never creates a CUDA context.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass(slots=True)
class StepTiming:
    step: int
    start_unix: float
    duration_s: float
    data_wait_s: float | None
    samples: float | None
    tokens: float | None
    collate_s: float | None = None  # of the data wait, collating in this process (num_workers=0)


class StepTimer:
    """Counts steps and times them; `finish()` closes one step and opens the next."""

    __slots__ = ("step", "_t0", "_unix_offset", "_wait", "_waited", "_collate")

    def __init__(self, first_step: int = 0):
        self.step = first_step
        self._unix_offset = time.time() - time.perf_counter()
        self._t0 = time.perf_counter()
        self._wait = 0.0
        self._waited = False
        self._collate: float | None = None

    def restart(self) -> None:
        """Open the current step now (used when the loop starts later than the agent)."""
        self._t0 = time.perf_counter()
        self._wait = 0.0
        self._waited = False
        self._collate = None

    def rebase(self) -> None:
        """Start the current step now: the agent's own work between steps (stopping a
        profiler window) is not the training's time."""
        self._t0 = time.perf_counter()

    def add_data_wait(self, seconds: float) -> None:
        self._wait += seconds
        self._waited = True

    def add_collate(self, seconds: float) -> None:
        self._collate = (self._collate or 0.0) + seconds

    def finish(self, samples=None, tokens=None) -> StepTiming:
        now = time.perf_counter()
        t = StepTiming(
            step=self.step,
            start_unix=self._t0 + self._unix_offset,
            duration_s=now - self._t0,
            data_wait_s=self._wait if self._waited else None,
            samples=samples,
            tokens=tokens,
            collate_s=self._collate,
        )
        self.step += 1
        self._t0 = now
        self._wait = 0.0
        self._waited = False
        self._collate = None
        return t


PEAK_READ_S = 1.0  # the allocator's statistics are read at most this often


class PeakMemory:
    """The device's peak allocated memory so far, as the caching allocator counts it; read
    on the agent's thread, at most every PEAK_READ_S, and never reset."""

    def __init__(self, device: int | None = None):
        self._device = device
        self._cuda = None
        self._read_at = float("-inf")
        self._value: int | None = None

    def _cuda_module(self):
        if self._cuda is None:
            torch = sys.modules.get("torch")
            cuda = getattr(torch, "cuda", None) if torch is not None else None
            try:
                ok = cuda is not None and cuda.is_available()
            except Exception:
                ok = False
            self._cuda = cuda if ok else False
        return self._cuda or None

    def read(self, now: float) -> int | None:
        if now - self._read_at < PEAK_READ_S:
            return self._value
        self._read_at = now
        cuda = self._cuda_module()
        if cuda is None:
            return None
        try:
            if not cuda.is_initialized():
                return None
            dev = self._device if self._device is not None else cuda.current_device()
            peak = int(cuda.max_memory_allocated(dev))
        except Exception:
            self._cuda = False  # switched off for the rest of the run
            return None
        # 0: an allocator that keeps no such count (cudaMallocAsync), not an empty device.
        self._value = peak if peak > 0 else None
        return self._value
