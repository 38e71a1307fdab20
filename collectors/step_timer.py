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
from typing import Any


@dataclass(slots=True)
class StepTiming:
    step: int
    start_unix: float
    duration_s: float
    data_wait_s: float | None
    samples: float | None
    tokens: float | None
    collate_s: float | None = None  # of the data wait, collating in this process (num_workers=0)
    cpu_s: float | None = None  # the process's CPU time over the step, all its threads
    data_wait_cpu_s: float | None = None  # of it, during the data wait


class StepTimer:
    """Counts steps and times them; `finish()` closes one step and opens the next."""

    # The process's CPU time (time.process_time) tells whether a data wait is CPU work on the
    # training side or a wait on storage: what DataLoader workers can win depends on it.
    __slots__ = ("step", "_t0", "_cpu0", "_unix_offset", "_wait", "_wait_cpu", "_waited", "_collate")

    def __init__(self, first_step: int = 0):
        self.step = first_step
        self._unix_offset = time.time() - time.perf_counter()
        self.restart()

    def restart(self) -> None:
        """Open the current step now (used when the loop starts later than the agent)."""
        self._open(time.perf_counter(), time.process_time())

    def _open(self, t0: float, cpu0: float) -> None:
        """A step begins at wall time t0 and process CPU time cpu0, with nothing waited yet."""
        self._t0, self._cpu0 = t0, cpu0
        self._wait = 0.0
        self._wait_cpu: float | None = 0.0
        self._waited = False
        self._collate: float | None = None

    def rebase(self) -> None:
        """Start the current step now: the agent's own work between steps (stopping a
        profiler window) is not the training's time."""
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def add_data_wait(self, seconds: float, cpu_seconds: float | None = None) -> None:
        """Add a wait for data; `cpu_seconds` is the process's CPU time during it (None: not
        measured, as where a framework's hook times the wait from outside)."""
        self._wait += seconds
        self._wait_cpu = None if cpu_seconds is None or self._wait_cpu is None else self._wait_cpu + cpu_seconds
        self._waited = True

    def add_collate(self, seconds: float) -> None:
        self._collate = (self._collate or 0.0) + seconds

    def finish(self, samples=None, tokens=None) -> StepTiming:
        now, cpu = time.perf_counter(), time.process_time()
        t = StepTiming(
            step=self.step,
            start_unix=self._t0 + self._unix_offset,
            duration_s=now - self._t0,
            data_wait_s=self._wait if self._waited else None,
            samples=samples,
            tokens=tokens,
            collate_s=self._collate,
            cpu_s=cpu - self._cpu0,
            data_wait_cpu_s=self._wait_cpu if self._waited else None,
        )
        self.step += 1
        self._open(now, cpu)
        return t


PEAK_READ_S = 1.0  # the allocator's statistics are read at most this often


class PeakMemory:
    """The device's peak allocated memory so far, as the caching allocator counts it; read
    on the agent's thread, at most every PEAK_READ_S, and never reset."""

    def __init__(self, device: int | None = None):
        self._device = device
        self._cuda: Any = None  # torch.cuda once usable, False once switched off
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
