"""Traces without ProfilerStep spans: steady iterations found from a marker that repeats once
per iteration, start-up left out, and a whole-trace judgement said and trusted less."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import FIXTURES
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_paths
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.trace.iterations import steady_iterations
from diag.analyzers.trace.load import load_trace, step_windows

STEPS = 10
SLOW_FIRST = 3  # loop bodies 0-2 also run a first-call path: Python work on the host


def _record(path):
    """A loop recorded with the older torch.autograd.profiler API: no ProfilerStep spans."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.autograd.profiler.profile() as prof:
        for i in range(STEPS):
            if i < SLOW_FIRST:
                sum(k * k for k in range(1_500_000))
            loss = model(torch.randn(128, 512)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    prof.export_chrome_trace(str(path))
    return path


OLD_API_TRACE = FIXTURES / "old_api_loop.json.gz"  # _record's output: `python tests/test_iterations.py`


@pytest.fixture(scope="module")
def old_api_trace():
    """The loop recorded once (a live recording's start-up and steady steps scatter with the
    machine's load; the file's do not)."""
    return OLD_API_TRACE


def test_the_recorded_loop_still_has_no_profiler_steps(tmp_path):
    """The fixture's recorder, run live: the older API still writes no ProfilerStep spans, and
    its optimizer steps are the markers the iterations are found from."""
    path = _record(tmp_path / "loop.json")
    assert not _marker_starts(path, "ProfilerStep#")
    assert len(_marker_starts(path, "Optimizer.step#")) == STEPS


def _marker_starts(path, prefix):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted(float(e["ts"]) for e in events if str(e.get("name", "")).startswith(prefix) and e.get("ph") == "X")


def test_a_trace_of_the_older_profiler_is_judged_on_its_steady_iterations(old_api_trace):
    doc = analyze_paths([str(old_api_trace)])
    rank = ranks_of(doc)[0]
    it = rank["iterations"]
    assert it["marker"] == "Optimizer.step#SGD.step" and it["marker_kind"] == "the optimizer's step"
    # Iterations run from one optimizer step to the next: STEPS - 1 of them, the first two
    # holding the slow loop bodies 1 and 2 (body 0 comes before the first marker).
    assert it["found"] == STEPS - 1 and it["startup"] == [0, 1] and it["used"] == list(range(2, STEPS - 1))
    starts = _marker_starts(old_api_trace, "Optimizer.step#")
    assert [s["start_us"] for s in rank["steps"]] == pytest.approx(starts[2:-1])
    assert [s["duration_ms"] for s in rank["steps"]] == pytest.approx(
        [(b - a) / 1e3 for a, b in zip(starts[2:-1], starts[3:])])
    # The steady loop is matmuls; the trace taken whole is dominated by the first-call path.
    assert doc.diagnosis.bound == "compute"
    assert any(f["id"] == "iterations_from_markers" for f in doc.diagnosis.findings)


def test_taken_whole_the_same_trace_gets_the_start_ups_verdict(old_api_trace, tmp_path):
    config = tmp_path / "whole.toml"
    config.write_text("[thresholds]\niteration_min_count = 1000\n")
    doc = analyze_paths([str(old_api_trace)], tree=dt.load_tree(config))
    rank = ranks_of(doc)[0]
    assert len(rank["steps"]) == 1 and rank["iterations"]["marker"] is None
    assert doc.diagnosis.bound == "host"
    assert any(f["id"] == "no_iterations" for f in doc.diagnosis.findings)
    assert any("judged whole, start-up included" in r for r in doc.diagnosis.confidence["reasons"])


def test_a_trace_with_profiler_steps_keeps_them():
    doc = analyze_paths([str(FIXTURES / "cpu_compute_rank0.pt.trace.json.gz")])
    assert ranks_of(doc)[0]["iterations"] is None
    assert all(isinstance(s["step"], int) for s in ranks_of(doc)[0]["steps"])


def _annotated(tmp_path, gaps_us: list[float], name="train_step"):
    """A trace whose only repeating marker is a user annotation starting at the given gaps."""
    events, ts = [], 1000.0
    for gap in gaps_us + [1000.0]:
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 50.0, "pid": 1, "tid": 1})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts + 60, "dur": gap - 100, "pid": 1,
                       "tid": 1})
        ts += gap
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return load_trace(str(path))


@pytest.mark.parametrize("first,left_out", [(1.4, []), (1.6, [0])])
def test_start_up_is_a_leading_iteration_over_the_ratio(tmp_path, first, left_out):
    settings = dt.load_tree().facts
    assert settings.iteration_startup_ratio == 1.5
    trace = _annotated(tmp_path, [first * 1000.0] + [1000.0] * 6)
    it = steady_iterations(trace, step_windows(trace)[0][1:], settings)
    assert it.marker == "train_step" and it.marker_kind == "a user annotation"
    assert it.startup == left_out and len(it.windows) == 7 - len(left_out)


@pytest.mark.parametrize("repeats,found", [(3, False), (4, True)])
def test_iterations_need_a_marker_repeated_past_the_minimum(tmp_path, repeats, found):
    settings = dt.load_tree().facts
    assert settings.iteration_min_count == 3
    trace = _annotated(tmp_path, [1000.0] * (repeats - 1))  # `repeats` markers, then one more at the end
    it = steady_iterations(trace, step_windows(trace)[0][1:], settings)
    assert (it.marker is not None) is found
    if not found:
        assert len(it.windows) == 1 and "whole trace is judged as one step" in it.reason


if __name__ == "__main__":
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        raw = _record(Path(tmp) / "loop.json")
        with open(raw, "rb") as src, open(OLD_API_TRACE, "wb") as out, \
                gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
    print(f"wrote {OLD_API_TRACE}")
