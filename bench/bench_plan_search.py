"""`diag plan --search` for Llama 3 70B on 64 H100s: the issue's command, timed end to end.

    python bench/bench_plan_search.py [--repeat 5]

Runs the command as a user does (a new interpreter each time, start-up included) and
prints the median wall time, the layouts it weighed, and the bound of 2 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMAND = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--device", "h100", "--search"]
BOUND_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    times, doc = [], None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "diag", *COMMAND, "--json"], capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        doc = json.loads(proc.stdout)
    med = statistics.median(times)
    print(f"diag {' '.join(COMMAND)}")
    print(f"  {doc['layouts_considered']} valid layouts, {doc['layouts_fitting']} fit; best: {doc['best'][0]['layout']}")
    print(f"  wall time: median {med:.3f} s of {args.repeat} runs (min {min(times):.3f}, max {max(times):.3f}), "
          f"bound {BOUND_S:.0f} s: {'met' if med < BOUND_S else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
