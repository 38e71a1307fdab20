"""Python on the training thread outside every op (trace.python_gaps), named as a cause.

A real H200 trace whose augmentation ran as torch ops on CPU tensors becomes a pipeline of
plain Python (PIL, NumPy) by taking those ops out of it: the thread's time between its
other ops stays, with no op in it. The gaps are recomputed here from the raw events."""

from __future__ import annotations

import gzip
import json
import types
from pathlib import Path

import pytest
from device_steps import host_steps
from merged_ranks import merged

from diag.analyzers.analysis_types import Job
from diag.analyzers.analyze import analyze_paths
from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt

H200 = Path(__file__).parent / "fixtures" / "real" / "h200"
AUGMENT = {"aten::rand", "aten::flip", "aten::sub", "aten::div", "aten::upsample_bilinear2d"}


def _events(case: str) -> list[dict]:
    with gzip.open(H200 / f"{case}.json.gz") as f:
        return json.load(f)["traceEvents"]


def _without_augment_ops(events: list[dict]) -> tuple[list[dict], int, list[tuple[float, float]]]:
    """The events less the augmentation's ops and everything inside them on their thread; the
    training thread and the removed ops' spans."""
    main = next(e["tid"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "cpu_op" and e.get("tid") == main and e["name"] in AUGMENT]
    inside = [e for e in events if e.get("tid") == main and e.get("ph") == "X" and e.get("cat") == "cpu_op"
              and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans)]
    gone = {id(e) for e in inside}
    kept = [dict(e, args=dict(e["args"])) if isinstance(e.get("args"), dict) else e for e in events if id(e) not in gone]
    # The profiler numbers each op it records ("Ev Idx"): ops Python never called leave no hole.
    numbered = sorted((e for e in kept if isinstance(e.get("args"), dict) and "Ev Idx" in e["args"]),
                      key=lambda e: e["args"]["Ev Idx"])
    for k, e in enumerate(numbered):
        e["args"]["Ev Idx"] = k
    return kept, main, spans


def _gap_ms_per_step(events: list[dict], main, min_us: float = 100.0) -> float:
    """The training thread's time outside its ops and every runtime call, in stretches of
    min_us or more with no other thread's op, per ProfilerStep."""
    steps = host_steps(events)
    mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and (
        (e.get("cat") == "cpu_op" and e.get("tid") == main) or e.get("cat") == "cuda_runtime"))
    others = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("tid") != main]
    total = 0.0
    for lo, hi in steps:
        at = lo
        for a, b in [(max(a, lo), min(b, hi)) for a, b in mine if b > lo and a < hi] + [(hi, hi)]:
            if a - at >= min_us and not any(x < a and y > at for x, y in others):
                total += a - at
            at = max(at, b)
    return total / 1e3 / len(steps)


def _analysed(tmp_path, events: list[dict]) -> dict:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return analyze_paths([str(path)], jobs=1)


def test_python_between_ops_is_named_with_its_time(tmp_path):
    events, main, _ = _without_augment_ops(_events("cpu_ops_on_thread"))
    doc = _analysed(tmp_path, events)
    cause = next(c for c in doc.diagnosis.causes if c["id"] == "python_on_training_thread")
    assert cause["evidence"]["ms_per_step"] == pytest.approx(_gap_ms_per_step(events, main), rel=1e-3)
    assert cause["phase"] == "host" and "off the training thread" in cause["action"]
    assert "with_stack=True" in cause["text"]  # no stacks recorded: where to look is said
    assert "cpu_work_on_training_thread" not in {c["id"] for c in doc.diagnosis.causes}
    # CUDA graphs would not shorten Python: the host verdict's advice to capture them is replaced.
    host = next(r for r in doc.diagnosis.recommendations if r["id"] == "phase-host")
    assert not any(a.startswith("Capture the step with CUDA graphs") for a in host["actions"])
    assert cause["expected"]["expected_step_ms"] == pytest.approx(cause["what_if"]["predicted_step_ms"])


def test_the_frame_that_holds_the_python_is_named_from_the_stacks(tmp_path):
    events, main, spans = _without_augment_ops(_events("cpu_ops_on_thread"))
    pid = next(e["pid"] for e in events if e.get("tid") == main)
    first, last = min(e["ts"] for e in events if "ts" in e), max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e)
    frames = [{"ph": "X", "cat": "python_function", "name": "train.py(10): main", "pid": pid, "tid": main,
               "ts": first, "dur": last - first}]
    frames += [{"ph": "X", "cat": "python_function", "name": "augment.py(42): augment", "pid": pid, "tid": main,
                "ts": a - 1.0, "dur": b - a + 2.0} for a, b in spans]
    doc = _analysed(tmp_path, events + frames)
    cause = next(c for c in doc.diagnosis.causes if c["id"] == "python_on_training_thread")
    top = cause["evidence"]["frames"][0]
    assert (top["function"], top["file"], top["line"]) == ("augment", "augment.py", 42)
    assert "augment (augment.py:42" in cause["text"]


@pytest.mark.parametrize("case", ["cpu_ops_on_thread", "item_sync", "empty_cache", "launch_bound", "matmul_bf16",
                                  "pageable_copy"])
def test_no_python_is_named_where_the_thread_runs_ops_or_waits_on_the_backward(case):
    doc = analyze_paths([str(H200 / f"{case}.json.gz")], jobs=1)
    assert "python_on_training_thread" not in {c["id"] for c in doc.diagnosis.causes}


@pytest.mark.parametrize("ms,named", [(9.9, False), (10.0, True)])
def test_python_is_named_from_its_step_share(ms, named):
    tree = dt.load_tree()
    assert tree.thresholds["python_work_step_share"] == 0.10
    rank = {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": 100.0} for k in range(3)],
                         "python_gaps": {"ms_per_step": ms, "stretches_per_step": 1.0, "longest_ms": ms,
                                         "frames": []}}}
    ctx = types.SimpleNamespace(ranks=merged({0: rank}), tree=tree, bound="host", job=Job(what_if=[]),
                                shares={"host": 0.6}, nccl={})
    assert ("python_on_training_thread" in {c["id"] for c in cs.causes(ctx)}) == named
