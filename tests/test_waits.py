"""Waiting for peers apart from communication, peer verdicts, and borderline verdicts from the run's noise."""

from __future__ import annotations

import copy

import msgspec
import pytest
from rank_documents import ranks_of

from diag.analyzers.analysis_types import CauseFacts, JobFacts, TraceRankFacts, document_ranks, rank_document
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis import peers
from diag.analyzers.diagnosis.borderline import borderline
from diag.analyzers.diagnosis.rank import judge_trace
from diag.analyzers.diagnosis.steady import robust_sigma as noise
from diag.analyzers.diagnosis.verdict import job_verdict
from diag.analyzers.job import waits


@pytest.fixture(scope="module")
def tree():
    return dt.load_tree()


def _rank(rank, comm_us, ts, dur, exposed, compute_us=0.0, host_us=None, step_us=100.0):
    """One rank, one 100 us step starting at 0, one all-reduce at `ts` lasting `dur`, exposed on `exposed`."""
    host_us = step_us - comm_us - compute_us if host_us is None else host_us
    shares = {"data": 0.0, "host": host_us / step_us, "comm": comm_us / step_us, "wait": 0.0, "memory": 0.0,
              "compute": compute_us / step_us}
    m = {f"{c}_share": v for c, v in shares.items() if c != "wait"}
    m.update(dt.share_ratios(shares))
    return TraceRankFacts(
        rank=rank, shares=dict(shares), measurements=dict(m),
        steps=[{"step": 1, "start_us": 0.0, "duration_ms": step_us / 1000, "shares": dict(shares),
                "measurements": dict(m), "evidence": "trace", "flops": None}],
        causes=CauseFacts(collectives=[{"name": "all_reduce", "pg": 0, "seq": 7, "ts_us": ts, "dur_us": dur,
                                        "bytes": 1024, "on": "device", "step": 1, "exposed": exposed}]),
    )


def test_the_early_rank_waits_at_the_head_of_the_collective(tree):
    # Rank 0 arrives at 20 and waits until rank 1 arrives; both finish together, 10 us of transfer.
    # Rank 0's collective [20, 80) is exposed on [40, 80): of its 50 us head only [40, 70) costs time.
    r0 = _rank(0, comm_us=40.0, ts=20.0, dur=60.0, exposed=[[40.0, 80.0]], compute_us=50.0, host_us=10.0)
    r1 = _rank(1, comm_us=10.0, ts=70.0, dur=10.0, exposed=[[70.0, 80.0]], compute_us=80.0, host_us=10.0)
    before = copy.deepcopy([r0, r1])
    split, facts = waits.split_waits({0: [r0], 1: [r1]})
    assert [r0, r1] == before  # new values: the inputs are left as they were
    assert facts == {"matched": 1, "waits_for": {0: 1}}
    j0, j1 = judge_trace(split[0][0], tree), judge_trace(split[1][0], tree)
    r0, r1 = rank_document(j0), rank_document(j1)
    s0 = r0["steps"][0]["shares"]
    assert s0["wait"] == pytest.approx(0.30) and s0["comm"] == pytest.approx(0.10)
    assert sum(s0.values()) == 1.0
    assert r1["steps"][0]["shares"]["wait"] == 0.0 and r1["steps"][0]["shares"]["comm"] == pytest.approx(0.10)
    assert r0["measurements"]["wait_share"] == pytest.approx(0.30) and r0["waits_for"] == 1
    assert r0["wait_split"] == {"measured": True, "matched_collectives": 1}
    # 30% waiting: rank 0 is handed to rank 1, which is compute-bound; nobody is comm-bound.
    assert r0["bound"] == dt.PEER and r1["bound"] == "compute"
    r0, r1 = (rank_document(r) for r in peers.resolve([j0, j1], tree))
    assert r0["bound"] == "compute" and r0["bound_via"] == 1
    node = next(n for n in r0["path"] if n["node"] == "peer_wait")
    assert node["peer"] == 1 and "rank 1, which is compute-bound" in node["question"]
    assert r0["fixes"][0].startswith("Speed up rank 1")
    assert r0["steps"][0]["bound"] == "compute"


