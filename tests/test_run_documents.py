"""A run directory's window summaries and records as typed documents: types settled once where
they are read, damage read as absent, the rest kept."""

from __future__ import annotations

import json
import math

import pytest

from diag import rundir
from diag.run_documents import (
    MAX_ERROR_CHARS,
    RankRecords,
    RunRecords,
    WindowSummary,
    window_json,
    window_summary,
)

GOOD = {"first_step": 3, "last_step": 4, "trace": "rank0.pt.trace.json.gz", "created_unix": 1.7e9,
        "analysis": {"rank": 0, "steps": [{"step": 3}, {"step": 4}]}, "error": None}


def test_a_whole_summary_round_trips():
    w = window_summary(GOOD)
    assert w == WindowSummary(**GOOD)
    assert window_json(w) == GOOD
    assert window_summary(json.loads(json.dumps(window_json(w)))) == w


@pytest.mark.parametrize("field, value", [
    ("first_step", "3"), ("first_step", -1), ("first_step", 1 << 60), ("first_step", 3.5), ("first_step", True),
    ("last_step", [4]), ("trace", 7), ("created_unix", math.nan), ("created_unix", -5.0),
    ("analysis", ["not", "an", "object"]), ("analysis", "text"), ("error", {"why": 1}),
])
def test_a_damaged_field_reads_as_absent_and_the_rest_is_kept(field, value):
    w = window_summary({**GOOD, field: value})
    assert w is not None
    assert getattr(w, field) is None
    kept = {k: v for k, v in window_json(w).items() if k != field}
    assert kept == {k: v for k, v in GOOD.items() if k != field}


@pytest.mark.parametrize("raw", [None, [], "window", 3, {}])
def test_what_is_no_summary_is_left_out(raw):
    assert window_summary(raw) is None


def test_an_error_line_is_cut_to_its_bound():
    w = window_summary({**GOOD, "analysis": None, "error": "x" * (MAX_ERROR_CHARS * 3)})
    assert w is not None and w.analysis is None and w.error == "x" * MAX_ERROR_CHARS


def test_a_summary_of_an_older_agent_reads_without_its_verdict():
    # diag.run/2 window summaries carried the window's bound and path; the run directory holds facts only now.
    w = window_summary({**GOOD, "bound": "compute", "path": [{"node": "root"}]})
    assert w == WindowSummary(**GOOD)


def test_the_run_directory_reads_its_windows_typed_in_step_order(tmp_path):
    d = tmp_path / "rank-00000" / rundir.WINDOWS
    d.mkdir(parents=True)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "diag.run/3"}))
    (d / "window-000009.json").write_text(json.dumps({**GOOD, "first_step": 9, "last_step": 10}))
    (d / "window-000003.json").write_text(json.dumps({**GOOD, "created_unix": "yesterday"}))
    (d / "window-000020.json").write_text('{"first_step": 20, "trace": "cut')  # a writer killed mid-file
    (d / "window-000030.json").write_text("[1, 2]")  # not an object
    rd = rundir.RunDir(tmp_path)
    windows = rd.windows(0)
    assert [(w.first_step, w.last_step) for w in windows] == [(3, 4), (9, 10)]
    assert windows[0].created_unix is None and windows[0].analysis == GOOD["analysis"]
    assert any("window-000020.json" in p for p in rd.problems)


def test_empty_records_are_the_defaults_and_not_shared():
    a, b = RunRecords(), RunRecords()
    a.problems.append("x")
    assert b.problems == [] and RankRecords().steps == [] and a.ranks == {} and a.nccl_bandwidth == []


def test_an_analysis_reads_each_file_of_the_run_once(demo_run_dir, monkeypatch):
    """The run analysis and the diagnosis share one read of the run directory: each rank.json,
    window summary and record stream, and the manifest, is read once per `diag analyze RUN`
    (they were read up to five times)."""
    from collections import Counter
    from pathlib import Path

    from diag.analyzers.analyze import analyze_run_dir

    reads: Counter = Counter()
    read_json, read_records = rundir.read_json, rundir.read_records

    def counted_json(path, *args, **kwargs):
        reads[Path(path).relative_to(demo_run_dir).as_posix()] += 1
        return read_json(path, *args, **kwargs)

    def counted_records(folder, stream, *args, **kwargs):
        reads[Path(folder).relative_to(demo_run_dir).as_posix()] += 1
        return read_records(folder, stream, *args, **kwargs)

    monkeypatch.setattr(rundir, "read_json", counted_json)
    monkeypatch.setattr(rundir, "read_records", counted_records)
    doc = analyze_run_dir(demo_run_dir)
    assert doc.ranks and doc.diagnosis.bound is not None
    ranks = sorted(p.name for p in demo_run_dir.glob("rank-*"))
    expected = {"manifest.json"} | {f"{r}/{name}" for r in ranks for name in ("rank.json", "samples", "events", "steps")}
    expected |= {p.relative_to(demo_run_dir).as_posix() for p in demo_run_dir.glob("rank-*/windows/window-*.json")}
    assert set(reads) == expected and set(reads.values()) == {1}, reads


def test_a_key_holding_a_lone_surrogate_is_an_unknown_field():
    """A damaged line's "\\ud800" escape decodes to a key no field name can match (msgspec
    cannot even encode it to compare): the record is read without it (found by fuzzing)."""
    from diag.step_record import from_json_record

    raw = json.loads('{"step": 3, "duration_s": 0.25, "\\ud800x": 1}')
    rec = from_json_record(raw)
    assert rec is not None and (rec.step, rec.duration_s) == (3, 0.25)
    w = window_summary({**GOOD, "\ud800": {"\ud800": 1}})
    assert w == WindowSummary(**GOOD)
