"""Cross-rank analysis: stragglers, waiting, job verdict and scaling, on real multi-process jobs and traces."""

from __future__ import annotations

import gzip
import importlib
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from conftest import FIXTURES

from diag.analyzers.analysis_types import Analysis, Job, analysis_from_json, rank_document
from diag.analyzers.analyze import analyze_trace, job_facts, judged_ranks, split_waits
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.document import build_diagnosis
from diag.analyzers.diagnosis.scaling import scaling_efficiency
from diag.analyzers.diagnosis.verdict import job_verdict
from diag.analyzers.job.cross_rank import SYMMETRIC, match_collectives
from diag.analyzers.trace.analysis import trace_facts
from diag.errors import DiagInputError

# What the analysis measures by under the default tree.
FACTS = load_tree().facts


def _load_generator():
    # Importable by name: gloo workers started with "spawn" unpickle their entry point from it.
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    return importlib.import_module("make_cpu_traces")


gen = _load_generator()

# Both ranks spend 100 ms off-CPU per step (standing in for device work) before three
# all-reduces. In the "straggler" phase rank 1 sleeps 40 ms more; the "balanced" phase is the
# same job with equal work. A sleep is immune to CPU contention but not to a busy machine's
# wake-up delays: beside a CPU-bound job, the rank sharing its core woke a steady 1.8 ms late
# after a 30 ms sleep, 10% of the step in waits imposed, which is a straggler; 100 ms keeps
# such delays under the share of the step a straggler must cost. Six profiled steps: with
# three, a rank descheduled in two of them under the parallel suite looked like a straggler
# whose work explains its lateness (2 of 3 is a coin's toss, 6 of 6 is not).
DELAY_S = 0.04
WORK_S = 0.1
ACTIVE = 6
CLASSES = [
    gen.GlooPhase("balanced", numel=1 << 16, grads=3, compute=64, work_s=WORK_S, active=ACTIVE),
    gen.GlooPhase("straggler", numel=1 << 16, grads=3, compute=64, work_s=WORK_S, late_rank=1, delay_s=DELAY_S,
                  active=ACTIVE),
]


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory):
    """One real 2-process gloo job under torch.profiler, two profiled phases."""
    out = tmp_path_factory.mktemp("gloo")
    return gen.run_gloo_job(out, CLASSES, world=2, timeout=120, start_method="fork")


def _ranks(paths):
    """The ranks as the facade gives them: waits split from transfer, then each judged."""
    return judged_ranks(split_waits([trace_facts(str(p), FACTS) for p in paths]), load_tree())


def _job(ranks):
    """The job block as the facade gives it: cross-rank facts, then the diagnosis's verdict."""
    tree = load_tree()
    return job_verdict(ranks, job_facts([r.facts for r in ranks], tree), tree)


def _with_facts(r, **changes):
    """A judged rank whose facts differ as given."""
    return msgspec.structs.replace(r, facts=msgspec.structs.replace(r.facts, **changes))


def _finding(job, fid):
    return next((f for f in job.findings if f["id"] == fid), None)


def _judged_finding(ranks, job, fid):
    """A finding of the diagnosis of these ranks and job facts (missing ranks are its call)."""
    _, diagnosis = build_diagnosis(ranks, job)
    return next((f for f in diagnosis.findings if f["id"] == fid), None)