def test_a_single_trace_keeps_its_attribution_and_says_why(tree):
    r = _rank(0, comm_us=40.0, ts=20.0, dur=60.0, exposed=[[40.0, 80.0]], compute_us=50.0)
    before = copy.deepcopy(r)
    split, facts = waits.split_waits({0: [r]})
    assert facts == {"matched": 0, "waits_for": {}}
    r = split[0][0]
    assert r.wait_split == {"measured": False, "reason": "a single rank: no peer to match collectives with"}
    assert r.shares == before.shares and "wait_share" not in r.measurements


def test_an_analysis_without_exposure_records_is_not_split(tree):
    r0 = _rank(0, comm_us=40.0, ts=20.0, dur=60.0, exposed=[[40.0, 80.0]], compute_us=50.0)
    r1 = _rank(1, comm_us=10.0, ts=70.0, dur=10.0, exposed=[[70.0, 80.0]], compute_us=80.0)
    del r0.causes.collectives[0]["exposed"]
    r0 = waits.split_waits({0: [r0], 1: [r1]})[0][0][0]
    assert r0.wait_split["measured"] is False and "again" in r0.wait_split["reason"]
    assert r0.waits_for is msgspec.UNSET  # not split: the rank it waits for is not measured either
    assert r0.steps[0]["shares"]["comm"] == pytest.approx(0.40)


def test_ranks_that_wait_for_each_other_in_turn_keep_their_own_verdict(tree):
    a = {"rank": 0, "bound": dt.PEER, "waits_for": 1, "findings": [], "steps": [],
         "measurements": {"data_share": 0.0, "host_share": 0.05, "comm_share": 0.05, "wait_share": 0.3,
                          "memory_share": 0.5, "compute_share": 0.1, "memory_to_compute": 5.0}}
    b = {**copy.deepcopy(a), "rank": 1, "waits_for": 0}
    a, b = (rank_document(r) for r in peers.resolve(document_ranks({"ranks": [a, b]}), tree))
    assert a["bound"] == b["bound"] == "memory"
    node = next(n for n in a["path"] if n["node"] == "peer_wait")
    assert node["answer"] == "no" and "in turn" in node["forced"]


def test_job_verdict_on_ranks_that_all_wait_is_their_own_work(tree):
    m = {"data_share": 0.0, "host_share": 0.05, "comm_share": 0.05, "wait_share": 0.3,
         "memory_share": 0.1, "compute_share": 0.5, "memory_to_compute": 0.2}
    ranks = [{"rank": 0, "bound": "compute", "measurements": m, "steps": []}]
    job = job_verdict(document_ranks({"ranks": ranks}), JobFacts(), tree)
    assert job.bound == "compute"
    assert next(n for n in job.path if n["node"] == "peer_wait")["forced"]


def _steps(values, metric="comm_share"):
    out = []
    for i, v in enumerate(values):
        sh = {"data": 0.0, "host": 0.05, "comm": v, "wait": 0.0, "memory": 0.05, "compute": 0.9 - v}
        out.append({"step": i, "shares": sh, "duration_ms": 10.0})
    return out


def _noisy_rank(values):
    steps = _steps(values)
    mean = {c: sum(s["shares"][c] for s in steps) / len(steps) for c in dt.CLASSES}
    return {"rank": 0, "steps": steps, "shares": mean}


def test_borderline_when_the_deciding_share_is_within_the_steps_scatter(tree):
    # Exposed comm scatters 0.12-0.28 around 0.19: the 20% threshold is well inside the noise.
    noisy = [0.12, 0.28, 0.15, 0.25, 0.19, 0.13, 0.26, 0.18]
    job = job_verdict(document_ranks({"ranks": [_noisy_rank(noisy)]}), JobFacts(), tree)
    assert job.bound == "compute"
    edge = job.borderline
    assert edge["candidates"] == ["compute", "comm"] and edge["node"] == "exposed_comm"
    assert edge["noise"] == pytest.approx(noise(noisy))
    assert abs(edge["value"] - 0.20) <= edge["noise"]
    # The same mean with steady steps is a clear verdict.
    steady = [0.19 + 0.001 * (i % 2) for i in range(8)]
    clear = job_verdict(document_ranks({"ranks": [_noisy_rank(steady)]}), JobFacts(), tree)
    assert clear.bound == "compute" and clear.borderline is None


