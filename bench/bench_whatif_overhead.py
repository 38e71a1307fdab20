"""What the what-if (graphs, critical paths, replays of every change) adds to analysing one trace.

    python bench/bench_whatif_overhead.py [--events 2000000] [--repeat 3]

The trace is the HTA benchmark's: a real A100 trace tiled to ~2 million events. Each
repeat analyses it without and with the what-if changes, interleaved; the medians and
the overhead are printed. The issue's bound is +30%.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_analyze_vs_hta as hta_bench  # noqa: E402  (the same tiled trace)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from diag.analyzers.analyze import analyze_trace
    from diag.analyzers.diagnosis import decision_tree as dt

    tmp = Path(tempfile.mkdtemp(prefix="diag-bench-whatif-"))
    try:
        path = tmp / "tiled.json.gz"
        hta_bench.tile_trace(hta_bench.real_trace(), path, args.events)
        full = dt.load_tree()
        bare = dataclasses.replace(full, what_if=())
        without, with_ = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            analyze_trace(path, tree=bare, workers=None)
            without.append(time.perf_counter() - t)
            t = time.perf_counter()
            rank = analyze_trace(path, tree=full, workers=None)
            with_.append(time.perf_counter() - t)
        a, b = statistics.median(without), statistics.median(with_)
        replayed = sum("what_if_ms" in s for s in rank["steps"])
        print(f"{rank['n_events']:,} events, {len(rank['steps'])} steps, {replayed} replayed under "
              f"{len(full.what_if)} changes")
        print(f"analyze without what-if {a:.2f} s, with {b:.2f} s: overhead {b / a - 1:+.1%} (bound +30%)")
        return 0 if b / a - 1 <= 0.30 else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
