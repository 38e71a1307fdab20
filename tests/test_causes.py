"""Cause rules above and below their thresholds (the real runs that name them: tests/test_demo.py)."""

from __future__ import annotations

import types

import pytest
from device_steps import host_steps, launch_steps
from merged_ranks import merged
from rank_documents import ranks_of

from diag.analyzers.analysis_types import Job
from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt


def _ctx(ranks: dict, bound="host", shares=None, what_if=(), nccl=None):
    return types.SimpleNamespace(ranks=merged(ranks), tree=dt.load_tree(), bound=bound, job=Job(what_if=list(what_if)),
                                 shares=shares or {"host": 0.6, "data": 0.05, "compute": 0.35}, nccl=nccl or {})


def _rank(item_calls: int, traced: int = 2, loader=None):
    return {"analysis": {"steps": [{"step": k, "evidence": "trace"} for k in range(traced)]
                         + [{"step": 9, "evidence": "sampled"}],
                         "top_ops": [{"name": "aten::item", "count": item_calls, "time_ms": 1.0},
                                     {"name": "aten::addmm", "count": 40, "time_ms": 9.0}],
                         "loader": loader}}


@pytest.mark.parametrize("per_step,named", [(15, False), (16, True)])
def test_sync_points_are_named_from_the_threshold(per_step, named):
    assert dt.load_tree().thresholds["sync_points_per_step"] == 16
    found = cs.causes(_ctx({0: _rank(2 * per_step)}))  # two traced steps
    assert [c["id"] for c in found] == (["host_sync_points"] if named else [])
    if named:
        assert found[0]["evidence"]["per_step"] == per_step and "aten::item 16 times" in found[0]["text"]


def test_a_cause_carries_the_prediction_of_its_own_change():
    entry = {"change": "no_sync_points", "description": "The ops that pull values to the host are gone",
             "baseline_step_ms": 100.0, "predicted_step_ms": 80.0, "speedup": 1.25, "fixes": "host"}
    (cause,) = cs.causes(_ctx({0: _rank(40)}, what_if=[entry]))
    assert cause["what_if"]["predicted_step_ms"] == 80.0 and cause["what_if"]["change"] == "no_sync_points"
    # Keeping the values on the device removes the cause entirely: the action's step is the
    # ceiling's, said once, as the action's.
    assert cause["gain"].startswith("With the values kept on the device: 80.0 ms per step (expected within 80.0 to")
    assert "Ceiling" not in cause["gain"] and cause["expected"]["ceiling_step_ms"] == 80.0
    (cause,) = cs.causes(_ctx({0: _rank(40)}))  # not replayed: said so, no number
    assert cause["what_if"]["predicted_step_ms"] is None and "not replayed" in cause["gain"]


LOADER = {"class": "DataLoader", "dataset": "Shards", "num_workers": 0, "batch_size": 8, "pin_memory": False,
          "prefetch_factor": None, "persistent_workers": False, "cpus": 16, "local_ranks": 4}


@pytest.mark.parametrize("data_share,named", [(0.09, False), (0.10, True)])
def test_a_cause_is_named_only_for_a_phase_that_matters(data_share, named):
    assert dt.load_tree().thresholds["recommendation_min_share"] == 0.10
    ctx = _ctx({0: _rank(0, loader=LOADER)}, bound="compute",
               shares={"data": data_share, "compute": 1 - data_share})
    found = cs.causes(ctx)
    assert [c["id"] for c in found] == (["data_loader_no_workers"] if named else [])
    if named:
        # 16 CPUs for 4 local ranks: 4 per rank, one left to the training process.
        assert "start at num_workers=3 (16 CPUs for 4 local ranks" in found[0]["action"]
        assert "DataLoader over Shards" in found[0]["text"]


def test_a_loader_with_workers_is_no_cause():
    ctx = _ctx({0: _rank(0, loader={**LOADER, "num_workers": 4})}, bound="data", shares={"data": 0.9})
    assert cs.causes(ctx) == []


# -- pageable copies and launch-bound streams: real traces (shared/data/traces) and thresholds ---


def _analyse(real_data, name):
    from diag.analyzers.analyze import analyze_paths

    return analyze_paths([str(real_data / "traces" / name)], jobs=1)


