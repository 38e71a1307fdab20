"""`diag compare`: did the change help, with a noise band so that fragile wins show."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from report_helpers import write_run

from diag import rundir
from diag.analyzers.diagnosis.change import scaling_rating, step_time_change, verdict_of_change
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.steady import median_ratio_interval, warmup_steps
from diag.analyzers.views.compare_model import compare
from diag.report import analyse_and_model


def job_step_times(run) -> np.ndarray:
    """Straight from the step records: per step the slowest rank, warm-up left out (the steps
    before the first profiler window, else the first warmup_fraction of them)."""
    rd = rundir.RunDir(run)
    per: dict[int, float] = {}
    for r in rd.ranks():
        for rec in rd.steps(r):
            per[rec.step] = max(per.get(rec.step, 0.0), rec.duration_s)
    firsts = [w.first_step for r in rd.ranks() for w in rd.windows(r)]
    steps = sorted(per)
    cut = min(firsts) if firsts else steps[0] + warmup_steps(len(steps), load_tree().thresholds)
    return np.array([per[k] for k in steps if k >= cut])


def test_clear_win_is_called_helped(tmp_path):
    a = write_run(tmp_path / "a", ranks=2, steps=60, bound="comm", step_s=0.050, seed=1)
    b = write_run(tmp_path / "b", ranks=2, steps=60, bound="compute", step_s=0.040, seed=2)
    (da, ma), (db, mb) = analyse_and_model(a), analyse_and_model(b)
    c = compare(ma, mb, da, db)
    ta, tb = job_step_times(a), job_step_times(b)
    # The model keeps step times to the microsecond.
    assert c["step_time"]["ratio"] == pytest.approx(np.median(tb) / np.median(ta), rel=1e-4)
    assert c["step_time"]["result"] == "helped"
    assert c["step_time"]["ci_high"] < 0.99
    assert c["step_time"]["statement"].startswith("The change helped: steps are ")
    assert c["verdict_change"] == {
        "before": "comm", "after": "compute", "changed": True,
        "text": "The verdict changed from comm-bound to compute-bound: the change removed the old bottleneck "
                "and compute is now what limits the step."}
    comm = next(r for r in c["phases"] if r["phase"] == "comm")
    assert comm["before"] == pytest.approx(0.5, abs=0.01) and comm["after"] == pytest.approx(0.125, abs=0.01)
    assert c["scaling"] is None  # same world size


def test_small_noisy_difference_is_not_called_a_win(tmp_path):
    a = write_run(tmp_path / "a", ranks=1, steps=24, bound="data", step_s=0.050, jitter=0.8, seed=3)
    b = write_run(tmp_path / "b", ranks=1, steps=24, bound="data", step_s=0.048, jitter=0.8, seed=4)
    c = compare(analyse_and_model(a)[1], analyse_and_model(b)[1])
    st = c["step_time"]
    assert st["ci_low"] < 1.0 < st["ci_high"]
    assert st["result"] in ("fragile_win", "fragile_loss", "no_change")
    assert "noise" in st["statement"]


def test_noise_band_and_verdicts_on_known_samples():
    rng = np.random.default_rng(0)
    same = rng.normal(1.0, 0.05, 400)
    ratio, lo, hi = median_ratio_interval(same, rng.normal(1.0, 0.05, 400))
    assert lo < 1.0 < hi and verdict_of_change(ratio, lo, hi, 0.01) in ("no_change", "fragile_win", "fragile_loss")
    ratio, lo, hi = median_ratio_interval(same, same * 1.2)
    assert ratio == pytest.approx(1.2) and verdict_of_change(ratio, lo, hi, 0.01) == "hurt"
    assert verdict_of_change(0.95, 0.90, 1.02, 0.01) == "fragile_win"
    assert verdict_of_change(0.995, 0.98, 1.01, 0.01) == "no_change"
    # The interval covers the true ratio about 95% of the time (here: equal runs, ratio 1).
    covered = sum(lo <= 1.0 <= hi for lo, hi in (median_ratio_interval(rng.normal(1, 0.05, 60),
                                                                        rng.normal(1, 0.05, 60))[1:]
                                                 for _ in range(400)))
    assert 0.90 <= covered / 400 <= 0.99


def test_change_thresholds_are_the_tree_s():
    """A clear 3% win is "helped"; with change_min_effect at 5% it is no longer a win at all."""
    before = list(np.random.default_rng(1).normal(0.100, 0.001, 50))
    after = [x * 0.97 for x in before]
    assert step_time_change(before, after, load_tree())["result"] == "helped"
    assert step_time_change(before, after, load_tree(overrides={"change_min_effect": 0.05}))["result"] == "no_change"
    assert step_time_change(before[:2], after, load_tree()) is None  # too few steps


@pytest.mark.parametrize(("eff", "rating"), [(0.95, "good"), (0.85, "acceptable"), (0.6, "poor")])
def test_scaling_ratings_follow_the_tree_s_thresholds(eff, rating):
    tree = load_tree()
    assert scaling_rating(eff, 2, 4, "steps", tree)["rating"] == rating
    moved = load_tree(overrides={"scaling_good": 0.5, "scaling_efficiency": 0.4})
    assert scaling_rating(eff, 2, 4, "steps", moved)["rating"] == "good"


def test_scaling_efficiency_when_world_sizes_differ(tmp_path):
    # 32 samples per rank per step; 2 ranks at 50 ms, 4 ranks at 62.5 ms per step.
    a = write_run(tmp_path / "a", ranks=2, steps=40, bound="compute", step_s=0.050, jitter=0.0)
    b = write_run(tmp_path / "b", ranks=4, steps=40, bound="comm", step_s=0.0625, jitter=0.0)
    (da, ma), (db, mb) = analyse_and_model(a), analyse_and_model(b)
    c = compare(ma, mb, da, db)
    sc = c["scaling"]
    # Per-rank throughput 32/0.0625 over 32/0.050 = 0.8.
    assert sc["efficiency"] == pytest.approx(0.8, rel=1e-3)
    assert (sc["smaller"], sc["larger"]) == (2, 4)
    assert "80%" in sc["text"]
    # Without the analysis documents, the report models give the same figure.
    assert compare(ma, mb)["scaling"]["efficiency"] == pytest.approx(0.8, rel=1e-3)


def test_compare_command_writes_html_and_markdown(tmp_path):
    a = write_run(tmp_path / "a", ranks=2, steps=40, bound="data", step_s=0.05, seed=5)
    b = write_run(tmp_path / "b", ranks=2, steps=40, bound="compute", step_s=0.03, seed=6)
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "diag", "compare", str(a), str(b), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The change helped")
    assert "data-bound to compute-bound" in proc.stdout
    page = (out / "compare.html").read_text()
    assert "Did the change help?" in page and 'id="fig-compare-phases"' in page
    md = (out / "compare.md").read_text()
    assert "| median step (ms) |" in md
    assert json.loads((out / "compare.json").read_text())["step_time"]["result"] == "helped"
    bad = subprocess.run([sys.executable, "-m", "diag", "compare", str(a), str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("diag: error:")


def test_a_saved_analysis_nested_too_deep_is_one_error_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    proc = subprocess.run([sys.executable, "-m", "diag", "compare", str(deep), str(deep), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("diag: error:") == 1 and "not a readable JSON file" in proc.stderr, proc.stderr