@pytest.mark.slow
def test_sleeping_rank_is_named_straggler_with_evidence(gloo_job):
    ranks = _ranks(gloo_job["straggler"])
    assert [r.rank for r in ranks] == [0, 1]
    job = _job(ranks)

    assert [s["rank"] for s in job.stragglers] == [1], job.stragglers
    ev = job.stragglers[0]["evidence"]
    # Rank 0 waits out the extra sleep in every step; rank 1 hardly waits at all.
    delay_ms = DELAY_S * 1000
    assert ev["blame_share"] >= 0.75
    assert 0.5 * delay_ms <= ev["peers_median_wait_ms_per_step"] <= 1.5 * delay_ms
    assert 0.5 * delay_ms <= ev["imposed_wait_ms_per_step"] <= 1.5 * delay_ms
    assert ev["own_wait_ms_per_step"] < 0.5 * ev["peers_median_wait_ms_per_step"]
    waits = {r["rank"]: r for r in job.rank_waits}
    # The late rank spends the least time inside collectives: it never waits in them. (Only the
    # first of each step's all-reduces absorbs the delay, so medians would compare noise; totals don't.)
    assert waits[1]["comm_ms"] < waits[0]["comm_ms"]
    assert waits[0]["wait_ms"] > 5 * waits[1]["wait_ms"]
    assert waits[0]["wait_fraction"] > waits[1]["wait_fraction"]
    # Rank 1 does more outside communication (the sleep) than rank 0.
    if ev["work_ms"] is not None:
        assert ev["work_ms"] > ev["median_work_ms"]
    assert "Rank 1" in job.stragglers[0]["message"]

    # Waiting is not communication: rank 0's wait for rank 1 is its own class, and no rank is
    # comm-bound for it. The job follows the critical path: the straggler's own bound.
    r0, r1 = (rank_document(r) for r in ranks)
    assert r0["waits_for"] == 1 and r0["wait_split"]["measured"] is True
    assert r0["shares"]["wait"] >= 0.5 * DELAY_S * 1000 / statistics.median(s["duration_ms"] for s in r0["steps"])
    assert r0["shares"]["wait"] > 5 * r1["shares"]["wait"]
    assert "comm" not in {r0["bound"], r1["bound"]}, (r0["bound"], r1["bound"])
    assert r1["bound"] in ("host", "compute", "memory")
    assert job.bound == r1["bound"]
    assert job.measurements["ranks"] == [1]
    # Rank 0 waits more than the threshold: its verdict is rank 1's, and its path says so.
    node = next(n for n in r0["path"] if n["node"] == "peer_wait")
    assert node["answer"] == "yes" and node["peer"] == 1 and "rank 1" in node["question"]
    assert r0["bound"] == r1["bound"] and r0["bound_via"] == 1
    assert _finding(job, "straggler")["evidence"]["stragglers"] == [1]
    assert _finding(job, "straggler_induced_comm") is None and _finding(job, "slow_collectives") is None
    assert job.world_size == 2 and job.missing_ranks == []


@pytest.mark.slow
def test_balanced_job_names_no_straggler(gloo_job):
    job = _job(_ranks(gloo_job["balanced"]))
    assert job.stragglers == [], job.stragglers
    assert _finding(job, "straggler_induced_comm") is None and _finding(job, "straggler") is None
    # Every all-reduce of the profiled steps is matched on both ranks.
    assert job.collectives["matched"] >= ACTIVE * CLASSES[0].grads


def _shift_trace(src: Path, dst: Path, offset_us: float) -> None:
    with gzip.open(src) as f:
        doc = json.load(f)
    for e in doc["traceEvents"]:
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] = e["ts"] + offset_us
    with gzip.open(dst, "wt") as f:
        json.dump(doc, f)


@pytest.mark.slow
def test_clock_skew_between_ranks_changes_nothing(gloo_job, tmp_path):
    paths = gloo_job["straggler"]
    skewed = tmp_path / paths[1].name
    _shift_trace(paths[1], skewed, offset_us=3.6e9 + 0.123)  # an hour and a bit ahead
    a = _job(_ranks(paths))
    b = _job(_ranks([paths[0], skewed]))
    assert [s["rank"] for s in b.stragglers] == [s["rank"] for s in a.stragglers] == [1]
    assert b.bound == a.bound and b.cause == a.cause
    assert b.collectives["matched"] == a.collectives["matched"]
    for ra, rb in zip(a.rank_waits, b.rank_waits):
        for k in ("wait_ms", "comm_ms", "late_fraction", "blame_share", "imposed_wait_ms_per_step"):
            assert rb[k] == pytest.approx(ra[k], abs=0.01), k


def test_network_bound_job_is_not_blamed_on_a_rank():
    """The committed gloo fixture: big all-reduces, equal ranks -> slow collectives, no straggler."""
    ranks = _ranks(
        [FIXTURES / "cpu_comm_rank0.pt.trace.json.gz", FIXTURES / "cpu_comm_rank1.pt.trace.json.gz"]
    )
    job = _job(ranks)
    assert job.stragglers == []
    assert job.bound == "comm"
    assert job.cause == "network"
    f = _finding(job, "slow_collectives")
    assert f is not None and f["evidence"]["transfer_fraction_of_comm"] >= 0.5
    assert _finding(job, "straggler_induced_comm") is None


