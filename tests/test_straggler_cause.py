"""A straggler's likely cause: where its time goes against its peers', and what its device and host read."""

from __future__ import annotations

import pytest

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.inputs import merge_ranks
from diag.analyzers.diagnosis.straggler_cause import likely_cause

TREE = load_tree()


def _rank(rank, step_ms, data=0.0, host=0.1, compute=0.7, memory=0.1, wait=0.0):
    comm = 1.0 - data - host - compute - memory - wait
    shares = {"data": data, "host": host, "comm": comm, "wait": wait, "memory": memory, "compute": compute}
    steps = [{"step": i, "duration_ms": step_ms, "shares": shares, "bound": "compute"} for i in range(8)]
    return {"rank": rank, "shares": shares, "steps": steps, "bound": "compute"}


def _gpu_samples(clock_mhz, events=()):
    return [{"t": float(i), "gpu": {"sm_clock_hz": clock_mhz * 1e6, "clock_events": list(events)},
             "host": {"cpu_ratio": 0.4}} for i in range(10)]


def _merged(ranks, samples=None):
    run = {"ranks": {r["rank"]: {"samples": (samples or {}).get(r["rank"], [])} for r in ranks}}
    return merge_ranks({"ranks": ranks}, run)


def test_longer_kernels_at_lower_clocks_are_throttling():
    m = _merged([_rank(0, 100.0), _rank(1, 100.0), _rank(2, 125.0, compute=0.75)],
                {0: _gpu_samples(1980), 1: _gpu_samples(1980), 2: _gpu_samples(1410, ["hw_thermal", "sw_power_cap"])})
    got = likely_cause(m[2], [m[0], m[1]], TREE)
    assert got["cause"] == "throttling"
    assert "hw_thermal, sw_power_cap in 10 of 10 samples" in got["text"] and "1410 MHz against 1980 MHz" in got["text"]
    assert got["evidence"]["device_ms_per_step"] == pytest.approx(125.0 * 0.85)


def test_longer_kernels_at_normal_clocks_are_uneven_work():
    m = _merged([_rank(0, 100.0), _rank(1, 130.0, compute=0.75)], {0: _gpu_samples(1980), 1: _gpu_samples(1975)})
    assert likely_cause(m[1], [m[0]], TREE)["cause"] == "uneven_work"


def test_a_longer_data_wait_is_the_input_pipeline():
    m = _merged([_rank(0, 100.0), _rank(1, 130.0, data=0.25, compute=0.5)])
    got = likely_cause(m[1], [m[0]], TREE)
    assert got["cause"] == "data_loader" and got["text"].startswith("a slow input pipeline: it waits for the DataLoader")


def test_longer_host_time_on_a_saturated_host_is_a_busy_cpu():
    busy = [{"t": float(i), "gpu": None, "host": {"cpu_ratio": 0.97}} for i in range(5)]
    m = _merged([_rank(0, 100.0), _rank(1, 140.0, host=0.35, compute=0.5)], {1: busy})
    assert likely_cause(m[1], [m[0]], TREE)["cause"] == "busy_cpu"
    assert likely_cause(m[1], [m[0]], load_tree(overrides={"busy_cpu": 0.98}))["cause"] == "host_work"
    m = _merged([_rank(0, 100.0), _rank(1, 140.0, host=0.35, compute=0.5)])
    assert likely_cause(m[1], [m[0]], TREE)["cause"] == "host_work"


def test_differences_within_noise_leave_the_cause_open():
    m = _merged([_rank(0, 100.0), _rank(1, 102.0)])
    assert likely_cause(m[1], [m[0]], TREE)["cause"] == "undetermined"
    # The same 2 ms is a cause once the noise floor is under it.
    assert likely_cause(m[1], [m[0]], load_tree(overrides={"straggler_cause_min_excess": 0.01}))["cause"] != \
        "undetermined"
