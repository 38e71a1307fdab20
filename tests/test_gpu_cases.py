"""Real H200 traces of induced causes (tests/fixtures/real/h200, recorded by
bench/gpu_trace_cases.py): each cause is named where it was induced and not where it was not,
with numbers recomputed here from the raw JSON; and the predicted gains against the fixed
variants' wall times measured on the same GPU (cases.json)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from device_steps import device_step_windows, host_steps, launch_steps
from merged_ranks import merged
from rank_documents import ranks_of

from diag.analyzers.analysis_types import Job
from diag.analyzers.analyze import analyze_paths
from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt

H200 = Path(__file__).parent / "fixtures" / "real" / "h200"
CASES = {c["case"]: c for c in json.loads((H200 / "cases.json").read_text())["cases"]}
_docs: dict[str, dict] = {}


def _doc(case: str) -> dict:
    if case not in _docs:
        _docs[case] = analyze_paths([str(H200 / f"{case}.json.gz")], jobs=1)
    return _docs[case]


def _events(case: str) -> list[dict]:
    with gzip.open(H200 / f"{case}.json.gz") as f:
        return json.load(f)["traceEvents"]


def _causes(case: str) -> dict[str, dict]:
    return {c["id"]: c for c in _doc(case).diagnosis.causes}


def test_a_loop_that_runs_ahead_of_the_device_is_judged_on_the_device_time_of_each_step():
    """The bf16 matmul loop never waits for the device: its host steps last about 2 ms while
    each step's kernels take over 8 ms. A step lasts until the device has run what it launched,
    and starts where the one before ended."""
    events = _events("matmul_bf16")
    steps, windows = host_steps(events), device_step_windows(events)
    rank = ranks_of(_doc("matmul_bf16"))[0]
    got = [s["duration_ms"] for s in rank["steps"]]
    assert got == pytest.approx([(b - a) / 1e3 for a, b in windows], rel=1e-9)
    for k in range(len(steps)):
        assert got[k] > 3 * (steps[k][1] - steps[k][0]) / 1e3  # the host spans alone would miss most of it
    assert _doc("matmul_bf16").diagnosis.bound == "compute"
    assert 0.3 < rank["mfu"] < 1.0
    # The replayed graph explains each stretched step: its critical path is the step.
    assert rank["critical_path"]["max_error"] < 1e-6


@pytest.mark.parametrize("case", sorted(c for c in CASES))
def test_every_step_graph_explains_its_step(case):
    assert ranks_of(_doc(case))[0]["critical_path"]["max_error"] < 1e-6


def test_cpu_work_on_the_training_thread_is_named_with_its_ops():
    """Augmentation on CPU tensors between the launches: aten::rand (its aten::empty inside is
    allocation, not work), aten::flip and the normalisation, while the device idles."""
    events = _events("cpu_ops_on_thread")
    steps = host_steps(events)
    main = next(e["tid"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main
           and any(lo <= e["ts"] < hi for lo, hi in steps)]
    rand = [e for e in ops if e["name"] == "aten::rand"]
    empty_inside = sum(e["dur"] for e in ops if e["name"] == "aten::empty"
                       and any(r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] for r in rand))
    cause = _causes("cpu_ops_on_thread")["cpu_work_on_training_thread"]
    named = {o["name"]: o for o in cause["evidence"]["ops"]}
    assert named["aten::rand"]["ms_per_step"] == pytest.approx(
        (sum(e["dur"] for e in rand) - empty_inside) / 1e3 / len(steps), rel=1e-3)
    assert {"aten::flip", "aten::sub", "aten::div"} <= set(named)
    assert cause["phase"] == "host" and "aten::rand" in cause["text"] and "off the training thread" in cause["action"]
    measured = CASES["cpu_ops_on_thread"]["wall_step_ms"] / CASES["cpu_ops_on_thread"]["fixed_wall_step_ms"]
    assert 2.0 < cause["what_if"]["speedup"] <= measured


@pytest.mark.parametrize("case", ["matmul_bf16", "item_sync", "launch_bound", "empty_cache", "elementwise_bandwidth"])
def test_no_cpu_work_is_named_where_the_thread_only_launches(case):
    assert "cpu_work_on_training_thread" not in _causes(case)


def test_no_cpu_work_is_named_on_ddp_view_ops_or_a_sampled_trace(real_data):
    """DDP's unflatten_dense_tensors (22 ms a step of views) and a trace that kept 1% of its
    host events (a dropped launch would make any op look like CPU work) name none."""
    for name in ("a100_2rank_nccl.json.gz", "job128_rank0_sampled.json.gz"):
        doc = analyze_paths([str(real_data / "traces" / name)], jobs=1)
        named = [o for r in ranks_of(doc) for o in r.get("cpu_work") or []]
        assert not any("unflatten" in o["name"] for o in named), name
        assert "cpu_work_on_training_thread" not in {c["id"] for c in doc.diagnosis.causes}


def _cpu_rank(work_ms: float, step_ms: float = 100.0) -> dict:
    return {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": step_ms} for k in range(3)],
                         "cpu_work": [{"name": "aten::rand", "calls_per_step": 1.0, "ms_per_step": work_ms}]}}


@pytest.mark.parametrize("work_ms,named", [(9.9, False), (10.0, True)])
def test_cpu_work_is_named_from_its_threshold(work_ms, named):
    assert dt.load_tree().thresholds["cpu_work_step_share"] == 0.10
    ctx = _ctx({0: _cpu_rank(work_ms)}, bound="host", shares={"host": 0.6})
    assert ("cpu_work_on_training_thread" in {c["id"] for c in cs.causes(ctx)}) == named


def _ctx(ranks, bound, shares):
    import types

    return types.SimpleNamespace(ranks=merged(ranks), tree=dt.load_tree(), bound=bound, job=Job(what_if=[]),
                                 shares=shares, nccl={})


def test_a_transposed_copy_is_named_far_below_the_memory_peak():
    """a.t().contiguous() of an 8192x8192 fp32 tensor: one read and one write of 256 MiB per
    step, in the kernel aten::copy_ launches; its rate is those bytes over that kernel's time,
    against the H200's 4.8 TB/s."""
    events = _events("strided_gather")
    launched = {c: k for c, k in launch_steps(events).items() if k >= 0}
    copies = {e["args"]["External id"] for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::copy_"
              and e["args"].get("Input Dims", [])[:2] == [[8192, 8192], [8192, 8192]]}
    kernels = [e for e in events if e.get("cat") == "kernel" and e["args"].get("External id") in copies
               and e["args"].get("correlation") in launched]
    rate = len(kernels) * 2 * 8192 * 8192 * 4 / (sum(e["dur"] for e in kernels) * 1e-6)
    cause = _causes("strided_gather")["bandwidth_kernels"]
    top = cause["evidence"]["groups"][0]
    assert top["called_from"] == "aten::contiguous" and top["shapes"] == "8192x8192, 8192x8192"
    assert top["achieved_gbps"] == pytest.approx(rate / 1e9, rel=1e-3)
    assert top["peak_frac"] == pytest.approx(rate / 4.8e12, rel=1e-3)
    assert top["peak_frac"] < 0.30 and top["mb_per_call"] >= 8
    assert "contiguous once" in cause["action"] and "aten::index" in cause["text"]
    assert 1.0 < cause["what_if"]["speedup"] < 2.0