def _trace_events(real_data, name):
    import gzip
    import json

    with gzip.open(real_data / "traces" / name) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _in_steps(events, pred):
    """The events matching pred that start inside a host ProfilerStep span (not its device-side
    mirror, gpu_user_annotation), and the number of spans."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    hits = [e for e in events if pred(e) and any(lo <= e["ts"] < hi for lo, hi in steps)]
    return hits, len(steps)


def _launched_in_steps(events, pred):
    """The device events matching pred whose launching runtime call (same correlation id)
    starts inside a host ProfilerStep span, and the number of spans: a step's device work,
    which may run after its host span when the loop runs ahead of the device."""
    launched = {c for c, k in launch_steps(events).items() if k >= 0}
    return [e for e in events if pred(e) and (e.get("args") or {}).get("correlation") in launched], \
        len(host_steps(events))


def test_pageable_copies_are_named_on_a_real_data_bound_trace(real_data):
    """A V100 ResNet-50 step with num_workers=0 (HTA's test data): its batches reach the device
    from pageable memory. Counts, bytes and the issuing calls' host time are the file's own."""
    name = "v100_resnet50_workers0_oldschema.json.gz"
    doc = _analyse(real_data, name)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "pageable_copies"]
    events = _trace_events(real_data, name)
    copies, n = _in_steps(events, lambda e: e.get("name") == "Memcpy HtoD (Pageable -> Device)")
    corr = {e["args"]["correlation"] for e in copies}
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "Runtime") and e.get("args", {}).get("correlation") in corr]
    ev = cause["evidence"]
    assert ev["calls_per_step"] == pytest.approx(len(copies) / n)
    assert ev["mb_per_step"] == pytest.approx(sum(e["args"]["bytes"] for e in copies) / 1e6 / n, rel=1e-3)
    assert ev["host_ms_per_step"] == pytest.approx(sum(e["dur"] for e in calls) / 1e3 / n, rel=1e-3)
    assert cause["phase"] == doc.diagnosis.bound == "data"
    assert "pin_memory=True" in cause["action"] and "non_blocking=True" in cause["action"]
    rec = next(r for r in doc.diagnosis.recommendations if r["id"] == "phase-data")
    assert rec["actions"][0] == cause["action"] and not any(a.startswith("Set pin_memory=True") for a in rec["actions"])


def test_tiny_pageable_copies_are_no_cause_on_a_real_trace(real_data):
    """job128 copies 8 KB per step from pageable memory in a 600 ms host-bound step."""
    doc = _analyse(real_data, "job128_rank0_sampled.json.gz")
    assert any("Pageable" in c["name"] for c in ranks_of(doc)[0]["copies"])
    assert "pageable_copies" not in {c["id"] for c in doc.diagnosis.causes}


def test_a_cold_first_launch_on_a_real_rocm_trace_is_no_launch_bound_cause(real_data):
    """An MI250 (ROCm 6.2) trace of a tiny model: 7 kernels of a few microseconds a step, each
    launched in about 6 µs, but one launch takes 6.5 ms (the first, loading the module). Summed
    per step it made a launch-bound cause; at the median call the launches hold the host well
    under 10% of the step, and the slow call is kept apart in the facts."""
    import statistics

    name = "mi250_rocm62_tiny.json.gz"
    doc = _analyse(real_data, name)
    events = _trace_events(real_data, name)
    kernels, n = _in_steps(events, lambda e: e.get("cat") == "kernel")
    launches, _ = _in_steps(events, lambda e: e.get("name") in ("hipLaunchKernel", "hipExtModuleLaunchKernel"))
    lf = ranks_of(doc)[0]["launches"]
    assert lf["kernels_per_step"] == pytest.approx(len(kernels) / n)
    assert lf["launch_ms_per_step"] == pytest.approx(sum(e["dur"] for e in launches) / 1e3 / n, rel=1e-3)
    assert lf["median_launch_us"] == pytest.approx(statistics.median(e["dur"] for e in launches), rel=1e-3)
    assert lf["max_launch_us"] == pytest.approx(max(e["dur"] for e in launches), rel=1e-3)
    assert lf["max_launch_us"] > 500 * lf["median_launch_us"]
    assert "launch_bound" not in {c["id"] for c in doc.diagnosis.causes}


def test_a_host_bound_trace_with_cheap_launches_is_not_launch_bound(real_data):
    """An A100 step: 900 launches hold the host 8.5 ms of a 220 ms host-bound step."""
    doc = _analyse(real_data, "a100_2rank_nccl.json.gz")
    assert doc.diagnosis.bound == "host"
    assert "launch_bound" not in {c["id"] for c in doc.diagnosis.causes}


def _launch_rank(launch_ms, kernel_ms=10.0, step_ms=100.0, launchers=()):
    lf = {"kernels_per_step": 400.0, "median_kernel_us": 4.0, "kernel_ms_per_step": kernel_ms,
          "launch_calls_per_step": 400.0, "launch_ms_per_step": launch_ms, "graph_launches_per_step": 0.0,
          "runtime": "cuda", "top_launchers": list(launchers)}
    return {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": step_ms} for k in range(3)],
                         "launches": lf, "top_ops": []}}


@pytest.mark.parametrize("launch_ms,kernel_ms,named", [
    (10.0, 20.5, False),  # under half the kernels' time
    (10.0, 19.5, True),
    (9.9, 5.0, False),  # under 10% of the 100 ms step
    (10.1, 5.0, True),
])
def test_launch_bound_thresholds(launch_ms, kernel_ms, named):
    found = cs.causes(_ctx({0: _launch_rank(launch_ms, kernel_ms)}))
    assert [c["id"] for c in found] == (["launch_bound"] if named else [])


@pytest.mark.parametrize("kernels,named", [(99.0, False), (101.0, True)])
def test_an_in_place_op_launching_a_quarter_of_the_kernels_is_named_for_foreach(kernels, named):
    (cause,) = cs.causes(_ctx({0: _launch_rank(40.0, launchers=[{"name": "aten::add_", "kernels_per_step": kernels}])}))
    assert ("aten::add_ launch one kernel per tensor" in cause["action"]) is named
    assert "(at least aten::add_) in a CUDA graph" in cause["action"]


def _copy_rank(host_ms, step_ms=100.0, loader=None):
    copies = [{"name": "Memcpy HtoD (Pageable -> Device)", "calls_per_step": 2.0, "mb_per_step": 8.0,
               "ms_per_step": 0.5, "host_ms_per_step": host_ms},
              {"name": "Memcpy HtoD (Pinned -> Device)", "calls_per_step": 2.0, "mb_per_step": 8.0,
               "ms_per_step": 0.5, "host_ms_per_step": 50.0}]
    return {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": step_ms} for k in range(3)],
                         "copies": copies, "top_ops": [], "loader": loader}}


@pytest.mark.parametrize("host_ms,named", [(0.99, False), (1.01, True)])
def test_pageable_copies_from_one_percent_of_the_step(host_ms, named):
    found = cs.causes(_ctx({0: _copy_rank(host_ms)}, bound="data", shares={"data": 0.5, "compute": 0.5}))
    assert [c["id"] for c in found] == (["pageable_copies"] if named else [])


def test_pageable_copies_name_the_loader_that_does_not_pin():
    loader = {**LOADER, "num_workers": 4}
    (cause,) = cs.causes(_ctx({0: _copy_rank(5.0, loader=loader)}, bound="data", shares={"data": 0.5}))
    assert cause["action"].startswith("Set pin_memory=True on the DataLoader over Shards (it has pin_memory=False)")
    (cause,) = cs.causes(_ctx({0: _copy_rank(5.0, loader={**loader, "pin_memory": True})}, bound="data",
                              shares={"data": 0.5}))
    assert cause["action"].startswith("Pin the host tensors")


def test_a_cause_in_a_second_phase_explains_the_phase_that_matters():
    """Pageable copies hold the host: in a host-bound job they explain host time."""
    (cause,) = cs.causes(_ctx({0: _copy_rank(5.0)}, bound="host", shares={"host": 0.6, "data": 0.0}))
    assert cause["phase"] == "host"
    assert cs.causes(_ctx({0: _copy_rank(5.0)}, bound="compute", shares={"compute": 0.95, "host": 0.05})) == []


# -- matrix math in fp32 or TF32, from the kernels' names -------------------------------------


@pytest.mark.parametrize("name,precision", [
    ("volta_sgemm_64x64_nt", "fp32"),
    ("void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int)", "fp32"),
    ("cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", "fp32"),
    ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int)", "fp32"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(Params)", "tf32"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "tf32"),
    ("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8", "fp32"),
    ("volta_h884gemm_64x64_ldg8_nn", "half"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nn", "half"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n", "fp8"),
    ("void at::native::vectorized_elementwise_kernel<4, float>(int)", None),  # not matrix math
    ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1", None),  # ROCm: the name does not say
])
def test_a_kernel_name_states_its_precision(name, precision):
    from diag.analyzers.trace.precision import precision_of

    assert precision_of(name) == precision


def test_fp32_math_is_named_on_a_real_compute_bound_v100_trace(real_data):
    """A V100 step whose GEMMs and convolutions run sgemm/scudnn kernels: the fp32 time is the
    file's own, summed over those kernels that the profiler steps launched (the loop runs
    ahead of the device: the first two steps' kernels run mostly after their host spans)."""
    import re

    name = "v100_1rank_compute.json.gz"
    doc = _analyse(real_data, name)
    assert doc.diagnosis.bound == "compute"
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "fp32_math"]
    fp32 = re.compile(r"sgemm|scudnn|engine<float")
    kernels, n = _launched_in_steps(_trace_events(real_data, name),
                                    lambda e: e.get("cat") == "kernel" and fp32.search(e.get("name", "")))
    assert cause["evidence"]["ms_per_step"] == pytest.approx(sum(e["dur"] for e in kernels) / 1e3 / n, rel=1e-3)
    assert cause["evidence"]["precision"] == "fp32" and cause["evidence"]["peak_ratio"] == pytest.approx(125 / 15.7, rel=0.01)
    assert "torch.float16" in cause["action"] and "GradScaler" in cause["action"]  # V100: no bf16, no TF32
    rec = next(r for r in doc.diagnosis.recommendations if r["id"] == "phase-compute")
    assert rec["actions"][0] == cause["action"] and not any(a.startswith("Use lower precision") for a in rec["actions"])