def test_borderline_needs_a_different_verdict_on_the_other_branch(tree):
    m = {"data_share": 0.1, "host_share": 0.05, "comm_share": 0.02, "wait_share": 0.0,
         "memory_share": 0.1, "compute_share": 0.73, "memory_to_compute": 0.14, "busy_share": 0.85}
    path = dt.evaluate(m, tree)["path"]
    steps = [dict(m, data_share=v) for v in (0.0, 0.3, 0.05, 0.2, 0.1)]  # noisy data: spread 0.15 around 0.1
    edge = borderline(m, path, steps, tree, "compute")
    assert edge["candidates"] == ["compute", "data"]
    assert borderline(m, path, steps, tree, None) is None
    assert noise([0.1, 0.2]) is None  # too few steps for a spread


@pytest.mark.parametrize("busy,edge", [(0.4949, False), (0.4951, True), (0.5049, True), (0.5051, False)])
def test_a_whole_trace_share_within_its_resolution_of_the_threshold_is_borderline(tree, busy, edge):
    """No steps, so no scatter: a deciding share within borderline_resolution (1%) of its
    threshold, the device busy for under 50% of the step, is still borderline host/compute."""
    assert tree.thresholds["borderline_resolution"] == 0.01
    m = {"data_share": 0.0, "host_share": 1 - busy, "comm_share": 0.0, "wait_share": 0.0,
         "memory_share": 0.0, "compute_share": busy, "memory_to_compute": 0.0, "busy_share": busy}
    v = dt.evaluate(m, tree)
    found = borderline(m, v["path"], [], tree, v["bound"])
    assert (found is not None) is edge
    if edge:
        assert found["metric"] == "busy_share" and "within its resolution" in found["text"]
        assert sorted(found["candidates"]) == ["compute", "host"]


def test_the_confidence_never_calls_a_measurement_clear_beside_a_borderline_one():
    from diag.analyzers.diagnosis import document

    allt = document.concat({})
    path = {"nodes": [{"metric": "busy_share", "value": 0.499, "threshold": 0.5, "answer": "yes"},
                      {"metric": "memory_to_compute", "value": 0.1, "threshold": 1.0, "answer": "no"}]}
    edge = {"candidates": ["host", "compute"], "metric": "busy_share", "text": "borderline host/compute"}
    c = document._confidence("host", allt, path, [], 0, 1, edge)
    assert not any("clear of its threshold" in r for r in c["reasons"])
    assert any("busy_share = " in r and "within 15% of its threshold" in r for r in c["reasons"])


def test_a_single_rank_of_a_job_says_its_waiting_is_not_measured(real_traces, tmp_path):
    import json

    from diag.analyzers.analyze import analyze_paths
    from diag.report import write_report_from_analysis

    doc = analyze_paths([real_traces / "job128_rank0_sampled.json.gz"])
    (rank,) = ranks_of(doc)
    assert rank["wait_split"] == {"measured": False, "reason": "a single rank: no peer to match collectives with"}
    assert rank["waits_for"] is None and "wait_share" not in rank["measurements"]
    write_report_from_analysis(doc, tmp_path)
    missing = [m["what"] for m in json.loads((tmp_path / "summary.json").read_text())["missing"]]
    assert "Waiting for other ranks is not measured on 1 of 128 rank(s) (a single rank: no peer to match " \
           "collectives with)." in missing
    # The pair is split: neither rank is left unmeasured.
    pair = analyze_paths([real_traces / "job128_rank0_sampled.json.gz", real_traces / "job128_rank1_sampled.json.gz"])
    assert all(r["wait_split"]["measured"] for r in ranks_of(pair))
