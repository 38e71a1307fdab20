"""`diag demo --bottleneck X` induces X for real, and `diag analyze RUN_DIR --json` agrees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diag.demo import BOTTLENECKS, schedule

STEPS = 16


def _diag(*args, timeout=240):
    env = dict(os.environ, DIAG_EXPORTER="off")
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _warnings(doc: dict) -> list[dict]:
    found = list((doc.get("job") or {}).get("findings") or [])
    for r in doc.get("ranks") or []:
        found += r.get("findings") or []
    return [f for f in found if f.get("severity") in ("warning", "error", "critical")]


@pytest.mark.slow
@pytest.mark.parametrize("bottleneck", BOTTLENECKS)
def test_demo_verdict_matches_the_induced_bottleneck(bottleneck, tmp_path):
    expected = "compute" if bottleneck == "none" else bottleneck
    run_dir = tmp_path / "demo"
    if bottleneck == "none":
        # An earlier run in the requested folder is kept; the demo goes to demo-2.
        run_dir.mkdir()
        (run_dir / "keep.txt").write_text("earlier run")
    proc = _diag("demo", "--bottleneck", bottleneck, "--steps", str(STEPS), "--run-dir", str(run_dir), "--no-export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"Verdict: {expected}-bound" in out, out + proc.stderr[-3000:]
    actual_dir = run_dir if bottleneck != "none" else tmp_path / "demo-2"
    assert f"Run directory: {actual_dir}" in out
    if bottleneck == "none":
        assert (run_dir / "keep.txt").read_text() == "earlier run"

    analysed = _diag("analyze", str(actual_dir), "--json")
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    doc = json.loads(analysed.stdout)
    assert doc["schema"] == "diag.analysis/1"
    assert doc["job"]["bound"] == expected
    # The job verdict is the claim; a single rank may read differently when it waits for a
    # slower peer (the cross-rank analysis then names the straggler).
    assert expected in [r["bound"] for r in doc["ranks"]]
    for r in doc["ranks"]:
        assert [s["step"] for s in r["steps"]] == list(range(STEPS))
        evidence = {s["evidence"] for s in r["steps"]}
        assert evidence == {"trace", "sampled"}
        assert r["evidence"]["windows"] and r["evidence"]["windows"][0]["first_step"] == (
            schedule(STEPS)["skip_first"] + schedule(STEPS)["warmup"])
    if bottleneck == "none":
        assert _warnings(doc) == [], _warnings(doc)
    report = actual_dir / "report.html"
    if report.exists():
        assert f"Report: {report}" in out