def test_tf32_math_on_a_real_a100_trace_asks_for_bf16(real_data):
    """The A100 trace's GEMMs are cutlass tensorop_s1688 (TF32) kernels; judged as if compute
    bound it takes bf16 autocast, and as it is (host-bound) it names no compute cause."""
    doc = _analyse(real_data, "a100_2rank_nccl.json.gz")
    assert "fp32_math" not in {c["id"] for c in doc.diagnosis.causes}
    ranks = {0: {"analysis": ranks_of(doc)[0]}}
    (cause,) = cs.causes(_ctx(ranks, bound="compute", shares={"compute": 0.6}))
    assert cause["evidence"]["precision"] == "tf32" and "bfloat16" in cause["action"]


def _math_rank(fp32_ms, tf32_ms=0.0, peaks=None):
    m = {"compute_ms_per_step": 100.0, "fp32_ms_per_step": fp32_ms, "tf32_ms_per_step": tf32_ms,
         "half_ms_per_step": 100.0 - fp32_ms - tf32_ms, "fp8_ms_per_step": 0.0, "fp32_kernels": [],
         "peaks_tflops": peaks if peaks is not None else {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}}
    return {"analysis": {"steps": [], "math": m, "top_ops": []}}


@pytest.mark.parametrize("fp32_ms,named", [(29.0, False), (31.0, True)])
def test_fp32_math_from_thirty_percent_of_the_compute_kernels(fp32_ms, named):
    found = cs.causes(_ctx({0: _math_rank(fp32_ms)}, bound="compute", shares={"compute": 0.8}))
    assert [c["id"] for c in found] == (["fp32_math"] if named else [])
    if named:
        assert "set_float32_matmul_precision('high')" in found[0]["action"]


