"""Grade diag's predictions on recorded GPU trace cases against their measured fixes.

    python bench/grade_trace_cases.py DIR [DIR ...]

Each DIR is what bench/gpu_trace_cases.py wrote (DIR/cases.json and one trace per case), such
as tests/fixtures/real/h200. Runs anywhere: it only analyses the traces. For each case with a
fixed variant it prints the cause diag names, its action, the traced step, the step expected
with the action and its range, and the fixed step measured outside the profiler, carried into
the trace's units (the traced step times the measured fixed-over-slow ratio), with the error.

The carried figure assumes the profiler slows the slow and the fixed loop alike; where the
fixed loop is mostly host work the profiler dilates (cpu_ops_on_thread), it understates the
fixed step in traced units. Where DIR also holds the fixed loop's own trace
(<case>.fixed.json.gz, recorded by gpu_trace_cases.py since it traces both), the row also
grades the prediction against that trace's median step: like units, no carrying.
bench/gpu_fix_bank.py measures on a GPU without either assumption.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

from gpu_fix_bank import EXPECTED  # each case's cause and action, beside this file

CAUSES = {case: cause for case, (cause, _) in EXPECTED.items()}


def grade(folder: Path) -> list[dict]:
    from diag.analyzers.analyze import analyze_paths

    cases = {c["case"]: c for c in json.loads((folder / "cases.json").read_text())["cases"] if "case" in c}
    rows = []
    for case, cause_id in CAUSES.items():
        c = cases.get(case)
        if not c or not c.get("fixed_wall_step_ms") or not (folder / f"{case}.json.gz").exists():
            continue
        doc = analyze_paths([str(folder / f"{case}.json.gz")], jobs=1)
        cause = next((x for x in doc.diagnosis.causes if x["id"] == cause_id), None)
        e = (cause or {}).get("expected")
        if not e:
            rows.append({"folder": str(folder), "case": case, "cause": cause_id, "error": None})
            continue
        measured = e["baseline_step_ms"] * c["fixed_wall_step_ms"] / c["wall_step_ms"]
        rows.append({"folder": str(folder), "case": case, "cause": cause_id, "action": e["action"],
                     "traced_ms": e["baseline_step_ms"], "expected_ms": e["expected_step_ms"], "low_ms": e["low_ms"],
                     "high_ms": e["high_ms"], "measured_ms": measured,
                     "error": (e["expected_step_ms"] - measured) / measured,
                     "in_range": e["low_ms"] <= measured <= e["high_ms"],
                     **_like_for_like(folder / f"{case}.fixed.json.gz", e)})
    return rows


def _traced_steps_ms(path: Path) -> list[float]:
    """The trace's steps (ms), from the profiler's own ProfilerStep markers on the host."""
    with gzip.open(path, "rt") as f:
        events = json.load(f).get("traceEvents") or []
    return [e["dur"] / 1e3 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("cat") == "user_annotation" and isinstance(e.get("dur"), (int, float))]


def _like_for_like(fixed_trace: Path, expected: dict) -> dict:
    """The fixed loop's traced step and the prediction's error against it, where it was traced."""
    if not fixed_trace.exists():
        return {}
    steps = _traced_steps_ms(fixed_trace)
    if not steps:
        return {}
    fixed = statistics.median(steps)
    return {"fixed_traced_ms": fixed, "traced_error": (expected["expected_step_ms"] - fixed) / fixed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    args = ap.parse_args(argv)
    rows = [r for f in args.folders for r in grade(f)]
    for r in rows:
        if r["error"] is None:
            print(f"{r['folder']}  {r['case']:18s} {r['cause']:28s} no prediction")
            continue
        print(f"{r['folder']}  {r['case']:18s} {r['action'][:36]:36s} traced {r['traced_ms']:6.2f}  range "
              f"{r['low_ms']:6.2f}-{r['high_ms']:6.2f}  expected {r['expected_ms']:6.2f}  measured {r['measured_ms']:6.2f}"
              f"  error {r['error']:+6.1%}  {'in range' if r['in_range'] else 'OUT of range'}"
              + (f"  | fixed, traced {r['fixed_traced_ms']:6.2f}  error {r['traced_error']:+6.1%}"
                 if "traced_error" in r else ""))
    graded = [abs(r["error"]) for r in rows if r["error"] is not None]
    if graded:
        print(f"over {len(graded)} cases: median |error| {statistics.median(graded):.1%}, "
              f"in range {sum(r['in_range'] for r in rows if r['error'] is not None) / len(graded):.0%}")
    like = [abs(r["traced_error"]) for r in rows if "traced_error" in r]
    if like:
        print(f"against the fixed loops' own traces, over {len(like)} cases: median |error| "
              f"{statistics.median(like):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