def _waits_by_order(ranks):
    """Independent reference: pair collectives by order within (pg, name, size of symmetric
    collectives), wait = dur - min."""
    seqs = {}
    for r in ranks:
        kind = "device" if any(c.get("on") == "device" for c in r["collectives"]) else "host"
        per = defaultdict(list)
        for c in sorted(r["collectives"], key=lambda c: c["ts_us"]):
            if c.get("on", kind) == kind:
                size = c["bytes"] if c["name"] in SYMMETRIC else None
                per[(c["pg"], c["name"], size, c.get("step"))].append(c["dur_us"])
        seqs[r["rank"]] = per
    total = defaultdict(float)
    matched = 0
    keys = set().union(*(s.keys() for s in seqs.values()))
    for key in keys:
        n = max(len(s.get(key, [])) for s in seqs.values())
        for i in range(n):
            durs = {rk: s[key][i] for rk, s in seqs.items() if len(s.get(key, [])) > i}
            if len(durs) < 2:
                continue
            matched += 1
            lo = min(durs.values())
            for rk, d in durs.items():
                total[rk] += d - lo
    return matched, total


def test_job128_two_real_ranks(real_traces):
    ranks = _ranks(
        [real_traces / "job128_rank0_sampled.json.gz", real_traces / "job128_rank1_sampled.json.gz"]
    )
    assert {r.rank for r in ranks} == {0, 1}
    assert all(r.facts.causes.collectives for r in ranks), "the analyzer found no collectives in the job128 traces"
    job = _job(ranks)
    assert job.world_size == 128
    assert job.missing_ranks == list(range(2, 128))
    # The sampled traces hold different subsets of the calls: some cannot be paired.
    assert job.collectives["count_mismatch"] and _finding(job, "collective_count_mismatch") is None
    assert _judged_finding(ranks, job, "collective_count_mismatch")["severity"] == "info"
    missing = _judged_finding(ranks, job, "missing_ranks")
    assert missing is not None and "126 of 128" in missing["message"] and missing["severity"] == "warning"
    assert job.collectives["source"] == "device"
    if job.collectives["matched_by"] == "order":
        matched, total = _waits_by_order([rank_document(r) for r in ranks])
        assert job.collectives["matched"] == matched
        for row in job.rank_waits:
            assert row["wait_ms"] == pytest.approx(total[row["rank"]] / 1000, abs=0.002)
    # The wait split moves time from comm to wait, step by step, and nothing else; no rank's
    # exposed wait exceeds the time it spent waiting in matched collectives.
    groups = match_collectives({r.rank: r.facts.causes.collectives for r in ranks})["groups"]
    assert groups
    raw_wait_ms = defaultdict(float)
    for g in groups:
        lo = min(g["dur_us"].values())
        for rk, d in g["dur_us"].items():
            raw_wait_ms[rk] += (d - lo) / 1000
    single = [trace_facts(str(real_traces / f"job128_rank{r}_sampled.json.gz"), FACTS) for r in (0, 1)]
    for before, after in zip(single, ranks):
        for sb, sa in zip(before.steps, after.facts.steps):
            assert sb["shares"]["wait"] == 0.0
            assert sa["shares"]["comm"] + sa["shares"]["wait"] == pytest.approx(sb["shares"]["comm"], abs=1e-6)
            for c in ("data", "host", "memory", "compute"):
                assert sa["shares"][c] == pytest.approx(sb["shares"][c], abs=1e-6)
        exposed_wait_ms = sum(s["shares"]["wait"] * s["duration_ms"] for s in after.facts.steps)
        assert 0 < exposed_wait_ms <= raw_wait_ms[after.rank] + 1e-6
    # The job verdict is the critical-path rank's own, on its own numbers.
    (pace,) = job.measurements["ranks"]
    assert job.bound == next(r.verdict.bound for r in ranks if r.rank == pace)
    for s in job.stragglers:
        assert s["evidence"]["blame_share"] >= 0.75