def test_compute_causes_only_where_compute_bounds():
    assert cs.causes(_ctx({0: _math_rank(90.0)}, bound="host", shares={"host": 0.6, "compute": 0.4})) == []


# -- elementwise chains (fusion candidates) -----------------------------------------------------


def test_an_elementwise_chain_is_named_on_a_real_v100_trace(real_data):
    """ResNet's backward on a V100: add_, mul, threshold_backward (ReLU) and batch-norm backward
    run one after the other between convolutions. The chain's device time is bounded by the
    file's own: the kernels in the steps whose External id is that of an op of those names."""
    name = "v100_1rank_compute.json.gz"
    doc = _analyse(real_data, name)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "elementwise_chain"]
    ev = cause["evidence"]
    assert cause["phase"] == "memory" and ev["ops"][0] == "aten::add_" and "aten::cudnn_batch_norm_backward" in ev["ops"]
    assert ev["ms_per_step"] >= 0.10 * ev["step_ms"]
    events = _trace_events(real_data, name)
    ext = {e["args"]["External id"] for e in events if e.get("cat") == "cpu_op" and e.get("name") in ev["ops"]
           and "External id" in e.get("args", {})}
    kernels, n = _in_steps(events, lambda e: e.get("cat") == "kernel" and e.get("args", {}).get("External id") in ext)
    assert 0 < ev["ms_per_step"] <= sum(e["dur"] for e in kernels) / 1e3 / n