def test_elementwise_kernels_near_the_peak_are_told_to_move_fewer_bytes():
    """Full passes over a 256 MiB fp32 tensor: each aten::mul reads two and writes one."""
    events = _events("elementwise_bandwidth")
    muls = {e["args"]["External id"] for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mul"
            and e["args"].get("Input Dims") == [[67108864], [67108864]]}
    kernels = [e for e in events if e.get("cat") == "kernel" and e["args"].get("External id") in muls]
    rate = len(kernels) * 3 * 67108864 * 4 / (sum(e["dur"] for e in kernels) * 1e-6)
    cause = _causes("elementwise_bandwidth")["bandwidth_kernels"]
    groups = [g for g in cause["evidence"]["groups"] if g["op"] == "aten::mul" and g["shapes"] == "67108864, 67108864"]
    assert sum(g["gb_per_step"] for g in groups) == pytest.approx(len(kernels) * 3 * 67108864 * 4 / 1e9 / 3, rel=1e-3)
    assert all(g["peak_frac"] > 0.8 for g in groups) and rate / 4.8e12 > 0.8
    assert "only fewer bytes" in cause["action"] and cause["what_if"] is None


def test_no_bandwidth_cause_where_the_memory_kernels_are_a_sliver():
    assert "bandwidth_kernels" not in _causes("item_sync") and "bandwidth_kernels" not in _causes("launch_bound")


def _traffic_rank(ms: float, frac: float, step_ms: float = 100.0, mb_per_call: float = 512.0) -> dict:
    group = {"name": "aten::copy_ on 8192x8192 in fp32", "op": "aten::copy_", "ms_per_step": ms, "calls_per_step": 1.0,
             "achieved_gbps": frac * 4800, "peak_frac": frac, "mb_per_call": mb_per_call}
    return {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": step_ms} for k in range(3)],
                         "memory_traffic": {"peak_gbps": 4800.0, "bandwidth_ms_per_step": ms, "groups": [group]}}}


