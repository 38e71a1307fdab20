"""The Trace Event format's JSON Array Format: a bare array of events, whose closing bracket
its writers may leave out. The same real events as the object form give the same steps,
and an array its writer left mid-event gives the events before it, with a note."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from device_steps import device_step_windows
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_paths, json_safe

H200 = Path(__file__).parent / "fixtures" / "real" / "h200" / "item_sync.json.gz"


def _events() -> list[dict]:
    with gzip.open(H200) as f:
        return json.load(f)["traceEvents"]


@pytest.fixture(scope="module")
def events():
    return _events()


@pytest.mark.parametrize("ending", ["]", "", ",\n", "\n"])
def test_a_bare_array_is_read_with_or_without_its_closing_bracket(tmp_path, events, ending):
    text = json.dumps(events, indent=None)[:-1] + ending
    path = tmp_path / "trace.json"
    path.write_text(text)
    doc = analyze_paths([str(path)], jobs=1)
    got = [s["duration_ms"] for s in ranks_of(doc)[0]["steps"]]
    assert got == pytest.approx([(b - a) / 1e3 for a, b in device_step_windows(events)], rel=1e-9)
    assert not any("writer stopped" in n for n in ranks_of(doc)[0].get("notes") or [])


def test_an_array_cut_inside_its_last_event_keeps_the_events_before_it(tmp_path, events):
    last = json.dumps(events[-1])
    text = json.dumps(events)[:-1]
    path = tmp_path / "trace.json"
    path.write_text(text[: len(text) - len(last) // 2])
    doc = analyze_paths([str(path)], jobs=1)
    assert "the event array ends inside an event" in json.dumps(json_safe(doc))
    assert len(ranks_of(doc)[0]["steps"]) == len(device_step_windows(events[:-1]))


@pytest.mark.parametrize("text,message", [("[{\"ph\": \"X\"}] trailing", "data after the trace's event array"),
                                          ("[1, 2, 3]", "JSON array is not a Kineto trace")])
def test_what_is_not_an_event_array_is_one_error(tmp_path, text, message):
    path = tmp_path / "trace.json"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "diag", "analyze", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
