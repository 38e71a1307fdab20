"""Overhead of the sampling thread: CPU share of one core at 1 Hz, and memory that does not grow.

    python bench/bench_sampler.py [--seconds 20] [--fast-samples 400]

Three configurations, all with the real collectors:
- host: psutil only (this machine has no GPU);
- host + DataLoader: two live torch DataLoader workers being watched;
- host + NVML: the real pynvml wrappers over the test suite's fake C library, so the
  figure covers our Python and pynvml's, not the driver's own time (on a real GPU
  the NVML calls add their driver time; nvmlDeviceGetPcieThroughput sleeps 20 ms in
  the driver, which is wall time on our thread, not CPU).

For each: (1) a real 1 Hz run for --seconds, CPU time of the sampling thread measured
in the thread with time.thread_time(), as a share of one core; (2) the CPU cost of one
sample from --fast-samples samples at 50 Hz, which at 1 Hz is the same share; (3)
Python allocations made by the sampler's code and the libraries it calls that are still
held after the fast run, versus after its first tenth (growth means a leak). Budget (issue 3): <= 1% of one core at 1 Hz.

No competitor runs here: dcgm-exporter and nvidia-smi need an NVIDIA driver.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = 0.01  # of one core at 1 Hz


@contextlib.contextmanager
def fake_nvml():
    """Install the fake libnvidia-ml under the real pynvml (as the tests do)."""
    import pynvml

    sys.path.insert(0, str(REPO / "tests"))
    from fake_gpu_libs import FakeNvidiaGpu, FakeNvml

    fake = FakeNvml([FakeNvidiaGpu(uuid=f"GPU-{i}0000000-0000-0000-0000-000000000000") for i in range(8)])
    saved = pynvml.nvmlLib, pynvml._nvmlGetFunctionPointer
    pynvml.nvmlLib, pynvml._nvmlGetFunctionPointer = fake, fake.function
    try:
        yield
    finally:
        pynvml.nvmlLib, pynvml._nvmlGetFunctionPointer = saved


@contextlib.contextmanager
def dataloader():
    import torch.utils.data as tud

    class Slow(tud.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            time.sleep(0.01)
            return i

    it = iter(tud.DataLoader(Slow(), batch_size=1, num_workers=2))
    next(it)
    try:
        yield
    finally:
        del it


def _fast_run(device_index, n: int, logs: list, trace: bool) -> tuple[float, float | None]:
    """(CPU seconds per sample, growth of held allocations in bytes or None) over n samples at 50 Hz."""
    from diag.collectors.sampler import Sampler

    gc.collect()
    if trace:
        tracemalloc.start()
    s = Sampler(device_index, interval_s=0.02, log=logs.append)
    s.start()
    s.info()
    held = []
    tenth = max(n // 10, 1)
    while s.samples_taken < n:
        time.sleep(0.05)
        if trace and not held and s.samples_taken >= tenth:
            gc.collect()
            held.append(_ours(tracemalloc.take_snapshot()))
    if trace:
        gc.collect()
        held.append(_ours(tracemalloc.take_snapshot()))
    taken = s.samples_taken
    s.stop()
    if trace:
        tracemalloc.stop()
    return s.thread_cpu_s / max(taken, 1), (held[-1] - held[0]) if trace else None


def _ours(snapshot) -> int:
    """Bytes held by allocations made in the sampler's code and the libraries it calls
    (the rest of the process, a DataLoader's threads for instance, is not ours)."""
    keep = [tracemalloc.Filter(True, f"*{part}*") for part in ("collectors", "psutil", "pynvml", "amdsmi")]
    return sum(stat.size for stat in snapshot.filter_traces(keep).statistics("filename"))


def run(label: str, seconds: float, fast_samples: int, device_index) -> dict:
    from diag.collectors.sampler import Sampler

    logs: list[str] = []
    # (1) the real thing: 1 Hz for `seconds`; CPU of the thread after opening, per second.
    s = Sampler(device_index, interval_s=1.0, log=logs.append)
    s.start()
    info = s.info()
    time.sleep(seconds)
    s.stop()
    # (2) cost per sample, without tracing; (3) allocation growth, with tracing.
    per_sample, _ = _fast_run(device_index, fast_samples, logs, trace=False)
    _, growth = _fast_run(device_index, max(fast_samples // 2, 50), logs, trace=True)
    return {
        "label": label,
        "vendor": info.get("vendor"),
        "samples_1hz": s.samples_taken,
        "share_1hz": s.thread_cpu_s / max(seconds, 1e-9),
        "open_cpu_ms": s.open_cpu_s * 1e3,
        "per_sample_ms": per_sample * 1e3,
        "held_growth_kib": growth / 1024,
        "logs": logs,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each real 1 Hz run")
    ap.add_argument("--fast-samples", type=int, default=400, help="samples in the 50 Hz cost run")
    args = ap.parse_args(argv)

    results = [run("host only (no GPU here)", args.seconds, args.fast_samples, 0)]
    with dataloader():
        results.append(run("host + 2 DataLoader workers", args.seconds, args.fast_samples, 0))
    with fake_nvml():
        results.append(run("host + NVML (real pynvml, fake C lib)", args.seconds, args.fast_samples, 0))

    print(f"{'configuration':42s} {'vendor':>7s} {'1Hz n':>6s} {'1Hz core %':>10s} "
          f"{'ms/sample':>10s} {'open ms':>8s} {'held growth':>12s}")
    worst = 0.0
    for r in results:
        worst = max(worst, r["share_1hz"], r["per_sample_ms"] / 1e3)
        print(f"{r['label']:42s} {str(r['vendor']):>7s} {r['samples_1hz']:6d} {100 * r['share_1hz']:9.3f}% "
              f"{r['per_sample_ms']:10.3f} {r['open_cpu_ms']:8.1f} {r['held_growth_kib']:9.1f} KiB")
    # Finding DataLoader workers: psutil's children() reads /proc/<pid>/stat of every process
    # on the node; child_pids() reads this process's /proc/<pid>/task/<tid>/children files.
    import os

    import psutil

    from diag.collectors.host_metrics import child_pids

    for name, fn in (("psutil.Process().children()", lambda: psutil.Process().children()),
                     ("host_metrics.child_pids()", lambda: child_pids(os.getpid()))):
        t = time.thread_time()
        for _ in range(100):
            fn()
        print(f"worker discovery via {name:30s} {(time.thread_time() - t) * 10:7.3f} ms CPU per call "
              f"({len(psutil.pids())} processes on this node)")
    print(f"worst share of one core at 1 Hz: {100 * worst:.3f}% (budget {100 * BUDGET:.0f}%): "
          f"{'OK' if worst <= BUDGET else 'OVER BUDGET'}")
    return 0 if worst <= BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
