"""A straggler's likely cause: where its time goes against its peers', and what its device and host read."""

from __future__ import annotations

import msgspec
import pytest

from diag.analyzers.analysis_types import document_ranks
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.inputs import merge_ranks
from diag.analyzers.diagnosis.straggler_cause import likely_cause
from diag.run_documents import RankRecords, RunRecords

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
    run = RunRecords(ranks={r["rank"]: RankRecords(samples=(samples or {}).get(r["rank"], [])) for r in ranks})
    return merge_ranks(document_ranks({"ranks": ranks}), run)


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


def _h100_samples(clock_mhz, power_cap=1.0, thermal=0.0, n=20):
    """Samples shaped like an H100 at its power limit under GEMM load: sw_power_cap in nearly
    every sample, the SM clock a little below its 1980 MHz boost."""
    out = []
    for i in range(n):
        events = (["sw_power_cap"] if i < power_cap * n else []) + (["sw_thermal"] if i < thermal * n else [])
        out.append({"t": float(i), "gpu": {"sm_clock_hz": clock_mhz * 1e6, "clock_events": events},
                    "host": {"cpu_ratio": 0.3}})
    return out


def test_a_power_cap_every_board_reports_is_no_throttling():
    ranks = [_rank(r, 100.0) for r in range(3)] + [_rank(3, 130.0, compute=0.75)]
    samples = {r: _h100_samples(1755) for r in range(3)} | {3: _h100_samples(1740)}
    m = _merged(ranks, samples)
    got = likely_cause(m[3], [m[0], m[1], m[2]], TREE)
    assert got["cause"] == "uneven_work", got["text"]
    assert got["evidence"]["peers_slowdown_samples"] == 0 and got["evidence"]["slowdown_samples"] == 0


@pytest.mark.parametrize("clock,cause", [(1755 * 0.89, "throttling"), (1755 * 0.91, "uneven_work")])
def test_a_power_cap_with_a_clock_below_the_peers_is_throttling(clock, cause):
    ranks = [_rank(0, 100.0), _rank(1, 100.0), _rank(2, 130.0, compute=0.75)]
    m = _merged(ranks, {0: _h100_samples(1755), 1: _h100_samples(1755), 2: _h100_samples(clock)})
    got = likely_cause(m[2], [m[0], m[1]], TREE)
    assert got["cause"] == cause
    if cause == "throttling":
        assert "sw_power_cap in 20 of 20 samples" in got["text"]


@pytest.mark.parametrize("own,peers,cause", [
    (0.30, 0.0, "throttling"),  # thermal slowdown in 30% of samples, none on the peers
    (0.15, 0.0, "uneven_work"),  # under 20% of samples
    (0.50, 0.40, "uneven_work"),  # the peers see it nearly as often: the room, not this board
    (0.65, 0.40, "throttling"),  # 25 points more than the peers
])
def test_thermal_slowdown_counts_against_the_peers(own, peers, cause):
    ranks = [_rank(0, 100.0), _rank(1, 100.0), _rank(2, 130.0, compute=0.75)]
    m = _merged(ranks, {0: _h100_samples(1755, thermal=peers), 1: _h100_samples(1755, thermal=peers),
                        2: _h100_samples(1755, thermal=own)})
    got = likely_cause(m[2], [m[0], m[1]], TREE)
    assert got["cause"] == cause, got["text"]
    if cause == "throttling":
        assert "sw_thermal in" in got["text"] and "sw_power_cap" not in got["text"]


def _cpu_rank(rank, step_ms, calls, samples=512.0, compute=0.7, slow=1.0, copies=10):
    """A rank that computes on the CPU: 3 traced steps, `calls` matmuls of 0.5 ms each at
    normal speed, and 10 or `copies` cheap copies, in its top ops."""
    r = _rank(rank, step_ms, compute=compute)
    r["device"] = "CPU"
    r["steps"] = [dict(s, evidence="trace", samples=samples) for s in r["steps"][:3]]
    r["top_ops"] = [{"name": "aten::mm", "class": "compute", "count": 3 * calls, "time_ms": 3 * calls * 0.5 * slow},
                    {"name": "aten::copy_", "class": "memory", "count": 3 * copies, "time_ms": 3 * copies * 0.01},
                    {"name": "aten::add_", "class": "host", "count": 999, "time_ms": 1.0}]
    return r


