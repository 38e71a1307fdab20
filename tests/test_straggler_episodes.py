"""Stragglers over time: episodes told apart above and below each threshold, and on real agent
runs of 3 gloo ranks with an induced persistent, rotating and transient straggler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.straggler_episodes import episode_finding, straggler_episodes
from diag.demo import late_rank
from diag.diagnosis_document import diagnosis_in_summary
from tests import straggler_worker as worker

REPO = Path(__file__).resolve().parents[1]
TREE = load_tree()
TH = TREE.thresholds
STEP_MS = 100.0


def _ranks(n_steps: int, world: int, late, jitter_ms: float = 0.2, traced=(), seed: int = 0) -> dict:
    """Ranks' analysed steps whose data wait is 1 ms plus `late(step, rank)` ms, with a little noise; steps in
    `traced` carry a trace's wait share instead (the late rank waits least)."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in range(world):
        steps = []
        for i in range(n_steps):
            extra = late(i, r) or 0.0
            s = {"step": i, "duration_ms": STEP_MS, "data_wait_ms": 1.0 + extra + rng.normal(0, jitter_ms),
                 "evidence": "sampled", "start_unix": 1000.0 + i * STEP_MS / 1000.0}
            if i in traced:
                # Pace = step less waiting: the late rank waits 0, its peers wait for it.
                others_late = max(late(i, k) or 0.0 for k in range(world))
                wait_ms = others_late - extra + rng.normal(0, jitter_ms) + 1.0
                s.update(evidence="trace", data_wait_ms=1.0, shares={"wait": wait_ms / STEP_MS})
            steps.append(s)
        out[r] = steps
    return out


def _one(result) -> dict:
    (e,) = result["episodes"]
    return e


@pytest.mark.parametrize("factor, found", [(1.2, True), (0.8, False)])
def test_a_step_is_straggled_above_the_minimum_share_of_the_step(factor, found):
    lag = factor * TH["straggler_episode_min_share"] * STEP_MS
    result = straggler_episodes(_ranks(40, 3, lambda i, r: lag if r == 1 else 0.0), TREE)
    assert bool(result["episodes"]) is found, result["episodes"]
    if found:
        assert _one(result)["kind"] == "persistent" and _one(result)["rank"] == 1


@pytest.mark.parametrize("seed", range(5))
def test_data_waits_that_scatter_more_than_the_minimum_share_make_no_episode(seed):
    """No rank is late; each step's data waits scatter by 8 ms, above the 5 ms minimum share, so
    some rank is always ahead of the median by more than it: the run's own noise band holds them."""
    noisy = _ranks(200, 4, lambda i, r: 0.0, jitter_ms=8.0, seed=seed)
    result = straggler_episodes(noisy, TREE)
    assert result["noise_ms"]["data_wait"] > TH["straggler_episode_min_share"] * STEP_MS
    assert result["episodes"] == []


@pytest.mark.parametrize("share, kind", [(0.9, "persistent"), (0.7, "rotating")])
def test_one_rank_late_in_most_steps_is_persistent_else_rotating(share, kind):
    """Rank 1 is the late one in `share` of the steps, rank 2 in the rest (spread evenly)."""
    n = 50
    others = set(np.linspace(0, n - 1, round(n * (1 - share))).astype(int).tolist())
    result = straggler_episodes(_ranks(n, 3, lambda i, r: 20.0 if r == (2 if i in others else 1) else 0.0), TREE)
    e = _one(result)
    assert e["kind"] == kind and e["steps"] == n and e["straggled_steps"] == n
    assert (e["rank"] == 1) is (kind == "persistent")


@pytest.mark.parametrize("burst, kind", [(26, "persistent"), (24, "transient")])
def test_one_rank_for_half_the_run_is_persistent_for_less_transient(burst, kind):
    n = 50  # straggler_persistent_fraction 0.5: 25 steps
    e = _one(straggler_episodes(_ranks(n, 2, lambda i, r: 30.0 if r == 0 and 10 <= i < 10 + burst else 0.0), TREE))
    assert (e["kind"], e["rank"], e["first_step"], e["last_step"]) == (kind, 0, 10, 9 + burst)