def test_missing_duplicate_and_unknown_ranks():
    r0 = analyze_trace(str(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz"))
    assert r0.facts.world_size == 2
    job = _job([r0])
    assert job.missing_ranks == [1]
    assert "(rank 1)" in _judged_finding([r0], job, "missing_ranks")["message"]
    assert job.stragglers == []
    # One comm-bound rank alone cannot tell waiting from transfer.
    assert job.bound == "comm" and job.cause == "undetermined"
    assert _finding(job, "comm_cause_undetermined") is not None

    # The analysis gives the facts; the findings are the diagnosis's.
    twice = [r0, _with_facts(r0, source="copy.json")]
    job = _job(twice)
    assert job.duplicate_ranks == [{"rank": 0, "source": "copy.json"}] and _finding(job, "duplicate_ranks") is None
    assert "claim the same rank: rank 0 (copy.json)" in _judged_finding(twice, job, "duplicate_ranks")["message"]
    unnamed = [r0, _with_facts(r0, rank=None, source="anon.json")]
    job = _job(unnamed)
    assert job.unnamed_traces == ["anon.json"]
    assert _judged_finding(unnamed, job, "unknown_rank")["message"].startswith("1 trace(s) name no rank")
    assert _job([]).bound is None


def _coll(name, ts, dur, seq=None, pg="0", on="device"):
    return {"name": name, "pg": pg, "seq": seq, "ts_us": ts, "dur_us": dur, "bytes": 4 << 20, "on": on}


def test_sequence_numbers_win_over_order():
    # Rank 1 recorded the two collectives in the opposite order (different streams); the
    # sequence numbers still pair them, and order alone would pair them wrongly.
    by_rank = {
        0: [_coll("all_reduce", 100.0, 500.0, seq=7), _coll("all_reduce", 700.0, 50.0, seq=8)],
        1: [_coll("all_reduce", 90.0, 40.0, seq=8), _coll("all_reduce", 200.0, 100.0, seq=7)],
    }
    m = match_collectives(by_rank)
    assert m["matched_by"] == "seq"
    durs = {g["seq"]: g["dur_us"] for g in m["groups"]}
    assert durs == {7: {0: 500.0, 1: 100.0}, 8: {0: 50.0, 1: 40.0}}
    # Without sequence numbers, order within (pg, name) is the fallback.
    for recs in by_rank.values():
        for c in recs:
            c["seq"] = None
    m = match_collectives(by_rank)
    assert m["matched_by"] == "order" and len(m["groups"]) == 2


def _doc(world, step_ms, samples=None):
    steps = [
        {"step": i, "duration_ms": step_ms * (1 + 0.01 * i), **({"samples": samples} if samples else {})}
        for i in range(4)
    ]
    return analysis_from_json({
        "ranks": [{"rank": r, "world_size": world, "steps": steps} for r in range(world)],
        "job": {"world_size": world},
    })


def test_scaling_efficiency_advisory():
    tree = load_tree()
    good = scaling_efficiency(_doc(2, 100.0), _doc(4, 120.0), tree)
    assert good["efficiency"] == pytest.approx(100.0 / 120.0, rel=1e-3)
    assert good["smaller"]["world_size"] == 2 and good["larger"]["world_size"] == 4
    assert good["findings"] == []
    bad = scaling_efficiency(_doc(8, 200.0), _doc(2, 100.0), tree)
    assert bad["efficiency"] == pytest.approx(0.5, rel=1e-3)
    assert bad["speedup"] == pytest.approx(2.0, rel=1e-3)
    assert [f["id"] for f in bad["findings"]] == ["low_scaling_efficiency"]
    # Samples per step count when both runs give them. Strong scaling of a global batch of
    # 64: 32 per rank in 100 ms at world 2, 16 per rank in 60 ms at world 4. Per-rank
    # throughput falls from 320 to 267 samples/s (0.83), though steps got 1.67x faster.
    s = scaling_efficiency(_doc(2, 100.0, samples=32), _doc(4, 60.0, samples=16), tree)
    assert s["unit"] == "samples"
    assert s["efficiency"] == pytest.approx((16 / 60) / (32 / 100), rel=1e-3)
    assert s["findings"] == []
    with pytest.raises(DiagInputError):
        scaling_efficiency(_doc(2, 100.0), _doc(2, 90.0), tree)


def test_scaling_efficiency_takes_the_slowest_rank_of_each_step(gloo_job):
    """On real analyses: rank 0's steps alone (as world 1) against the 2-rank job, whose
    step time is that of its slower rank in each step."""
    ranks = _ranks(gloo_job["balanced"])
    two = Analysis(ranks=ranks, job=_job(ranks))
    one = Analysis(ranks=[_with_facts(ranks[0], world_size=1)], job=Job(world_size=1))
    res = scaling_efficiency(one, two, load_tree())
    step = statistics.median(
        max(s["duration_ms"] for r in ranks for s in r.facts.steps if s["step"] == k)
        for k in {s["step"] for s in ranks[0].facts.steps}
    )
    own = statistics.median(s["duration_ms"] for s in ranks[0].facts.steps)
    assert res["efficiency"] == pytest.approx(own / step, rel=1e-3)


@pytest.mark.slow
def test_the_straggler_finding_names_the_likely_cause(gloo_job):
    """Rank 1 sleeps DELAY_S more per step on the host: the diagnosis says host-side work, by
    about that much per step, and the job verdict is rank 1's own."""
    from diag.analyzers.analyze import analyze_paths

    doc = analyze_paths([str(p) for p in gloo_job["straggler"]], jobs=1)
    (late,) = doc.job.stragglers
    cause = late["likely_cause"]
    assert late["rank"] == 1 and cause["cause"] == "host_work", cause
    excess = cause["evidence"]["host_ms_per_step"] - cause["evidence"]["peers_host_ms_per_step"]
    assert 0.5 * DELAY_S * 1000 <= excess <= 1.5 * DELAY_S * 1000
    finding = next(f for f in doc.job.findings if f["id"] == "straggler")
    assert "Likely cause on rank 1: host-side work" in finding["message"]
    assert doc.job.bound == next(r.verdict.bound for r in doc.ranks if r.rank == 1)


def test_lateness_by_chance_is_the_binomial_tail():
    """Every rank as likely to be a step's late one: on 2 ranks, 2 of 3 steps is a coin toss,
    5 of 5 is 1 in 32; on 8 ranks, 3 of 4 steps is rare."""
    from diag.analyzers.diagnosis.stragglers import late_by_chance

    assert late_by_chance(2, 3, 2) == pytest.approx(0.5)
    assert late_by_chance(3, 3, 2) == pytest.approx(0.125)
    assert late_by_chance(5, 5, 2) == pytest.approx(1 / 32)
    assert late_by_chance(3, 4, 8) == pytest.approx(4 * (1 / 8) ** 3 * (7 / 8) + (1 / 8) ** 4)
    assert load_tree().thresholds["straggler_chance"] == 0.05


@pytest.mark.parametrize("excess_ms,named", [(4.9, False), (5.0, True)])
def test_chance_lateness_needs_the_ranks_own_work_to_explain_half_the_wait(excess_ms, named):
    """A wait of 10 ms imposed: the late rank's work outside communication must exceed its
    peers' median by half of it (straggler_work_explains); unknown work says nothing against."""
    from diag.analyzers.diagnosis.stragglers import _work_explains

    share = load_tree().thresholds["straggler_work_explains"]
    assert share == 0.5
    assert _work_explains(50.0 + excess_ms, 50.0, 10.0, share) is named
    assert _work_explains(None, 50.0, 10.0, share) and _work_explains(55.0, None, 10.0, share)


@pytest.mark.parametrize("scatter_ms,named", [(3.0, False), (0.3, True)])
def test_chance_lateness_needs_work_beyond_the_steps_own_scatter(scatter_ms, named):
    """Rank 0 works 1.9 ms more per step than rank 1, more than half the 3.5 ms it imposes: with
    its three steps scattered by 3 ms (a busy host's wake-ups) the medians cannot tell that
    from noise, so no straggler; scattered by 0.3 ms, they can. (A balanced gloo job on a busy
    2-core machine once had rank 0 named from such a difference.)"""
    from types import SimpleNamespace

    from diag.analyzers.diagnosis.steady import median_half_width
    from diag.analyzers.diagnosis.stragglers import _work_explains, _work_noise

    steps = {0: [35.1 - scatter_ms, 35.1, 35.1 + scatter_ms], 1: [33.2 - scatter_ms, 33.2, 33.2 + scatter_ms]}
    noise = _work_noise(SimpleNamespace(work_steps=steps), 0)
    assert noise == pytest.approx(2 ** 0.5 * median_half_width(steps[0]))
    share = load_tree().thresholds["straggler_work_explains"]
    assert _work_explains(35.1, 33.2, 3.5, share, noise) is named
