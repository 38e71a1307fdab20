"""The GPU fix bank: each GPU trace case under diag.Agent, diag's predicted step for the action
it names, against that action applied (the case's fixed variant).

    python bench/gpu_fix_bank.py [--case NAME ...] [--repeat 2] [--steps 40] [--json FILE]

Run it on a node with a CUDA or ROCm GPU; without one it prints one line and exits 0. The cases
are bench/gpu_trace_cases.py's, those with a fixed variant. For each, `--repeat` times:
1. the slow loop runs `--steps` steps under diag.Agent (profiler windows of 3 steps, device step
   time, samples), in a process of its own; diag analyses the run directory and names the cause,
   its action and the step it expects, with the range the fixed step should fall in;
2. the action diag worded must be the one the fixed variant applies (bf16 autocast, pinned
   copies, the values kept on the device, ...): a case whose action is another is a failed row,
   never a silent comparison of two different changes;
3. at once, in a fresh process outside any profiler, the slow and the fixed variant run in turns
   (ROUNDS each, the median of each kept): a step of a few milliseconds moves by tens of percent
   from one process to the next (1.0 to 1.7 ms for the same fixed loop on one H200), so the
   prediction is taken at that process's pace, scaled by its bare slow step over the diagnosed
   run's, and compared with the fixed step beside it.

A run directory carries the job's unprofiled step times, so the prediction starts from the step
the user sees; a bare trace's profiled steps can be slower (the profiler's per-op cost), which is
why bench/gpu_trace_cases.py's trace-only figures are scaled by the measured ratio instead.

Prints one row per case (slow step, range, expected, measured, error, in range) and then the
median and P90 of |error| and the share in range, as bench/fix_bank.py does for the CPU cases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fix_bank import _p90  # the CPU fix bank's, beside this file

# Each case's cause and the start of the action that its fixed variant applies.
EXPECTED = {
    "cpu_ops_on_thread": ("cpu_work_on_training_thread", "the work moved"),
    "empty_cache": ("allocator_calls", "no allocation in the driver"),
    "item_sync": ("host_sync_points", "the values kept on the device"),
    "pageable_copy": ("pageable_copies", "pinned memory"),
    "matmul_fp32_odd": ("fp32_math", "bf16 autocast"),
}

ROUNDS = 3  # turns of the slow and the fixed variant in the measuring process
CHILD = """
import json, sys, time
sys.path.insert(0, {bench!r})
import torch, diag
import gpu_trace_cases as g
case, mode, run_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ROUNDS = {rounds}
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
if mode == "pair":
    # The slow and the fixed variant in turns, in one process: a step of a few milliseconds
    # moves by tens of percent from one process to the next (clocks, placement), not within one.
    slow, fixed = g.CASES[case](), g.CASES[case](fixed=True)
    times = {{"slow": [], "fixed": []}}
    for _ in range(ROUNDS):
        times["slow"].append(g._wall_ms(slow, n=steps))
        times["fixed"].append(g._wall_ms(fixed, n=steps))
    print(json.dumps({{k + "_ms": sorted(v)[len(v) // 2] for k, v in times.items()}}))
    sys.exit(0)
step = g.CASES[case]()
with diag.Agent(run_dir=run_dir, export=False, analyse_during_run=False, report=False, verbose=False,
                skip_first=6, warmup=1, active=3, every=12) as agent:
    for _ in range(steps):
        step()
        agent.step()
torch.cuda.synchronize()
print(json.dumps({{"run_dir": run_dir}}))
"""


def _child(script: Path, *args: str, timeout: float = 300) -> dict:
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200])
    return json.loads(p.stdout.strip().splitlines()[-1])


def diagnose(script: Path, case: str, steps: int, run_dir: Path) -> dict:
    """The slow loop under the agent, analysed: the case's cause, with diag's action and prediction."""
    from diag.analyzers.analyze import analyze_run_dir

    _child(script, case, "slow", str(run_dir), str(steps))
    doc = analyze_run_dir(run_dir)
    cause_id, _ = EXPECTED[case]
    cause = next((c for c in doc.diagnosis.causes if c["id"] == cause_id), None)
    if cause is None:
        named = ", ".join(c["id"] for c in doc.diagnosis.causes) or "none"
        raise RuntimeError(f"diag named no {cause_id} cause (causes: {named}; bound {doc.diagnosis.bound})")
    return cause


def run_pair(script: Path, case: str, steps: int, scratch: Path) -> dict:
    cause = diagnose(script, case, steps, scratch)
    e = cause.get("expected") or {}
    action = str(e.get("action") or "")
    if not action.startswith(EXPECTED[case][1]):
        raise RuntimeError(f"diag's action is {action or 'none'!r}, not what the fixed variant applies "
                           f"({EXPECTED[case][1]!r}...)")
    pair = _child(script, case, "pair", "-", str(steps))
    measured = pair["fixed_ms"]
    # The prediction at the pace of the process that measured the fix: its slow variant, bare,
    # against the slow step the diagnosed run measured under the agent.
    pace = pair["slow_ms"] / e["baseline_step_ms"]
    expected, low, high = (e["expected_step_ms"] * pace, e["low_ms"] * pace, e["high_ms"] * pace)
    return {"case": case, "cause": cause["id"], "action": action, "slow_ms": e["baseline_step_ms"],
            "bare_slow_ms": pair["slow_ms"], "pace": pace, "low_ms": low, "high_ms": high,
            "expected_ms": expected, "ceiling_ms": e.get("ceiling_step_ms"), "measured_ms": measured,
            "error": (expected - measured) / measured, "in_range": low <= measured <= high}


def _print_row(r: dict) -> None:
    if "failed" in r:
        print(f"{r['case']:18s} FAILED: {r['failed']}", flush=True)
        return
    print(f"{r['case']:18s} {r['cause']:28s} {r['action'][:32]:32s} slow {r['slow_ms']:7.2f} "
          f"(bare {r['bare_slow_ms']:7.2f})  range "
          f"{r['low_ms']:6.2f}-{r['high_ms']:6.2f}  expected {r['expected_ms']:6.2f}  measured {r['measured_ms']:6.2f}"
          f"  error {r['error']:+6.1%}  {'in range' if r['in_range'] else 'OUT of range'}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(EXPECTED))
    ap.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    ap.add_argument("--repeat", type=int, default=2, help="diagnosed slow runs, each followed by its fix (default 2)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories here")
    args = ap.parse_args(argv)
    try:
        import torch

        gpu = torch.cuda.is_available()
    except Exception:
        gpu = False
    if not gpu:
        print("gpu_fix_bank: no CUDA or ROCm device visible to torch; nothing to measure on this machine")
        return 0
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="diag-gpu-fix-bank-"))
    scratch.mkdir(parents=True, exist_ok=True)
    script = scratch / "case.py"
    script.write_text(CHILD.format(bench=str(Path(__file__).resolve().parent), rounds=ROUNDS))
    rows = []
    # Every case once before any twice: a run cut short by its time limit still covers each case.
    for i in range(args.repeat):
        for case in args.case or sorted(EXPECTED):
            try:
                rows.append(run_pair(script, case, args.steps, scratch / f"{case}-{i}"))
            except (RuntimeError, KeyError, ValueError, subprocess.TimeoutExpired) as exc:
                rows.append({"case": case, "failed": str(exc)[:300]})
            _print_row(rows[-1])
            if args.json:
                Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                       "torch": torch.__version__, "rows": rows}, indent=1))
    graded = [r for r in rows if "failed" not in r]
    if graded:
        errors = [abs(r["error"]) for r in graded]
        print(f"over {len(graded)} pairs: median |error| {statistics.median(errors):.1%}, "
              f"P90 {_p90(errors):.1%}, in range {sum(r['in_range'] for r in graded) / len(graded):.0%}")
    return 0 if len(graded) == len(rows) else 1


if __name__ == "__main__":
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        print("gpu_fix_bank: CUDA_VISIBLE_DEVICES is empty; nothing to measure on this machine")
        sys.exit(0)
    sys.exit(main())