def test_no_chain_is_named_where_elementwise_time_is_small(real_data):
    doc = _analyse(real_data, "job128_rank0_sampled.json.gz")
    chains = ranks_of(doc)[0]["elementwise_chains"]
    assert chains and chains[0]["ms_per_step"] < 0.01 * 600
    assert "elementwise_chain" not in {c["id"] for c in doc.diagnosis.causes}


@pytest.mark.parametrize("chain_ms,named", [(9.9, False), (10.1, True)])
def test_a_chain_from_ten_percent_of_the_step(chain_ms, named):
    chain = {"name": "aten::mul → aten::add → aten::gelu", "ops": ["aten::mul", "aten::add", "aten::gelu"],
             "length": 3, "per_step": 4.0, "ms_per_step": chain_ms}
    rank = {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": 100.0} for k in range(2)],
                         "elementwise_chains": [chain], "top_ops": []}}
    found = cs.causes(_ctx({0: rank}, bound="memory", shares={"memory": 0.7}))
    assert [c["id"] for c in found] == (["elementwise_chain"] if named else [])
    if named:
        assert "runs 4 times per traced step" in found[0]["text"]


# -- DataLoader workers: busy on the CPU, or idle while the step waits ---------------------------


def _worker_rank(workers_cpu: float, workers: int = 4, cpus: int = 16):
    samples = [{"t": float(i), "host": {"dataloader_workers": workers, "dataloader_workers_cpu_ratio": workers_cpu}}
               for i in range(5)]
    loader = {**LOADER, "num_workers": workers, "prefetch_factor": 2, "cpus": cpus, "local_ranks": 2}
    return {"analysis": {"loader": loader, "steps": [], "top_ops": []}, "samples": samples}


@pytest.mark.parametrize("workers_cpu,kind", [(3.25, "busy"), (3.15, None), (1.25, None), (1.15, "idle")])
def test_loader_workers_busy_from_eighty_and_idle_under_thirty_percent(workers_cpu, kind):
    found = cs.causes(_ctx({0: _worker_rank(workers_cpu)}, bound="data", shares={"data": 0.6}))
    assert [c["evidence"]["kind"] for c in found if c["id"] == "data_loader_workers"] == ([kind] if kind else [])
    if kind == "busy":  # 16 CPUs for 2 local ranks: 8 each, one left to training, 4 workers already
        assert "Raise num_workers from 4 to 7" in found[0]["action"]


@pytest.mark.parametrize("host_cpu,kind", [(0.91, "busy"), (0.89, None)])
def test_workers_between_the_thresholds_are_busy_on_a_host_with_its_cpus_taken(host_cpu, kind):
    """Workers at 50% of their cores wait neither on reads nor on nothing: on a host whose CPUs are
    90% busy or more they are CPU-bound and short of CPUs, and no more of them are asked for."""
    rank = _worker_rank(2.0)
    for s in rank["samples"]:
        s["host"]["cpu_ratio"] = host_cpu
    found = [c for c in cs.causes(_ctx({0: rank}, bound="data", shares={"data": 0.6})) if c["id"] == "data_loader_workers"]
    assert [c["evidence"]["kind"] for c in found] == ([kind] if kind else [])
    if kind:
        assert found[0]["evidence"]["host_cpu"] == host_cpu
        assert "with the host's CPUs 91% busy" in found[0]["text"]
        assert "The host's CPUs are all in use (91% busy)" in found[0]["action"] and "expect" not in found[0]


