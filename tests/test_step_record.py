"""A step record's types are settled where it is read (step_record.from_json_record): the
readers get a StepRecord whose every value has its type and range, or None."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from diag import rundir
from diag.step_record import STEP_FIELDS, StepRecord, from_json_record, to_json_record

GOOD = {"step": 7, "start_unix": 1.8e9, "duration_s": 0.12, "data_wait_s": 0.01, "collate_s": None, "cpu_s": 0.2,
        "data_wait_cpu_s": 0.0, "samples": 32, "tokens": 4096, "peak_mem_bytes": 3 << 30, "profiled": True,
        "device_s": 0.11, "data_idle_s": 0.001, "evidence": "sampled",
        "shares": {"data": 0.1, "host": 0.1, "comm": 0.2, "memory": 0.2, "compute": 0.4, "wait": None}, "mfu": 0.41}


def test_a_whole_record_reads_back_as_written():
    rec = from_json_record(GOOD)
    assert rec is not None and to_json_record(rec) == GOOD
    assert set(STEP_FIELDS) == set(StepRecord.__struct_fields__)
    assert type(rec.samples) is int and type(rec.peak_mem_bytes) is int  # counts stay integers


@pytest.mark.parametrize("field,bad", [
    ("duration_s", float("nan")), ("duration_s", -0.1), ("duration_s", float("inf")), ("duration_s", "0.1"),
    ("data_wait_s", True), ("cpu_s", [1]), ("device_s", 1e12), ("start_unix", float("nan")), ("start_unix", -5.0),
    ("samples", -1), ("samples", 1e30), ("tokens", "many"), ("peak_mem_bytes", -1), ("profiled", "yes"),
    ("evidence", "guess"), ("shares", {"data": "half"}), ("shares", [0.5]), ("mfu", float("inf")),
])
def test_a_value_a_step_cannot_hold_reads_as_not_measured_and_the_rest_stays(field, bad):
    problems: list = []
    rec = from_json_record({**GOOD, field: bad}, problems, "rank 0: ")
    assert rec is not None
    assert getattr(rec, field) == getattr(StepRecord(step=0), field)  # its default: not measured
    kept = {k: v for k, v in GOOD.items() if k != field}
    assert {k: v for k, v in to_json_record(rec).items() if k != field} == kept
    # A count no step holds is the job's mistake, and said; other damage reads as not measured.
    assert bool(problems) == (field in ("samples", "tokens"))


@pytest.mark.parametrize("raw", [None, [], "step", {"duration_s": 0.1}, {"step": -1}, {"step": 1.5},
                                 {"step": True}, {"step": 1 << 60}])
def test_what_is_no_step_is_left_out(raw):
    problems: list = []
    assert from_json_record(raw, problems) is None
    assert bool(problems) == isinstance(raw, dict)


def test_an_older_record_reads_without_its_verdict():
    """A diag.run/2 record carried its live verdict and path: they are not facts, and not read."""
    rec = from_json_record({**GOOD, "bound": "compute", "path": [{"node": "data"}]})
    assert rec == from_json_record(GOOD)


def test_the_run_directory_reads_every_line_typed(tmp_path):
    rng = random.Random(3)
    seg = tmp_path / "run" / "rank-00000" / "steps"
    seg.mkdir(parents=True)
    lines = []
    for i in range(200):
        rec = dict(GOOD, step=i)
        for field in rng.sample(sorted(GOOD), 2):
            rec[field] = rng.choice([None, "x", -3, float("nan"), [], {}, True, 1e40])
        lines.append(json.dumps(rec))
    (seg / "steps-000000.jsonl").write_text("\n".join(lines) + "\n")
    steps = rundir.RunDir(tmp_path / "run").steps(0)
    assert steps and all(isinstance(s, StepRecord) for s in steps)
    # Each is what msgspec itself accepts as a StepRecord: the types and ranges hold.
    for s in steps:
        assert msgspec.convert(to_json_record(s), StepRecord) == s


def test_a_live_step_is_a_record_with_its_live_verdict():
    """live.json's steps (for diag top) read as records do, with the bound the agent judged."""
    from diag.step_record import LiveStep, live_step

    step = live_step({**GOOD, "bound": "compute", "path": [{"node": "data"}]})
    assert isinstance(step, LiveStep) and step.bound == "compute" and step.duration_s == GOOD["duration_s"]
    assert live_step({**GOOD, "bound": "x" * 33, "duration_s": "slow"}).bound is None
    assert live_step({"step": "one"}) is None
