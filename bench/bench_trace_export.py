"""What writing a profiler window's trace costs the training thread: a thread against a forked child.

    python bench/bench_trace_export.py [--ops 2000 20000] [--repeats 3]

torch writes a trace (`export_chrome_trace`) in C++ without releasing the GIL. This script
records a window of `--ops` small training-like operations, then writes it while the main
thread keeps running the same operations, and reports for each way of writing it:
- the main thread's speed during the write, against its speed just before;
- its longest pause (one iteration's gap): the stall a training step would see;
- the write's own time, and for the child the fork alone.
diag writes each trace by whichever of the two cost the training thread less the last time
(collectors/profiler_windows.py, ExportRoute); this shows both costs side by side.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def record_window(ops: int):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    prof.start()
    for _ in range(ops):
        (x @ x).relu().sum()
    prof.stop()
    return prof


def main_thread_during(write, x) -> tuple[float, float, float, float | None]:
    """(iterations per second, longest gap, write seconds, fork seconds or None) while `write()` runs
    in a thread."""
    done = threading.Event()
    spent: dict = {}

    def run():
        t = time.perf_counter()
        try:
            times = write()
            spent["fork_s"], spent["child_write_s"] = times if times else (None, None)
        finally:
            spent["s"] = time.perf_counter() - t
            done.set()

    th = threading.Thread(target=run)
    t0 = last = time.perf_counter()
    th.start()
    n, gap = 0, 0.0
    while not done.is_set():
        (x @ x).relu().sum()
        n += 1
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    return n / (time.perf_counter() - t0), gap, spent.get("child_write_s") or spent["s"], spent.get("fork_s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, nargs="+", default=[2000, 20000], help="operations recorded per window")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import torch

    from diag.collectors.trace_export import write_in_child

    torch.set_num_threads(1)
    x = torch.randn(64, 64)
    print(f"{'ops':>7} {'trace MB':>9} {'writer':>7} {'speed during':>13} {'longest pause':>14} "
          f"{'write s':>8} {'fork ms':>8}")
    with tempfile.TemporaryDirectory(prefix="diag-export-") as tmp:
        for ops in a.ops:
            rows: dict[str, list] = {"thread": [], "child": []}
            size = 0
            for r in range(a.repeats):
                for writer in ("thread", "child"):
                    prof = record_window(ops)  # a trace can be written once: a fresh window each time
                    path = Path(tmp) / f"{writer}-{ops}-{r}.json"
                    t, n = time.perf_counter(), 0
                    while time.perf_counter() - t < 0.5:
                        (x @ x).relu().sum()
                        n += 1
                    base = n / (time.perf_counter() - t)
                    if writer == "thread":
                        write = functools.partial(prof.export_chrome_trace, str(path))
                    else:
                        write = functools.partial(write_in_child, prof, path)
                    speed, gap, write_s, fork_s = main_thread_during(write, x)
                    size = os.path.getsize(path)
                    rows[writer].append((speed / base, gap, write_s, fork_s))
                    path.unlink()
            for writer, got in rows.items():
                ratio = statistics.median(g[0] for g in got)
                gap = statistics.median(g[1] for g in got)
                write_s = statistics.median(g[2] for g in got)
                fork = f"{1000 * statistics.median(g[3] for g in got):8.1f}" if writer == "child" else f"{'-':>8}"
                print(f"{ops:>7} {size / 1e6:>9.1f} {writer:>7} {100 * ratio:>12.1f}% {1000 * gap:>11.1f} ms "
                      f"{write_s:>8.2f} {fork}", flush=True)
    print(f"(medians of {a.repeats}; speed during: the main thread's iterations per second while the trace is "
          f"written, against its speed just before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