@pytest.mark.parametrize("waiting,kind", [(2.45, "busy"), (2.35, "idle")])
def test_workers_that_use_little_cpu_but_wait_for_one_are_busy(waiting, kind):
    """4 workers use 0.8 CPUs (20% of theirs, under loader_workers_idle) on a host 60% busy (under
    loader_host_cpu_saturated): waiting for a CPU 0.6 s a second each or more, they are CPU-bound
    and short of CPUs, not waiting on reads (their use and wait reach loader_workers_busy)."""
    th = dt.load_tree().thresholds
    assert (th["loader_workers_busy"], th["loader_workers_idle"]) == (0.8, 0.3)
    rank = _worker_rank(0.8)
    for s in rank["samples"]:
        s["host"].update(cpu_ratio=0.6, dataloader_workers_runqueue_ratio=waiting)
    (found,) = [c for c in cs.causes(_ctx({0: rank}, bound="data", shares={"data": 0.6}))
                if c["id"] == "data_loader_workers"]
    assert found["evidence"]["kind"] == kind and found["evidence"]["workers_waiting_for_cpu"] == waiting
    if kind == "busy":
        assert "with the host's CPUs 60% busy and 2.5 s a second spent waiting for a CPU" in found["text"]
        assert found["action"].startswith("The CPUs the workers may use are all taken (they wait for one), so more")
        assert "expect" not in found
    else:
        assert "the workers wait on reads" in found["text"]


def test_busy_workers_on_a_full_host_are_told_to_do_less_per_sample():
    (cause,) = cs.causes(_ctx({0: _worker_rank(3.9, cpus=8)}, bound="data", shares={"data": 0.6}))
    assert "The 4 CPUs of each rank are all in use" in cause["action"]


# -- the collective exposing the most time ------------------------------------------------------


def _coll_rank(calls: int, nbytes: float, exposed_us: float, step_ms: float = 100.0, after=()):
    colls = [{"name": "all_reduce", "pg": "0", "bytes": nbytes, "dur_us": exposed_us, "ts_us": float(i),
              "exposed": [[0.0, exposed_us]], "after_backward": after[i] if i < len(after) else None}
             for i in range(2 * calls)]
    return {"analysis": {"steps": [{"step": k, "evidence": "trace", "duration_ms": step_ms} for k in range(2)],
                         "collectives": colls, "top_ops": []}}


@pytest.mark.parametrize("exposed_us,named", [(4900.0, False), (5100.0, True)])  # 5% of a 100 ms step
def test_an_exposed_collective_from_five_percent_of_the_step(exposed_us, named):
    found = cs.causes(_ctx({0: _coll_rank(1, 64e6, exposed_us)}, bound="comm", shares={"comm": 0.5}))
    assert [c["id"] for c in found] == (["exposed_collectives"] if named else [])


@pytest.mark.parametrize("nbytes,calls,small", [(1048575, 8, True), (1048577, 8, False), (1048575, 7, False)])
def test_many_small_collectives_are_told_from_large_ones(nbytes, calls, small):
    (cause,) = cs.causes(_ctx({0: _coll_rank(calls, nbytes, 2000.0)}, bound="comm", shares={"comm": 0.5}))
    assert ("raise DDP's bucket_cap_mb" in cause["action"]) is small
    assert ("ddp.no_sync()" in cause["action"]) is not small


def test_the_nccl_log_and_fabric_measurement_are_joined_in():
    nccl = {"bandwidth_summary": "all_reduce bus bandwidth 3.1 GB/s, 12% of expected",
            "log_findings": [{"id": "ib_disabled", "severity": "warning", "message": "InfiniBand is disabled.",
                              "advice": "Unset NCCL_IB_DISABLE."}]}
    (cause,) = cs.causes(_ctx({0: _coll_rank(1, 64e6, 20000.0)}, bound="comm", shares={"comm": 0.5}, nccl=nccl))
    assert "The run's own diag nccl measured all_reduce bus bandwidth 3.1 GB/s" in cause["text"]
    assert "NCCL's log: InfiniBand is disabled." in cause["text"] and cause["action"].endswith("First: Unset NCCL_IB_DISABLE.")
    assert cause["evidence"]["nccl_log_findings"] == ["ib_disabled"]


@pytest.mark.parametrize("after,late", [((True, False, False, False), False), ((True, True, False, False), True)])
def test_a_collective_after_backward_from_half_its_calls(after, late):
    """Half of the calls (2 of 4, two steps) starting after backward has ended is lost overlap."""
    (cause,) = cs.causes(_ctx({0: _coll_rank(2, 64e6, 20000.0, after=after)}, bound="comm", shares={"comm": 0.5}))
    assert ("start after backward has ended" in cause["text"]) is late
    assert cause["action"].startswith("Start all_reduce during backward") is late


# -- device-memory allocation in the driver -----------------------------------------------------

ALEXNET = "a100_alexnet_benchmark_allocator.json.gz"  # tests/fixtures/real, HTA's test data