@pytest.mark.parametrize("calls", [101.5, 102.5])
def test_a_cpu_rank_doing_the_same_work_slower_is_contention(calls):
    """The straggler's op calls at its peers' time per call within straggler_same_work_tolerance
    (2%) of the peers' op time are the same work, however slowly they ran; a few more (2.5%) that
    are far from its lateness are too. Host ops are not counted."""
    m = _merged([_cpu_rank(0, 100.0, 100), _cpu_rank(1, 130.0, calls, compute=0.75, slow=1.3)])
    m[1] = msgspec.structs.replace(m[1], info={"local_world_size": 2, "cpu": {"cpus": 2, "torch_threads": 1}})
    got = likely_cause(m[1], [m[0]], TREE)
    assert got["cause"] == "cpu_contention", got["text"]
    ev = got["evidence"]
    assert ev["op_work_at_peers_speed_ms_per_step"] == pytest.approx(calls * 0.5 + 0.1)
    assert ev["peers_op_ms_per_step"] == pytest.approx(50.1)
    assert "(2 ranks × 1 torch threads on 2 CPUs here)" in got["text"]
    assert (f"its ops would take {calls * 0.5 + 0.1:.1f} ms per step at their speed, against their 50.1 ms; "
            "512 samples") in got["text"]


@pytest.mark.parametrize("above,cause", [(-1.0, "cpu_contention"), (1.0, "uneven_work")])
def test_more_calls_are_uneven_work_only_where_they_explain_the_lateness(above, cause):
    """A rank 30% slower that also runs a few more op calls: the extra calls at its peers' speed
    must be straggler_extra_work_share (half) of its excess device time to be its cause; with
    less, its ops ran slower (the demo beside a CPU-bound job: 5.5 ms more work, 77 ms late)."""
    def merged(calls):
        return _merged([_cpu_rank(0, 100.0, 100), _cpu_rank(1, 130.0, calls, compute=0.75, slow=1.3)])

    ev = likely_cause(merged(102.5)[1], [merged(102.5)[0]], TREE)["evidence"]
    excess = ev["device_ms_per_step"] - ev["peers_device_ms_per_step"]
    assert TREE.thresholds["straggler_extra_work_share"] == 0.5
    calls = 100 + 0.5 * excess / 0.5 + above  # each extra call is 0.5 ms at the peers' speed
    m = merged(calls)
    got = likely_cause(m[1], [m[0]], TREE)
    assert got["cause"] == cause, got["text"]
    extra = got["evidence"]["op_work_at_peers_speed_ms_per_step"] - got["evidence"]["peers_op_ms_per_step"]
    assert (extra >= 0.5 * excess) is (cause == "uneven_work")
    if cause == "cpu_contention":
        assert "runs more op calls" not in got["text"]


def test_extra_calls_of_a_cheap_op_are_not_uneven_work():
    """Twice the copies, at 0.01 ms each, are 0.1 ms of 50 ms of op work."""
    m = _merged([_cpu_rank(0, 100.0, 100), _cpu_rank(1, 130.0, 100, compute=0.75, slow=1.3, copies=20)])
    got = likely_cause(m[1], [m[0]], TREE)
    assert got["cause"] == "cpu_contention", got["text"]
    assert got["evidence"]["op_calls_per_step"] == 120 and got["evidence"]["peers_op_calls_per_step"] == 110


@pytest.mark.parametrize("samples,cause", [(520.0, "cpu_contention"), (528.0, "uneven_work")])
def test_more_samples_per_step_are_uneven_work(samples, cause):
    m = _merged([_cpu_rank(0, 100.0, 100), _cpu_rank(1, 130.0, 100, samples=samples, compute=0.75)])
    got = likely_cause(m[1], [m[0]], TREE)
    assert got["cause"] == cause, got["text"]
    assert got["evidence"]["samples_per_step"] == samples


def test_a_gpu_rank_doing_the_same_work_slower_is_not_called_contention():
    ranks = [_cpu_rank(0, 100.0, 100), _cpu_rank(1, 130.0, 100, compute=0.75)]
    for r in ranks:
        r["device"] = "NVIDIA H100 80GB HBM3"
    m = _merged(ranks, {0: _gpu_samples(1980), 1: _gpu_samples(1975)})
    assert likely_cause(m[1], [m[0]], TREE)["cause"] == "uneven_work"


@pytest.mark.parametrize("excess,where", [(4.99, None), (5.0, "device")])
def test_the_excess_is_placed_where_it_is_largest_from_its_threshold(excess, where):
    """The one rule of the report and `diag top`: the largest part, from straggler_cause_min_excess
    of a step (5% of 100 ms here); unmeasured parts are left out."""
    from diag.analyzers.diagnosis.straggler_cause import excess_at

    th = TREE.thresholds
    assert th["straggler_cause_min_excess"] == 0.05
    assert excess_at({"data": 1.0, "host": None, "device": excess}, 100.0, th) == where
    assert excess_at({"data": None, "host": None, "device": None}, 100.0, th) is None
