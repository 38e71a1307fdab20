"""Run directories the agent recorded on an H200 (tests/fixtures/real/h200/agent, from
bench/gpu_fix_bank.py): loops that never sync, so the host launches each step in about 1 ms
while the device runs it for 11 to 14 ms. The figures checked come from the records (the
device's boundary events) and from the fixed variants measured on the same session's H200."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_run_dir
from diag.analyzers.job.sampled import device_busy_floor
from diag.step_record import from_json_record

RUNS = Path(__file__).parent / "fixtures" / "real" / "h200" / "agent"
MEASURED = json.loads((RUNS / "measured.json").read_text())["fixed_step_ms"]


def _records(case: str) -> list[dict]:
    path = RUNS / case / "rank-00000" / "steps" / "steps-000000.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", ["matmul_fp32_odd", "pageable_copy"])
def test_a_step_the_host_ran_ahead_of_is_the_devices(case):
    recs = _records(case)
    ahead = [r for r in recs if r["device_s"] and r["duration_s"] < 0.5 * r["device_s"] and not r["profiled"]]
    assert len(ahead) >= 10 or case == "pageable_copy"  # the pageable copy holds the host: it cannot run ahead
    doc = analyze_run_dir(RUNS / case)
    steps = {s["step"]: s for s in ranks_of(doc)[0]["steps"]}
    for r in ahead:
        assert steps[r["step"]]["duration_ms"] == pytest.approx(1000 * r["device_s"])
        assert steps[r["step"]]["host_ms"] == pytest.approx(1000 * r["duration_s"])


@pytest.mark.parametrize("case,bound,cause_id,action", [
    ("matmul_fp32_odd", "compute", "fp32_math", "bf16 autocast"),
    ("pageable_copy", "memory", "pageable_copies", "pinned memory"),
])
def test_the_action_predicted_meets_the_fix_measured(case, bound, cause_id, action):
    """The run's only utilisation sample was taken before its first step (the idle start);
    the verdict is the windows' and the device clock's, and the action's predicted step lies
    within 35% of the fixed variant's measured step, inside its range."""
    doc = analyze_run_dir(RUNS / case)
    assert doc.diagnosis.bound == bound
    cause = next(c for c in doc.diagnosis.causes if c["id"] == cause_id)
    e = cause["expected"]
    assert e["action"].startswith(action)
    device_ms = 1000 * statistics.median(r["device_s"] for r in _records(case)[5:] if r["device_s"])
    assert e["baseline_step_ms"] == pytest.approx(device_ms, rel=0.1)
    for measured in MEASURED[case].values():
        assert abs(e["expected_step_ms"] - measured) / measured <= 0.35
        assert e["low_ms"] <= measured <= e["high_ms"]


@pytest.mark.parametrize("host_s,device_s,floor", [
    (0.001, 0.014, 1 - 1 / 14), (0.014, 0.014, 0.0), (0.020, 0.014, 0.0), (0.001, None, None), (None, 0.014, None),
    (0.001, 0.0, None), (True, 0.014, None),
])
def test_the_device_was_busy_at_least_while_the_host_was_ahead(host_s, device_s, floor):
    got = device_busy_floor(from_json_record({"step": 0, "duration_s": host_s, "device_s": device_s}))
    assert got == (pytest.approx(floor) if floor is not None else None)