@pytest.mark.parametrize("burst, kind", [(32, "persistent"), (8, "transient")])
def test_a_burst_among_the_machines_noise_is_no_chronic_straggler(burst, kind):
    """Rank 2 is 150 ms late in `burst` steps from step 20. Elsewhere, as a busy machine makes
    ranks late by scheduling alone, every 8 steps one rank in turn is 8 ms late (above the 5 ms
    minimum share) in 3 of 5 steps. The episodes span most of the run, and rank 2 is late most
    often and carries most of the time they lost; but only a burst spanning the run's persistent
    fraction makes it a persistent straggler: a short one is a transient episode of its own."""
    def late(i, r):
        if 20 <= i < 20 + burst:
            return 150.0 if r == 2 else 0.0
        return 8.0 if i % 8 in (0, 2, 4) and r == (i // 8) % 3 else 0.0
    result = straggler_episodes(_ranks(60, 3, late), TREE)
    costly = max(result["episodes"], key=lambda e: e["cost_ms"])
    assert (costly["kind"], costly["rank"], result["pattern"]) == (kind, 2, kind), result["episodes"]
    assert sum(e["steps"] for e in result["episodes"]) >= TH["straggler_persistent_fraction"] * 60
    if kind == "transient":
        assert (costly["first_step"], costly["last_step"]) == (16, 28)


@pytest.mark.parametrize("lead_ms, dominant", [(8.0, True), (30.0, False)])
def test_the_median_lateness_is_the_named_ranks(lead_ms, dominant):
    """Rank 0 is 40 ms late in steps 10-21, except that rank 1 leads by `lead_ms` in every second
    of them. By 8 ms, rank 0 carries most of the lost time and names the episode: its lateness is
    rank 0's (40 ms, where every late step's median is 24 ms). By 30 ms the episode rotates, and
    its lateness is every late step's."""
    def late(i, r):
        if not 10 <= i < 22:
            return 0.0
        return (lead_ms if r == 1 else 0.0) if i % 2 else (40.0 if r == 0 else 0.0)

    e = _one(straggler_episodes(_ranks(60, 3, late), TREE))
    assert (e["first_step"], e["last_step"], e["rank"] == 0) == (10, 21, dominant)
    expected = 40.0 if dominant else float(np.median([40.0] * 6 + [lead_ms] * 6))
    assert e["median_lateness_ms"] == pytest.approx(expected, abs=0.8)


@pytest.mark.parametrize("gap, episodes", [(2, 1), (3, 2)])
def test_gaps_up_to_the_limit_are_bridged(gap, episodes):
    late = set(range(10, 20)) | set(range(20 + gap, 30 + gap))
    result = straggler_episodes(_ranks(60, 2, lambda i, r: 30.0 if r == 1 and i in late else 0.0), TREE)
    assert len(result["episodes"]) == episodes


@pytest.mark.parametrize("run, found", [(3, True), (2, False)])
def test_an_episode_needs_its_minimum_steps(run, found):
    result = straggler_episodes(_ranks(40, 2, lambda i, r: 30.0 if r == 1 and 20 <= i < 20 + run else 0.0), TREE)
    assert bool(result["episodes"]) is found


def test_traced_steps_are_judged_on_pace_with_their_own_noise():
    """In traced steps the late rank is the one whose pace is longest (it waits least), though
    its data wait is no longer than its peers'."""
    traced = set(range(40))
    result = straggler_episodes(_ranks(40, 3, lambda i, r: 25.0 if r == 2 else 0.0, traced=traced), TREE)
    assert result["traced_steps"] == 40 and _one(result)["rank"] == 2
    assert _one(result)["median_lateness_ms"] == pytest.approx(25.0, abs=1.0)


def test_the_cost_is_the_lateness_beyond_the_lower_median_rank():
    """With two ranks the median is the faster one: the late rank's whole lag is the job's loss."""
    result = straggler_episodes(_ranks(30, 2, lambda i, r: 30.0 if r == 1 else 0.0, jitter_ms=0.0), TREE)
    e = _one(result)
    assert e["cost_ms"] == pytest.approx(30 * 30.0) and e["share_of_job_time"] == pytest.approx(0.3)
    assert e["ongoing"] and e["start_unix"] == 1000.0 and e["end_unix"] == pytest.approx(1003.0)
    f = episode_finding(result, TREE)
    assert f["id"] == "straggler_persistent" and f["severity"] == "warning" and "rank 1" in f["message"]


def test_one_rank_gives_nothing_to_compare():
    assert straggler_episodes(_ranks(30, 1, lambda i, r: 0.0), TREE) is None


# -- real agent runs ---------------------------------------------------------------------------------------

KINDS = ("persistent", "rotating", "transient")
WORLD = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.conftest import free_port_pair

    out = tmp_path_factory.mktemp("stragglers")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "straggler_worker.py"), str(out),
                           str(free_port_pair()), str(WORLD), ",".join(KINDS)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: out / k for k in KINDS}


def _analysed(run_dir: Path) -> dict:
    from diag.analyzers.analyze import analyze_paths

    return analyze_paths([str(run_dir)])


def _records(run_dir: Path) -> dict[int, dict[int, dict]]:
    out = {}
    for r in range(WORLD):
        recs = [json.loads(line) for p in sorted((run_dir / f"rank-{r:05d}" / "steps").glob("steps-*.jsonl"))
                for line in p.read_text().splitlines() if line.strip()]
        out[r] = {rec["step"]: rec for rec in recs}
    return out


