"""What the measuring ranks share around the collectives: the process group's barrier, sync and
small reductions (`Comm`), the timer (CUDA events on GPUs, the wall clock on CPUs), the
watchdog that ends a rank making no progress, and the test-suite's fault injection.
"""

from __future__ import annotations

import os
import re
import threading
import time

FAULT_ENV = "DIAG_NCCL_TEST_FAULT"

class Watchdog:
    """Ends this process when the main thread makes no progress for `limit` seconds.

    The backend's own timeout normally fires first (gloo raises after `timeout`); this
    is the last line of defence, for hangs that no backend timeout covers.
    """

    def __init__(self, limit: float, on_expire):
        self.limit = limit
        self.on_expire = on_expire
        self.last = time.monotonic()
        self.what = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="diag-nccl-watchdog", daemon=True)
        self._thread.start()

    def kick(self, what: str | None = None) -> None:
        self.last = time.monotonic()
        if what is not None:
            self.what = what

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            if time.monotonic() - self.last > self.limit:
                try:
                    self.on_expire(f"no progress for {self.limit:.0f} s during {self.what}: a peer is dead or hung")
                finally:
                    os._exit(3)

    def stop(self) -> None:
        self._stop.set()


def watchdog_limit(timeout: float) -> float:
    return max(2.0 * timeout, timeout + 5.0)


def fault(rank: int) -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    m = re.fullmatch(r"(exit|hang):(\d+):(\d+)", spec.strip())
    if not m or int(m.group(2)) != rank:
        return None
    return m.group(1), int(m.group(3))


# ---------------------------------------------------------------- communication


class Timer:
    """Wall clock after a barrier on CPUs; CUDA events on the current stream on GPUs."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.cuda = comm.device.type == "cuda"
        if self.cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = 0.0

    @property
    def kind(self) -> str:
        return "cuda_event" if self.cuda else "wall_clock"

    def start(self) -> None:
        self.comm.barrier()
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return time.perf_counter() - self._t0


class Comm:
    def __init__(self, backend: str, device, group=None):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.backend = backend
        self.device = device
        self.group = group  # the benchmark's own group, created with the user's --timeout
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def barrier(self) -> None:
        if self.device.type == "cuda":
            self.dist.barrier(group=self.group, device_ids=[self.device.index])
            self.torch.cuda.synchronize(self.device)
        else:
            self.dist.barrier(group=self.group)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def gather_floats(self, value: float) -> list[float]:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        out = self.torch.zeros(self.world, dtype=self.torch.float64, device=self.device)
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        gather(out, t, group=self.group)
        return out.tolist()

    def sum_int(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return int(t.item())
