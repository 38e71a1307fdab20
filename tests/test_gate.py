"""`diag compare --gate`: the judgement (diagnosis/gate.py) above and below its limit, what
makes two runs incomparable, the CI outputs, and the gate on real demo runs: a rerun passes,
an induced slow-down fails, another world size is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from merged_ranks import merged

from diag.analyzers.analysis_types import analysis_from_json
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis import gate as gt
from diag.analyzers.diagnosis import run_figures as rf
from diag.diagnosis_document import Diagnosis
from diag.report.gate import junit, markdown

TREE = dt.load_tree()


def _run(step_ms: float, n: int = 40, world: int = 2, device: str = "CPU", params: int = 1000,
         samples: int = 64, scatter: float = 0.01, host_share: float = 0.1, drift: float = 0.0):
    """(analysis document, diagnosis) of a run whose steps scatter by +-scatter around step_ms,
    and whose second half runs `drift` slower than its first; the diagnosis's run figures are
    made by its own functions from the ranks and the job's steps."""
    times = [step_ms * (1 + scatter * ((k % 5) - 2) / 2) * (1 + drift * (k >= n // 2)) / 1e3 for k in range(n)]
    steps = [{"step": k, "duration_ms": t * 1e3, "samples": samples,
              "shares": {"data": 0.0, "host": host_share, "comm": 0.0, "wait": 0.0, "memory": 0.1,
                         "compute": 0.8 - host_share}} for k, t in enumerate(times)]
    doc = {"ranks": [{"rank": r, "steps": steps} | ({"model": {"class": "Sequential", "params": params}} if params
                                                    else {}) for r in range(world)]}
    ranks = merged({r: {"analysis": a, "device": device} for r, a in enumerate(doc["ranks"])})
    figures = {"identity": rf.identity(ranks, world), "step_time": rf.step_time(times),
               "throughput": {"samples_per_s": samples * world / (step_ms / 1e3)}}
    return analysis_from_json(doc), Diagnosis(run_figures=figures)


def _model(run) -> dict:
    """The report model compare() reads beside the diagnosis."""
    figures = run[1].run_figures
    return {"run": {"world_size": figures["identity"]["world size"]}, "diagnosis": run[1],
            "throughput": figures["throughput"]}


def _gate(before, after, **kw):
    return gt.gate(before[0], before[1], after[0], after[1], TREE, **kw)


def test_the_default_limit_is_in_the_toml():
    assert TREE.thresholds["gate_max_slowdown"] == 0.03


@pytest.mark.parametrize("slower,result", [(0.02, "pass"), (0.06, "regression")])
def test_step_time_is_judged_against_the_limit_outside_the_noise(slower, result):
    """Steps scattering by 1%: 2% slower is within the 3% limit, 6% slower is past it."""
    out = _gate(_run(100.0), _run(100.0 * (1 + slower)))
    assert out["result"] == result and out["exit_status"] == gt.EXIT_STATUS[result]
    step = out["figures"][0]
    assert step["name"] == "step time" and step["change"] == pytest.approx(slower, rel=1e-6)
    assert step["worse"] == (result == "regression")
    assert out["summary"].startswith("diag gate: PASS" if result == "pass" else "diag gate: REGRESSION: step time")


def test_a_noisy_run_passes_what_a_quiet_one_fails():
    """The same 6% slow-down: past the limit with 1% scatter, within the noise with 40%."""
    assert _gate(_run(100.0), _run(106.0))["result"] == "regression"
    assert _gate(_run(100.0, scatter=0.4), _run(106.0, scatter=0.4))["result"] == "pass"


def test_max_slowdown_overrides_the_limit():
    assert _gate(_run(100.0), _run(106.0), max_slowdown=0.10)["result"] == "pass"
    assert _gate(_run(100.0), _run(102.5), max_slowdown=0.0)["result"] == "regression"


def test_a_phase_that_grows_past_the_limit_fails_even_when_the_step_does_not():
    """Host time grows by 10% of the step while compute shrinks as much: the step is flat."""
    out = _gate(_run(100.0, host_share=0.1), _run(100.0, host_share=0.2))
    (host,) = [f for f in out["figures"] if f["name"] == "host phase"]
    assert host["worse"] and host["change"] == pytest.approx(0.10, rel=1e-6)
    assert out["result"] == "regression" and not out["figures"][0]["worse"]


@pytest.mark.parametrize("what,after", [
    ("world size: 2 before, 4 after", {"world": 4}),
    ("device: CPU before, NVIDIA H100 after", {"device": "NVIDIA H100"}),
    ("model: Sequential with 1,000 parameters before, Sequential with 2,000 parameters after", {"params": 2000}),
    ("batch: 128 before, 256 after", {"samples": 128}),
])
def test_runs_that_differ_are_not_comparable(what, after):
    out = _gate(_run(100.0), _run(100.0, **after))
    assert out["result"] == "not_comparable" and out["exit_status"] == 2 and out["figures"] == []
    assert what in out["reasons"] and what in out["summary"]


def test_too_few_steps_are_not_comparable_and_an_unrecorded_fact_is_a_note():
    assert "too few steps" in _gate(_run(100.0), _run(100.0, n=2))["reasons"][0]
    out = _gate(_run(100.0, params=None), _run(100.0))
    assert out["result"] == "pass" and out["notes"] == ["model is not recorded in BEFORE: not checked"]


def test_a_run_whose_pace_drifts_gets_a_wider_band():
    """Two runs, each drifting 10% between its halves, 6% apart: within their levels' noise."""
    assert _gate(_run(100.0, drift=0.1), _run(106.0, drift=0.1))["result"] == "pass"
    assert _gate(_run(100.0), _run(106.0))["result"] == "regression"


def test_the_ci_outputs_keep_hostile_names_as_text():
    """A run path with Markdown, HTML and XML syntax stays text in both outputs."""
    out = _gate(_run(100.0), _run(100.0, world=4))
    hostile = "runs/<script>alert(1)</script>|`x`&"
    md = markdown(out, hostile, "runs/pr")
    assert "``runs/<script>alert(1)</script>\\|`x`&``" in md and md.count("<script>") == 1  # in a code span
    assert "NOT COMPARABLE" in md and "world size: 2 before, 4 after" in md
    suite = ET.fromstring(junit({**out, "reasons": out["reasons"] + [hostile]}))
    assert suite.get("failures") == "1" and suite.find("testcase/failure").text.endswith(hostile)
    regression = _gate(_run(100.0), _run(110.0))
    suite = ET.fromstring(junit(regression))
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert "step time" in failed and suite.get("tests") == str(len(regression["figures"]))
    table = markdown(regression, "a", "b")
    assert "| step time | 100.00 ms | 110.00 ms | +10.0% |" in table and "**worse**" in table


@pytest.mark.parametrize("text,value", [("3%", 0.03), ("0.03", 0.03), ("12.5%", 0.125), ("0", 0.0)])
def test_max_slowdown_takes_a_percentage_or_a_fraction(text, value):
    from diag.commands.compare import _fraction

    assert _fraction(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["3", "-1%", "150%", "fast"])
def test_max_slowdown_refuses_what_is_not_one(text):
    proc = subprocess.run([sys.executable, "-m", "diag", "compare", "a", "b", "--gate", "--max-slowdown", text],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-slowdown" in proc.stderr and "Traceback" not in proc.stderr


# -- on real demo runs ----------------------------------------------------------------------


def _demo(tmp, name: str, *extra: str, steps: int = 24):
    run_dir = tmp / name
    subprocess.run([sys.executable, "-m", "diag", "demo", "--no-export", "--steps", str(steps), "--run-dir",
                    str(run_dir), *extra], check=True, capture_output=True, timeout=300)
    return run_dir


def _compare(before, after, tmp, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "diag", "compare", str(before), str(after), "--gate",
                           "--out", str(tmp / "cmp"), *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_the_gate_on_real_demo_runs(tmp_path, demo_run_dir):
    """A demo whose steps idle as long as their work after it (about twice as slow) fails against
    a plain one (the session's demo run, 24 steps as here, which compare only reads); a one-rank
    run against the two-rank baseline is refused. (A rerun of the same code passing is the
    README's CI sample, run by tests/test_readme.py.) The limit is 5%: two runs of the same code
    on this shared 2-core machine differ by up to 16% in step time, which their bands hold, but
    which reaches a few points past 3%. The regression is that large because the two runs are
    made at different times of a busy test run: with a CPU-bound job beside the suite, the host
    phase of a quarter's slow-down (+21% of the step) had a band reaching -3%, which an honest
    gate passes; `python bench/bench_gate.py` measures the quarter on a quiet machine."""
    base = demo_run_dir
    slow = _compare(base, _demo(tmp_path, "slow", "--slow-down", "1.0"), tmp_path, "--max-slowdown", "5%",
                    "--summary", str(tmp_path / "slow.md"), "--junit", str(tmp_path / "slow.xml"),
                    env={"GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")})
    # The idle time lands in the host phase, whose band (the process's own time, not the
    # machine's speed) is narrow: it fails there even where the step time's band reaches 0.
    assert slow.returncode == 1 and slow.stdout.startswith("diag gate: REGRESSION:"), slow.stdout + slow.stderr
    assert "host phase +" in slow.stdout, slow.stdout
    assert "**worse**" in (tmp_path / "slow.md").read_text()
    assert (tmp_path / "summary.md").read_text().startswith("### diag gate: REGRESSION")
    suite = ET.parse(tmp_path / "slow.xml").getroot()
    assert int(suite.get("failures")) >= 1 and any(c.get("name") == "host phase" and c.find("failure") is not None
                                                   for c in suite.iter("testcase"))

    other = _compare(base, _demo(tmp_path, "one", "--ranks", "1", steps=8), tmp_path)
    assert other.returncode == 2 and "world size: 2 before, 1 after" in other.stdout, other.stdout
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["after"]["world_size"] == 1


@pytest.mark.parametrize("drift", [0.0, 0.1])
def test_compare_and_the_gate_give_one_interval(drift):
    """The same pair: plain compare's step-time interval is the gate's noise band, drift and all."""
    from diag.analyzers.views.compare_model import compare

    before, after = _run(100.0, drift=drift), _run(106.0, drift=drift)
    step = _gate(before, after)["figures"][0]
    st = compare(_model(before), _model(after), before[0], after[0], TREE)["step_time"]
    assert [st["ci_low"] - 1, st["ci_high"] - 1] == pytest.approx(step["band"], rel=1e-12)
    assert st["change"] == pytest.approx(step["change"], rel=1e-12)


@pytest.mark.parametrize("what,after", [
    ("device: CPU before, NVIDIA H100 after", {"device": "NVIDIA H100"}),
    ("model: Sequential with 1,000 parameters before, Sequential with 2,000 parameters after", {"params": 2000}),
    ("batch: 128 before, 256 after", {"samples": 128}),
])
def test_plain_compare_draws_no_conclusion_where_the_gate_refuses(what, after):
    """Runs that train different jobs: no step-time change, no verdict change read as the change's
    doing, no prediction graded; the same reason the gate gives."""
    from diag.analyzers.views.compare_model import compare

    before, other = _run(100.0), _run(270.0, **after)
    model_a, model_b = _model(before), _model(other)
    model_a["bound"], model_b["bound"] = "comm", "compute"
    c = compare(model_a, model_b, before[0], other[0], TREE)
    assert what in _gate(before, other)["reasons"] and c["differences"] == [what] and not c["comparable"]
    assert c["step_time"] is None and c["headline"].startswith("Not comparable: the runs train different jobs")
    assert "removed the old bottleneck" not in c["verdict_change"]["text"]
    assert "no change is read into it" in c["verdict_change"]["text"]


def test_two_world_sizes_are_a_scaling_study_for_compare_and_refused_by_the_gate():
    """Compare reads 2 and 4 ranks with the same batch per rank as scaling, the gate refuses
    them; 4 ranks with the job's batch split between them differ in batch per rank."""
    from diag.analyzers.views.compare_model import compare

    two, four = _run(100.0), _run(110.0, world=4)
    assert _gate(two, four)["result"] == "not_comparable"
    c = compare(_model(two), _model(four), two[0], four[0], TREE)
    assert c["comparable"] and c["step_time"] is not None
    halves = _run(60.0, world=4, samples=32)
    split = compare(_model(two), _model(halves), two[0], halves[0], TREE)
    assert split["differences"] == ["batch per rank: 64 before, 32 after"]
