"""The job merge on many simulated ranks (bench/bench_merge.py's generator): the injected
stragglers, and only they, are named. The bench times the same merge at 1,024 and 8,192 ranks."""

from __future__ import annotations

import importlib.util
import random

from conftest import FIXTURES, REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_merge", REPO / "bench" / "bench_merge.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stragglers_among_512_ranks_are_found():
    bench = _bench()
    template = bench.template_facts(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz")  # a gloo rank's real facts
    rng = random.Random(7)
    injected = {17, 300, 511}
    ranks = bench.simulate(template, 512, injected, 0.25, rng)
    doc = bench.merge(ranks)
    job = doc.job
    assert {s["rank"] for s in job.stragglers} == injected
    assert job.world_size == 512 and not job.missing_ranks
    for s in job.stragglers:
        assert s["evidence"]["late_fraction"] == 1.0  # last at every collective


def test_no_straggler_without_one():
    bench = _bench()
    template = bench.template_facts(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz")
    doc = bench.merge(bench.simulate(template, 256, set(), 0.25, random.Random(3)))
    assert doc.job.stragglers == []