def test_allocator_calls_are_named_on_a_real_a100_trace():
    """HTA's AlexNet benchmark holds the host 8.5 s in cudaFree and cudaMalloc, judged whole
    (no steps): the calls and times are the file's own, and replaying the step without them
    takes exactly their time off the host-bound step."""
    import gzip
    import json
    from pathlib import Path

    from diag.analyzers.analyze import analyze_paths

    path = Path(__file__).parent / "fixtures" / "real" / ALEXNET
    doc = analyze_paths([str(path)], jobs=1)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "allocator_calls"]
    with gzip.open(path) as f:
        runtime = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "cuda_runtime"]
    calls = {c["name"]: c for c in cause["evidence"]["calls"]}
    for name in ("cudaFree", "cudaMalloc"):
        mine = [e["dur"] for e in runtime if e["name"] == name]
        assert calls[name]["calls_per_step"] == len(mine)
        assert calls[name]["ms_per_step"] == pytest.approx(sum(mine) / 1e3, rel=1e-6)
        assert calls[name]["longest_ms"] == pytest.approx(max(mine) / 1e3, rel=1e-6)
    assert "cudaFree 15 times" in cause["text"] and "judged whole, start-up included" in cause["text"]
    assert "empty_cache()" in cause["action"] and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in cause["action"]
    pred = cause["what_if"]
    assert pred["change"] == "no_allocator_calls"
    assert pred["baseline_step_ms"] - pred["predicted_step_ms"] == pytest.approx(cause["evidence"]["ms_per_step"],
                                                                                 rel=1e-3)


def test_a_trace_without_allocator_calls_names_none(real_data):
    doc = _analyse(real_data, "v100_1rank_compute.json.gz")
    assert ranks_of(doc)[0]["allocator"] == []
    assert "allocator_calls" not in {c["id"] for c in doc.diagnosis.causes}


def _alloc_rank(ms, names=("cudaFree",), step_ms=100.0):
    calls = [{"name": n, "calls_per_step": 2.0, "ms_per_step": ms / len(names), "longest_ms": ms / 4} for n in names]
    return {"analysis": {"steps": [{"step": 0, "evidence": "trace", "duration_ms": step_ms}], "allocator": calls}}


@pytest.mark.parametrize("ms,named", [(4.9, False), (5.1, True)])
def test_allocator_calls_from_five_percent_of_the_step(ms, named):
    assert dt.load_tree().thresholds["allocator_step_share"] == 0.05
    found = cs.causes(_ctx({0: _alloc_rank(ms)}))
    assert [c["id"] for c in found] == (["allocator_calls"] if named else [])


def test_allocations_alone_ask_for_fixed_sizes_and_hip_names_its_own_setting():
    (cause,) = cs.causes(_ctx({0: _alloc_rank(20.0, names=("hipMalloc",))}))
    assert "pad batches to a few fixed lengths" in cause["action"] and "empty_cache" not in cause["action"]
    assert "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True" in cause["action"]