def _induced_cost_s(run_dir: Path, first: int, last: int) -> float:
    """The job's loss over steps [first, last] straight from the step records: per step, the latest
    rank's data wait beyond the lower median rank's."""
    recs = _records(run_dir)
    total = 0.0
    for step in range(first, last + 1):
        waits = sorted(recs[r][step]["data_wait_s"] for r in range(WORLD))
        total += waits[-1] - waits[(WORLD - 1) // 2]
    return total


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_an_induced_straggler_is_told_apart(runs, kind):
    doc = _analysed(runs[kind])
    result = doc.diagnosis.straggler_episodes
    costly = max(result["episodes"], key=lambda e: e["cost_ms"])
    assert result["pattern"] == kind == costly["kind"], result["episodes"]
    if kind == "persistent":
        assert costly["rank"] == 1 and costly["steps"] >= 0.9 * worker.STEPS
    elif kind == "rotating":
        assert costly["rank"] is None and set(costly["ranks"]) == set(range(WORLD))
        assert costly["steps"] >= 0.9 * worker.STEPS
    else:
        burst = [s for s in range(worker.STEPS) if late_rank(kind, s, WORLD, worker.STEPS) is not None]
        assert costly["rank"] == WORLD - 1
        assert costly["first_step"] <= burst[0] and costly["last_step"] >= burst[-1]
        assert costly["steps"] < TH["straggler_persistent_fraction"] * worker.STEPS
    # Every late batch cost its delay; the loss equals what the records show, not only the sleep.
    straggled = costly["straggled_steps"]
    assert costly["median_lateness_ms"] == pytest.approx(worker.DELAY_S * 1000.0, rel=0.3), result["episodes"]
    induced = _induced_cost_s(runs[kind], costly["first_step"], costly["last_step"])
    assert costly["cost_ms"] / 1000.0 == pytest.approx(induced, rel=0.15, abs=straggled * 0.002)
    finding = next(f for f in doc.diagnosis.findings if f["id"] == f"straggler_{kind}")
    assert finding["message"].startswith("Rotating" if kind == "rotating" else kind.capitalize())


@pytest.mark.slow
def test_the_report_and_the_exporter_show_the_episodes(runs, tmp_path):
    from diag.exporter.registry import render_text
    from diag.exporter.runtime import Handle

    run_dir = runs["persistent"]
    subprocess.run([sys.executable, "-m", "diag", "report", str(run_dir), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    html = (tmp_path / "report.html").read_text()
    assert 'id="fig-heat-late"' in html and "Straggler episodes" in html
    summary = json.loads((tmp_path / "summary.json").read_text())
    chart = summary["diagnosis"]["straggler_episodes"]["chart"]
    late_row = sorted(x for x in chart["lateness_ms"][chart["ranks"].index(1)] if x is not None)
    assert late_row[len(late_row) // 10] > 10.0  # rank 1 late across the run (its first batch aside)
    h = Handle({"run": "r", "rank": "0", "local_rank": 0, "host": "h", "gpu": ""})
    h.observe_diagnosis(diagnosis_in_summary(summary))
    text = render_text([h.state]).decode()
    assert 'diag_job_straggler_episode_active{' in text
    active = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("diag_job_straggler_episode_active{")}
    assert active == {"persistent": 1.0, "rotating": 0.0, "transient": 0.0}


WINDOWS = ((4, 5, 6), (14, 15, 16), (24, 25, 26))


@pytest.mark.parametrize("late_windows, episodes", [((1,), 0), ((1, 2), 2), ((0, 1, 2), 3)])
def test_a_pace_late_in_traces_counts_only_where_the_rank_is_late_across_them(late_windows, episodes):
    """Rank 1's pace is late in some of three profiler windows. In one of them (3 of 9 traced
    steps, under straggler_step_fraction) it is no episode: a window's steps are not independent
    draws. In two (6 of 9) or three they are, one a window, and the rank is a persistent straggler:
    late across most of the steps that could show it (the steps between windows can not)."""
    late = {s for w in late_windows for s in WINDOWS[w]}
    traced = {s for w in WINDOWS for s in w}
    result = straggler_episodes(_ranks(40, 2, lambda i, r: 25.0 if r == 1 and i in late else 0.0, traced=traced),
                                TREE)
    assert len(result["episodes"]) == episodes, result["episodes"]
    assert all(e["rank"] == 1 and e["kind"] == "persistent" for e in result["episodes"])


def test_a_late_batch_inside_a_window_counts_on_its_data_wait():
    """Rank 1's batches are late over steps 13-17; steps 14-16 are traced, where its pace is no later
    than its peer's (the trace put the wait elsewhere): the data wait still says it."""
    ranks = _ranks(40, 2, lambda i, r: 30.0 if r == 1 and 13 <= i <= 17 else 0.0, traced={14, 15, 16})
    for s in ranks[1]:
        if s["step"] in (14, 15, 16):
            s.update(data_wait_ms=31.0, shares={"wait": 0.01})
    for s in ranks[0]:
        if s["step"] in (14, 15, 16):
            s.update(shares={"wait": 0.01})
    e = _one(straggler_episodes(ranks, TREE))
    assert (e["kind"], e["rank"], e["first_step"], e["last_step"]) == ("transient", 1, 13, 17)
