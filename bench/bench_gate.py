"""`diag compare --gate` on real demo runs, several rounds in a row, on this machine.

    python bench/bench_gate.py [--rounds 5] [--steps 32] [--max-slowdown 5%] [--slow-down 0.25]

Each round runs four 2-rank CPU demos under the agent: a baseline, a rerun of the same code,
one whose steps idle `--slow-down` of their own work after it (an induced regression), and a
one-rank run. It gates the rerun (expected: pass, exit 0), the slow run (regression, exit 1)
and the one-rank run (not comparable, exit 2) against the baseline, and prints one row per
round with each gate's exit status and the step-time change with its noise band, then the
count of false results. Exits 1 if any gate gave a false result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

EXPECTED = {"rerun": 0, "slow": 1, "one rank": 2}


def _demo(run_dir: Path, steps: int, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "diag", "demo", "--no-export", "--steps", str(steps), "--run-dir",
                    str(run_dir), *extra], check=True, capture_output=True, timeout=600)


def _gate(before: Path, after: Path, limit: str, out: Path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "diag", "compare", str(before), str(after), "--gate",
                        "--max-slowdown", limit, "--out", str(out)], capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads((out / "gate.json").read_text()) if (out / "gate.json").is_file() else {}


def _step(result: dict) -> str:
    step = next((f for f in result.get("figures") or [] if f["name"] == "step time"), None)
    return f"{step['change']:+.1%} [{step['band'][0]:+.1%}, {step['band'][1]:+.1%}]" if step else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-slowdown", default="5%")
    ap.add_argument("--slow-down", default="0.25")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="diag-bench-gate-"))
    print(f"{'round':>5}  {'rerun':>5} {'step time (band)':<26} {'slow':>4} {'step time (band)':<26} "
          f"{'one rank':>8}  slow fails on", flush=True)
    false = 0
    for r in range(1, args.rounds + 1):
        d = root / f"round{r}"
        _demo(d / "base", args.steps)
        _demo(d / "rerun", args.steps)
        _demo(d / "slow", args.steps, "--slow-down", args.slow_down)
        _demo(d / "one", args.steps, "--ranks", "1")
        got = {name: _gate(d / "base", d / run, args.max_slowdown, d / f"cmp-{run}")
               for name, run in (("rerun", "rerun"), ("slow", "slow"), ("one rank", "one"))}
        false += sum(got[k][0] != v for k, v in EXPECTED.items())
        fails_on = ", ".join(f["name"] for f in got["slow"][1].get("figures") or [] if f["worse"]) or "-"
        print(f"{r:>5}  {got['rerun'][0]:>5} {_step(got['rerun'][1]):<26} {got['slow'][0]:>4} "
              f"{_step(got['slow'][1]):<26} {got['one rank'][0]:>8}  {fails_on}", flush=True)
    print(f"\nexpected exit statuses: rerun 0, slow 1, one rank 2; false results: {false} of {3 * args.rounds} "
          f"(limit {args.max_slowdown}, slow-down {args.slow_down}, {args.steps} steps a run; runs in {root})")
    return 1 if false else 0


if __name__ == "__main__":
    sys.exit(main())