@pytest.mark.parametrize("ms,named", [(9.9, False), (10.0, True)])
def test_bandwidth_kernels_are_named_from_their_step_share(ms, named):
    assert dt.load_tree().thresholds["bandwidth_kernels_step_share"] == 0.10
    ctx = _ctx({0: _traffic_rank(ms, 0.5)}, bound="memory", shares={"memory": 0.6})
    assert ("bandwidth_kernels" in {c["id"] for c in cs.causes(ctx)}) == named


def test_the_slow_bandwidth_threshold_splits_the_advice():
    from diag.analyzers.trace import memory_traffic

    assert dt.load_tree().thresholds["bandwidth_slow_peak"] == 0.30
    for frac, layout in ((0.29, True), (0.31, False)):
        ctx = _ctx({0: _traffic_rank(50.0, frac)}, bound="memory", shares={"memory": 0.6})
        (cause,) = [c for c in cs.causes(ctx) if c["id"] == "bandwidth_kernels"]
        assert ("memory layout" in cause["action"]) == layout
    # Kernels moving under bandwidth_min_call_mb a call can not reach the peak: not slow.
    assert dt.load_tree().thresholds["bandwidth_min_call_mb"] == 8
    for mb, layout in ((7.9, False), (8.0, True)):
        ctx = _ctx({0: _traffic_rank(50.0, 0.1, mb_per_call=mb)}, bound="memory", shares={"memory": 0.6})
        (cause,) = [c for c in cs.causes(ctx) if c["id"] == "bandwidth_kernels"]
        assert ("memory layout" in cause["action"]) == layout
    # The facts' own split, on the copy's bytes: 8 MB a call is the smallest called slow.
    assert memory_traffic.op_traffic("aten::copy_", [[1024, 1024], [1024, 1024]], ["float", "float"]) == 8 * 2**20


@pytest.mark.parametrize("case,cause_id", [("empty_cache", "allocator_calls"), ("item_sync", "host_sync_points")])
def test_the_predicted_gain_is_at_most_what_the_fix_measured(case, cause_id):
    """The fixed variant (no empty_cache(), the values reduced on the device) ran on the same
    H200: the replay predicts a gain, and not more than the fix gave."""
    measured = CASES[case]["wall_step_ms"] / CASES[case]["fixed_wall_step_ms"]
    speedup = _causes(case)[cause_id]["what_if"]["speedup"]
    assert 1.0 < speedup <= measured


def test_fp32_math_on_untiled_shapes_says_its_gain_is_an_upper_bound():
    """4095-wide fp32 layers: bf16 autocast ran 2.6x faster on the same H200, far from the
    tensor cores' 15x, as the shapes are not multiples of 8."""
    cause = _causes("matmul_fp32_odd")["fp32_math"]
    measured = CASES["matmul_fp32_odd"]["wall_step_ms"] / CASES["matmul_fp32_odd"]["fixed_wall_step_ms"]
    assert cause["what_if"]["speedup"] > measured
    assert "upper bound" in cause["text"] and "K=4095" in cause["text"] and "multiples of 8" in cause["action"]
    assert "upper bound" not in _causes("matmul_bf16").get("fp32_math", {}).get("text", "")


def test_a_pageable_copy_that_makes_the_step_memory_bound_is_named():
    events = _events("pageable_copy")
    steps = host_steps(events)
    launched = {c: k for c, k in launch_steps(events).items() if k >= 0}
    pageable = [e for e in events if e.get("cat") == "gpu_memcpy" and "Pageable" in e["name"]
                and e["args"].get("correlation") in launched]
    cause = _causes("pageable_copy")["pageable_copies"]
    assert _doc("pageable_copy").diagnosis.bound == "memory" and cause["phase"] == "memory"
    assert cause["evidence"]["mb_per_step"] == pytest.approx(sum(e["args"]["bytes"] for e in pageable) / 1e6
                                                             / len(steps), rel=1e-3)


def test_empty_cache_in_the_loop_is_named_from_the_drivers_calls():
    events = _events("empty_cache")
    steps = host_steps(events)
    calls = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaMalloc", "cudaFree")
             and any(lo <= e["ts"] < hi for lo, hi in steps)]
    cause = _causes("empty_cache")["allocator_calls"]
    per_name = {c["name"]: c for c in cause["evidence"]["calls"]}
    for name in ("cudaMalloc", "cudaFree"):
        mine = [e for e in calls if e["name"] == name]
        assert per_name[name]["calls_per_step"] == pytest.approx(len(mine) / len(steps), rel=1e-3)
    assert "empty_cache" in cause["action"]
