"""A straggler that does the same work as its peers, only slower, is not uneven work.

A real 2-process gloo job under torch.profiler, each rank on its own CPU. In "contended" rank 1
shares its CPU with two spinning processes at a lower priority; in "uneven" it runs three times
its peer's matmuls. Both
make rank 1 late by its device (CPU op) time; only the op counts in the traces tell them apart.
"""

from __future__ import annotations

import os

import pytest

from tests.test_cross_rank import gen

MATMULS = 4
PHASES = [
    # Six profiled steps: late in all 3 of 3 is a chance of 1 in 8 with two ranks, and then the
    # rank is named only where its work exceeds its peer's by more than three steps' scatter,
    # which a busy machine can widen past the gap; late in 6 of 6 is a chance of 1 in 64.
    gen.GlooPhase("uneven", numel=1 << 16, grads=3, compute=512, matmuls=MATMULS, late_rank=1,
                  extra_matmuls=2 * MATMULS, active=6),
    # Last: rank 1 keeps its niceness. At niceness 10 beside two spinners rank 1 alone is slow
    # whatever else the machine runs; at equal priority, six spinners left it 0.96x to 1.23x
    # rank 0's time under the parallel suite, which moved its other work onto rank 0's CPU.
    gen.GlooPhase("contended", numel=1 << 16, grads=3, compute=512, matmuls=MATMULS, late_rank=1, contended=True,
                  spinners=2, nice=10),
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one per rank"),
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return gen.run_gloo_job(tmp_path_factory.mktemp("work"), PHASES, world=2, timeout=180, start_method="fork")


def _late(paths):
    from diag.analyzers.analyze import analyze_paths

    doc = analyze_paths([str(p) for p in paths], jobs=1)
    (late,) = doc.job.stragglers
    assert late["rank"] == 1, doc.job.stragglers
    return late["likely_cause"], doc


def _matmul_ms(path) -> float:
    """The trace's own time in matmul ops (its events, not diag's reading of them)."""
    import gzip
    import json

    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return sum(e.get("dur", 0) for e in events if e.get("ph") == "X" and e.get("name") in ("aten::mm", "aten::matmul")) / 1e3


def test_the_same_ops_slower_on_a_shared_cpu_are_contention(job):
    # The premise, from the traces themselves: the spinners slowed rank 1's matmuls, not both
    # ranks' (a machine busy with other work slows rank 0 too, and then no rank is late).
    slowdown = _matmul_ms(job["contended"][1]) / _matmul_ms(job["contended"][0])
    if slowdown < 1.5:
        pytest.skip(f"the induced contention did not slow rank 1 alone: its matmuls took {slowdown:.2f}x rank 0's")
    cause, doc = _late(job["contended"])
    assert cause["cause"] == "cpu_contention", cause
    ev = cause["evidence"]
    # Both ranks ran the phase's matmuls and their sums, as many per step: at its peer's speed
    # rank 1's ops take its peer's time.
    assert ev["op_calls_per_step"] == ev["peers_op_calls_per_step"] >= 2 * MATMULS
    assert ev["op_work_at_peers_speed_ms_per_step"] == pytest.approx(ev["peers_op_ms_per_step"], rel=0.01)
    assert cause["text"].startswith("CPU contention: the same work as its peers'")
    finding = next(f for f in doc.job.findings if f["id"] in ("straggler", "straggler_induced_comm"))
    assert "Likely cause on rank 1: CPU contention" in finding["message"]


def test_more_ops_per_step_are_uneven_work(job):
    # The premise, from the traces: rank 1's three times the matmuls took it at least twice rank
    # 0's time (other work on the machine that slows rank 0's CPU alone evens them out: 1.45x
    # and 1.48x beside a CPU hog, and then no rank need be late).
    longer = _matmul_ms(job["uneven"][1]) / _matmul_ms(job["uneven"][0])
    if longer < 2.0:
        pytest.skip(f"rank 1's extra matmuls did not take it twice rank 0's matmul time: {longer:.2f}x")
    cause, _ = _late(job["uneven"])
    assert cause["cause"] == "uneven_work", cause
    ev = cause["evidence"]
    # Three times the matmuls (and their sums) per step, so about three times the peer's op time
    # at the peer's speed: the counts come from the traces' op events.
    assert ev["op_calls_per_step"] == pytest.approx(3 * ev["peers_op_calls_per_step"], rel=0.05)
    assert ev["op_work_at_peers_speed_ms_per_step"] == pytest.approx(3 * ev["peers_op_ms_per_step"], rel=0.1)
    assert f"against their {ev['peers_op_ms_per_step']:.1f} ms" in cause["text"]
