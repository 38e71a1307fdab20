"""What the job's DataLoader says about itself: its settings, read once when `agent.loader()`
first wraps it, for the diagnosis to name ("num_workers=0") instead of guessing."""

from __future__ import annotations

import os
import sys


def usable_cpus() -> int | None:
    """The CPUs this process may run on (taskset, cgroups' cpusets), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


# CPU flags of matrix units that run bf16 faster than fp32 (Linux /proc/cpuinfo names).
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_facts(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """What the rank's host offers it: usable CPUs, torch's intra-op threads and the vector
    instructions its CPU kernels use when torch is imported (the diagnosis weighs a slow
    rank's CPU time against them), and whether the CPU has bf16 matrix units (None: unknown,
    as off Linux)."""
    torch = sys.modules.get("torch")
    threads = isa = None
    try:
        threads = int(torch.get_num_threads()) if torch is not None else None
        isa = str(torch.backends.cpu.get_cpu_capability()) if torch is not None else None
    except Exception:  # a torch too broken to answer is no reason to stop the writer
        pass
    return {"cpus": usable_cpus(), "torch_threads": threads, "isa": isa, "bf16_units": _bf16_units(cpuinfo)}


def _bf16_units(cpuinfo: str) -> bool | None:
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(BF16_FLAGS & set(line.split(":", 1)[-1].split()))
    except OSError:
        return None
    return None


def loader_facts(obj) -> dict | None:
    """A torch DataLoader's settings, the dataset's class and the CPUs this process may use;
    None for any other iterable (a generator, a list, a framework's own loader)."""
    torch = sys.modules.get("torch")
    data = getattr(getattr(torch, "utils", None), "data", None)
    loader_class = getattr(data, "DataLoader", None)
    if loader_class is None or not isinstance(obj, loader_class):
        return None
    workers = int(obj.num_workers)
    # A loader built on a batch sampler (accelerate's, a custom one) has batch_size None.
    batch = obj.batch_size if isinstance(obj.batch_size, int) else getattr(obj.batch_sampler, "batch_size", None)
    return {
        "class": type(obj).__name__,
        "dataset": type(obj.dataset).__name__,
        "num_workers": workers,
        "batch_size": batch if isinstance(batch, int) and not isinstance(batch, bool) else None,
        "pin_memory": bool(obj.pin_memory),
        "prefetch_factor": obj.prefetch_factor if workers > 0 else None,
        "persistent_workers": bool(obj.persistent_workers),
        "cpus": usable_cpus(),
    }


class TimedCollate:
    """A DataLoader's collate_fn, timed: with num_workers=0 it runs in the training process,
    inside the data wait, and `on_time` gets each call's seconds. It returns and raises what
    the function does; one failure of `on_time` stops the timing, never the batch; pickled,
    it is the function itself."""

    __slots__ = ("fn", "on_time", "__weakref__")

    def __init__(self, fn, on_time):
        self.fn, self.on_time = fn, on_time

    def __reduce__(self):
        # Sent to worker processes (num_workers raised later, a spawn start method): the
        # job's own function, untimed, so that nothing of the agent has to pickle.
        return _unwrapped, (self.fn,)

    def __call__(self, batch):
        import time

        t0 = time.perf_counter()
        out = self.fn(batch)
        if self.on_time is not None:
            try:
                self.on_time(time.perf_counter() - t0)
            except Exception:
                self.on_time = None
        return out


def _unwrapped(fn):
    return fn


def time_collate(loader, on_time) -> bool:
    """Time a torch DataLoader's collate_fn where it runs in this process (num_workers=0),
    before an iterator is made from it; True when it is timed."""
    torch = sys.modules.get("torch")
    loader_class = getattr(getattr(getattr(torch, "utils", None), "data", None), "DataLoader", None)
    if loader_class is None or not isinstance(loader, loader_class) or loader.num_workers != 0:
        return False
    fn = loader.collate_fn
    if isinstance(fn, TimedCollate) or not callable(fn):
        return isinstance(fn, TimedCollate)
    loader.collate_fn = TimedCollate(fn, on_time)
    return True
