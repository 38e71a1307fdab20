"""Long mutation fuzzing of diag's parsers: traces, nccl-tests outputs, NCCL logs.

    python bench/bench_fuzz.py [--inputs 5000] [--seed 1] [--workers 2] [--timeout 20] [--whole-traces]

Seeds are the real files in ../shared/data (or $DIAG_REAL_DATA), the project's fixtures
and the segments of a run directory written as the agent does (read by `diag report` and
`diag compare`); the mutations and the runner are the suite's (tests/fuzz_mutations.py), which
runs a one-minute version of this. Prints the number of inputs, clean results, one-line
errors, tracebacks, hangs, runs past the memory ceiling (tests/fuzz_mutations.py
MEMORY_CEILING) and chart text that keeps markup; every traceback or hang is listed with its seed, mutation
and the kept input file, so it can be reproduced with
`python -m diag analyze FILE` or `python -m diag nccl parse FILE`.
`--whole-traces` also mutates the large traces whole (tens of MB) instead of their first
events: slower, and the case where a chunked decoder could loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import fuzz_mutations as fm  # noqa: E402


def real_data() -> Path | None:
    for p in (os.environ.get("DIAG_REAL_DATA"), REPO.parent / "shared" / "data"):
        if p and Path(p).is_dir():
            return Path(p)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--timeout", type=float, default=fm.TIMEOUT_S, help="seconds before an input counts as a hang")
    ap.add_argument("--whole-traces", action="store_true")
    args = ap.parse_args()

    data = real_data()
    if data is None:
        print("real data not found: set DIAG_REAL_DATA or place shared/data beside the repository", file=sys.stderr)
        return 2
    if args.whole_traces:
        fm.TRACE_EVENTS_KEEP = 10**9
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="diag-fuzz-run-"))
    seeds = (fm.seeds(data, REPO / "tests" / "fixtures") + fm.run_seeds(work) + fm.live_seeds()
             + fm.analysis_seeds(work, REPO / "tests" / "fixtures"))
    kinds = {k: sum(1 for s in seeds if s.kind == k) for k in ("trace", "nccl_tests", "nccl_log", "run", "live",
                                                             "metrics", "analysis")}
    print(f"{len(seeds)} seed files ({', '.join(f'{n} {k}' for k, n in kinds.items())}), "
          f"{args.inputs} mutants, seed {args.seed}, {args.workers} workers, {args.timeout:.0f} s per input")

    t0 = time.monotonic()
    last = [0.0]

    def progress(c):
        now = time.monotonic()
        if now - last[0] >= 2 or c["inputs"] == args.inputs:
            last[0] = now
            done = c["inputs"] / args.inputs
            bar = "#" * int(30 * done)
            print(f"\r[{bar:<30}] {c['inputs']}/{args.inputs}  tracebacks {c['traceback']}  hangs {c['hang']}  "
                  f"over-memory {c['over_memory']}  escaping {c['escaping']}",
                  end="", file=sys.stderr, flush=True)

    result = fm.fuzz(seeds, args.inputs, args.seed, workers=args.workers, timeout_s=args.timeout, progress=progress)
    print(file=sys.stderr)
    wall = time.monotonic() - t0
    print(f"inputs {result['inputs']}  ok {result['ok']}  one-line errors {result['error']}  "
          f"tracebacks {result['traceback']}  hangs {result['hang']}  over-memory {result['over_memory']}  "
          f"escaping {result['escaping']}  ({wall:.0f} s)")
    for f in result["failures"]:
        print(f"\n{f['status'].upper()}: seed {f['seed']} ({f['kind']}), mutation {f['mutation']}, input {f['input']}")
        print("  " + f["detail"].strip().replace("\n", "\n  ")[-1200:])
    out = REPO / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps({k: v for k, v in result.items()}, indent=1))
    return 1 if any(result[k] for k in ("traceback", "hang", "over_memory", "escaping")) else 0


if __name__ == "__main__":
    sys.exit(main())