def test_a_cold_first_launch_makes_no_launch_bound_cause(real_data, tmp_path):
    """The A100 trace's launches are cheap; one of them made as slow as a cold first launch
    (lazy module loading: 300 ms) would, summed per step, hold the host past both launch
    thresholds. Its median call is what the step pays each time: no launch-bound cause, and the
    slow call is kept apart in the facts."""
    import gzip
    import json

    events = _trace_events(real_data, "a100_2rank_nccl.json.gz")
    launches, n = _in_steps(events, lambda e: e.get("name") == "cudaLaunchKernel")
    first = min(launches, key=lambda e: e["ts"])
    first["dur"] = 300_000
    path = tmp_path / "cold_first_launch.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    from diag.analyzers.analyze import analyze_paths

    doc = analyze_paths([str(path)], jobs=1)
    lf = ranks_of(doc)[0]["launches"]
    th = dt.load_tree().thresholds
    step_ms = max(s["duration_ms"] for s in ranks_of(doc)[0]["steps"] if s.get("evidence") == "trace")
    # Summed, the one slow call would pass both thresholds.
    assert lf["launch_ms_per_step"] >= th["launch_bound_ratio"] * lf["kernel_ms_per_step"]
    assert lf["launch_ms_per_step"] >= th["launch_bound_step_share"] * step_ms
    assert lf["max_launch_us"] == 300_000
    others = sorted(e["dur"] for e in launches if e is not first)
    assert lf["median_launch_us"] <= others[len(others) // 2 + 1]
    assert "launch_bound" not in {c["id"] for c in doc.diagnosis.causes}


@pytest.mark.parametrize("forwards,micro", [(2.9, None), (3.0, 1.5)])  # 2 optimizer steps per traced step
def test_ddp_all_reducing_every_micro_batch_from_one_and_a_half_passes_per_step(forwards, micro):
    """DDP all-reduces after each micro-batch's backward once a step runs 1.5 forward passes per
    optimizer step: no_sync() is the action, with the replay of exactly that as its prediction."""
    assert dt.load_tree().thresholds["accumulation_min_micro_batches"] == 1.5
    rank = _coll_rank(1, 64e6, 20000.0)
    rank["analysis"]["accumulation"] = {"forwards_per_step": forwards, "optimizer_steps_per_step": 2.0}
    entry = {"change": "ddp_no_sync_accumulation", "description": "once per optimizer step",
             "baseline_step_ms": 100.0, "predicted_step_ms": 90.0, "speedup": 1.11, "fixes": "comm"}
    (cause,) = cs.causes(_ctx({0: rank}, bound="comm", shares={"comm": 0.5}, what_if=[entry]))
    assert cause["evidence"]["micro_batches"] == micro
    assert cause["action"].startswith("All-reduce once per optimizer step") is bool(micro)
    if micro:
        assert "runs 1.5 forward and backward passes" in cause["text"]
        assert cause["expected"]["action"] == "no_sync() on all but the last micro-batch"
        assert cause["expected"]["expected_step_ms"] == 90.0 and cause["what_if"]["change"] == entry["change"]
    else:
        assert cause["what_if"] is None and cause["expected"] is None  # no backend named: no hook to replay


@pytest.mark.parametrize("backend,hook", [("nccl", "bf16_compress_hook"), ("gloo", None), (None, None)])
def test_the_compression_hook_is_the_one_the_backend_runs(backend, hook):
    """bf16_compress_hook is DDP's only on NCCL (it refuses others); gloo's fp16 reduction runs in
    software, slower than the bytes it saves: no hook is advised or replayed there."""
    rank = _coll_rank(1, 64e6, 20000.0)
    rank["analysis"]["backend"] = backend
    entry = {"change": "compressed_collective", "description": "half the bytes", "baseline_step_ms": 100.0,
             "predicted_step_ms": 90.0, "speedup": 1.11, "fixes": "comm"}
    (cause,) = cs.causes(_ctx({0: rank}, bound="comm", shares={"comm": 0.5}, what_if=[entry]))
    assert cause["evidence"]["compression_hook"] == hook
    assert ("default_hooks.bf16_compress_hook" in cause["action"]) is bool(hook)
    if hook:
        e = cause["expected"]
        assert e["action"] == "the bf16 compression hook" and e["expected_step_ms"] == 90.0
        assert e["low_ms"] <= 90.0 and e["high_ms"] >= 95.0  # the slow end: half the gain
    else:
        assert cause["what_if"] is None and "do not pay here" in cause["action"]


def test_a_ceiling_reads_as_a_sentence():
    """The change's description follows "replayed so that", its acronyms kept: not "replayed
    with the input pipeline is fully hidden", nor "dDP"."""
    from diag.analyzers.diagnosis.recommendations import _replay_text

    tree = dt.load_tree()
    for change in ("no_data_wait", "ddp_no_sync_accumulation"):
        entry = next(c for c in tree.what_if if c["id"] == change)
        text = _replay_text({"baseline_step_ms": 10.0, "predicted_step_ms": 5.0, "change": change,
                             "description": entry["description"]})
        assert "replayed so that " in text
    assert "replayed so that the input pipeline is fully hidden" in _replay_text(
        {"baseline_step_ms": 10.0, "predicted_step_ms": 5.0, "change": "no_data_wait",
         "description": "The input pipeline is fully hidden"})
    assert "replayed so that DDP all-reduces" in _replay_text(
        {"baseline_step_ms": 10.0, "predicted_step_ms": 5.0, "change": "x", "description": "DDP all-reduces"})


def test_the_causes_catalogue_is_what_the_rules_say():
    """docs/causes.md is generated from the cause rules: a rule added, or a detector's docstring
    changed, without regenerating it fails here."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "docs" / "generate_causes.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "docs" / "causes.md").read_text()
    assert all(f"## `{r.id}`" in text for r in cs.RULES)
