"""The matrix ops doing a step's work, by shape and dtype: a real V100 trace's convolutions,
a real CPU profiler run's linear layers, and the cause rule above and below its thresholds."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch.profiler import profile, schedule

from diag.analyzers.analysis_types import facts_document
from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.trace import matrix_ops
from diag.analyzers.trace.analysis import trace_facts
from diag.collectors.loader_facts import cpu_facts
from tests.test_causes import _ctx

# What the analysis measures by under the default tree.
FACTS = load_tree().facts

RESNET = "v100_resnet50_workers0_oldschema.json.gz"
V100_FP32_TFLOPS = 15.7


def _conv_from_the_file(path, dims):
    """The calls and kernel microseconds of the file's aten::conv2d ops with these input dims,
    in its ProfilerStep spans: kernels found by their External id's op, inside the conv2d's span
    on its thread (the cuDNN op nested in it launches them)."""
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name")).startswith("ProfilerStep#")]
    ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "Operator" and "External id" in e["args"]}
    convs = [e for e in events if e.get("cat") == "Operator" and e["name"] == "aten::conv2d"
             and e["args"].get("Input Dims", [])[:2] == dims and any(lo <= e["ts"] < hi for lo, hi in steps)]
    us = 0.0
    for k in (e for e in events if e.get("cat") == "Kernel"):
        op = ops.get(k["args"].get("external id"))
        if op is not None and any(c["tid"] == op["tid"] and c["ts"] <= op["ts"] <= c["ts"] + c["dur"] for c in convs):
            us += k["dur"]
    return len(convs), us, len(steps)


def test_convolutions_by_shape_on_a_real_v100_resnet_trace(real_data):
    """HTA's V100 ResNet-50 trace records input shapes: each conv2d group's calls, kernel time
    and rate are the file's own, against the V100's fp32 peak (15.7 TFLOP/s)."""
    path = real_data / "traces" / RESNET
    facts = trace_facts(str(path), FACTS).causes.matrix_ops
    top = facts["groups"][0]
    assert (top["op"], top["shapes"], top["dtype"]) == ("aten::conv2d", "32x256x14x14, 1024x256x1x1", "fp32")
    calls, us, n = _conv_from_the_file(path, [[32, 256, 14, 14], [1024, 256, 1, 1]])
    assert top["calls_per_step"] == pytest.approx(calls / n) and top["ms_per_step"] == pytest.approx(us / 1e3 / n, rel=1e-3)
    flops = 2 * 32 * 1024 * 14 * 14 * 256  # a 1x1 convolution: output elements x input channels, twice
    assert top["tflops"] == pytest.approx(calls * flops / (us * 1e-6) / 1e12, rel=1e-3)
    assert top["peak_fraction"] == pytest.approx(top["tflops"] / V100_FP32_TFLOPS, rel=1e-3)
    assert top["misaligned"] == []  # 256 and 1024 channels: whole tiles


def test_the_real_resnet_trace_names_no_compute_cause_while_data_bounds_it(real_data):
    from diag.analyzers.analyze import analyze_paths

    doc = analyze_paths([str(real_data / "traces" / RESNET)], jobs=1)
    assert doc.diagnosis.bound != "compute"
    assert "matrix_ops" not in {c["id"] for c in doc.diagnosis.causes}


STEPS = 3


def _mlp_trace(tmp_path):
    """A real CPU profiler run of two linear layers (batch 256, 512 -> 384 -> 512), with shapes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.ReLU(), torch.nn.Linear(384, 512))
    x = torch.randn(256, 512)
    path = tmp_path / "mlp.pt.trace.json"
    with profile(record_shapes=True, schedule=schedule(wait=0, warmup=1, active=STEPS),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(STEPS + 1):
            model(x).pow(2).mean().backward()
            prof.step()
    return path


def _linear_from_the_file(path, dims):
    events = json.loads(path.read_text())["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name")).startswith("ProfilerStep#")]
    hits = [e for e in events if e.get("name") == "aten::linear" and e["args"].get("Input Dims", [])[:2] == dims
            and any(lo <= e["ts"] < hi for lo, hi in steps)]
    return len(hits), sum(e["dur"] for e in hits), len(steps)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    path = _mlp_trace(tmp_path_factory.mktemp("mlp"))
    return path, trace_facts(str(path), FACTS)


def test_linear_layers_by_shape_on_a_real_cpu_profiler_run(mlp):
    path, facts = mlp
    groups = {(g["op"], g["shapes"]): g for g in facts.causes.matrix_ops["groups"]}
    first = groups[("aten::linear", "256x512, 384x512, 384")]
    calls, us, n = _linear_from_the_file(path, [[256, 512], [384, 512]])
    assert first["calls_per_step"] == calls / n == 1 and first["ms_per_step"] == pytest.approx(us / 1e3 / n, rel=1e-3)
    assert first["tflops"] == pytest.approx(2 * 256 * 512 * 384 / (us / n * 1e-6) / 1e12, rel=1e-3)
    # No peak for a CPU without a calibration; a CPU's vector units are not judged by tensor-core tiles.
    assert first["peak_fraction"] is None and first["misaligned"] == [] and first["dtype"] == "fp32"
    # The weight gradients are aten::mm groups of their own (the backward pass's products).
    assert any(op == "aten::mm" for op, _ in groups)


def _rank_of(facts, bf16_units):
    return {"analysis": facts_document(facts), "info": {"cpu": {"cpus": 2, "torch_threads": 2, "isa": "AVX2", "bf16_units": bf16_units}}}


def test_matrix_ops_on_a_cpu_without_bf16_units_name_the_work_and_no_change(mlp):
    _, facts = mlp
    (cause,) = [c for c in cs.causes(_ctx({0: _rank_of(facts, False)}, bound="compute", shares={"compute": 0.9}))
                if c["id"] == "matrix_ops"]
    # The three groups taking the most time, by op and shape (which three is the run's timing).
    for g in cause["evidence"]["groups"][:3]:
        assert f"{g['op']} on {g['shapes']} in fp32" in cause["text"]
    assert "This CPU (AVX2) has no bf16 matrix units" in cause["action"] and cause["what_if"] is None


def test_matrix_ops_on_a_cpu_with_bf16_units_replay_bf16(mlp):
    """The replayed change takes away half of the fp32 matrix ops' compute time (the TOML's
    speedup of 2): the predicted step is the measured one less about that."""
    _, facts = mlp
    assert dt.load_tree().thresholds["cpu_half_precision_speedup"] == 2.0
    entry = next(e for e in facts.what_if if e.get("change") == "half_precision_matrix_ops")
    (cause,) = [c for c in cs.causes(_ctx({0: _rank_of(facts, True)}, bound="compute", shares={"compute": 0.9},
                                          what_if=[entry])) if c["id"] == "matrix_ops"]
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in cause["action"]
    # Step by step, the replay takes away half of the compute time inside the ops (their spans,
    # less the little host time inside them).
    saved = [s["replayed_ms"] - s["what_if_ms"]["half_precision_matrix_ops"] for s in facts.steps]
    assert len(saved) == STEPS
    assert sum(saved) / STEPS == pytest.approx(0.5 * facts.causes.matrix_ops["ms_per_step"], rel=0.1)
    assert cause["what_if"]["predicted_step_ms"] == entry["predicted_step_ms"]


def _group(ms, peak=None, misaligned=(), dtype="bf16"):
    return {"name": f"aten::mm({ms}) {dtype}", "op": "aten::mm", "shapes": "4096x1000, 1000x4096", "dtype": dtype,
            "calls_per_step": 2.0, "ms_per_step": ms, "tflops": 100.0, "peak_fraction": peak,
            "misaligned": list(misaligned)}


def _device_rank(matrix_ms, peak=0.7, misaligned=()):
    m = {"ms_per_step": matrix_ms, "compute_ms_per_step": 100.0, "groups": [_group(matrix_ms, peak, misaligned)]}
    return {"analysis": {"steps": [], "top_ops": [], "timeline": "device", "matrix_ops": m}}


@pytest.mark.parametrize("matrix_ms,named", [(29.0, False), (31.0, True)])
def test_matrix_ops_from_thirty_percent_of_the_compute_time(matrix_ms, named):
    assert dt.load_tree().thresholds["matrix_ops_compute_share"] == 0.30
    found = cs.causes(_ctx({0: _device_rank(matrix_ms)}, bound="compute", shares={"compute": 0.9}))
    assert [c["id"] for c in found] == (["matrix_ops"] if named else [])
    if named:  # bf16 at 70% of peak, whole tiles: the work itself
        assert "near the device's peak" in found[0]["action"] and found[0]["what_if"] is None


@pytest.mark.parametrize("peak,slow", [(0.39, True), (0.41, False)])
def test_matrix_ops_under_forty_percent_of_peak_are_too_small(peak, slow):
    (cause,) = cs.causes(_ctx({0: _device_rank(50.0, peak)}, bound="compute", shares={"compute": 0.9}))
    assert ("reaches 39% of peak" in cause["action"]) is slow


def test_misaligned_dimensions_are_padded():
    dims = matrix_ops.gemm_dims("aten::linear", [[8, 512, 1000], [4096, 1000], [4096]])
    assert dims == {"M": 4096, "K": 1000, "N": 4096}
    assert matrix_ops.misaligned(dims, "bf16") == []  # 1000 is a multiple of 8
    assert matrix_ops.misaligned({"M": 4096, "K": 1001, "N": 50257}, "bf16") == [
        "K=1001 (not a multiple of 8)", "N=50257 (not a multiple of 8)"]
    assert matrix_ops.misaligned({"M": 4096, "K": 1002, "N": 4096}, "fp32") == ["K=1002 (not a multiple of 4)"]
    assert matrix_ops.gemm_dims("aten::conv2d", [[32, 3, 224, 224], [64, 3, 7, 7]]) == {"C_in": 3, "C_out": 64}
    (cause,) = cs.causes(_ctx({0: _device_rank(50.0, 0.7, ["N=50257 (not a multiple of 8)"])}, bound="compute",
                              shares={"compute": 0.9}))
    assert cause["action"].startswith("Pad aten::mm on 4096x1000, 1000x4096 to tile-sized dimensions (N=50257")


@pytest.mark.parametrize("flags,units", [("fpu avx2 avx512f amx_bf16 amx_tile", True), ("fpu avx2", False)])
def test_the_cpu_says_whether_it_has_bf16_units(tmp_path, flags, units):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_facts(str(info))["bf16_units"] is units
    assert cpu_facts(str(tmp_path / "absent"))["bf16_units"] is None


def test_a_step_cut_by_the_jobs_end_is_no_traced_step(tmp_path):
    """A window the job's end cuts holds the step then in progress, around the exit's own work
    only: per-step facts over the completed steps (1-3) count each layer once per step, where
    counting the cut step too would make it 0.75 times."""
    model = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    path = tmp_path / "cut.json"
    with profile(record_shapes=True) as prof:
        for step in range(1, 5):
            with torch.autograd.profiler.record_function(f"ProfilerStep#{step}"):
                if step < 4:  # step 4 is the one the job's end cut: no training work in it
                    model(x).sum().backward()
                else:
                    torch.zeros(1)
    prof.export_chrome_trace(str(path))
    cut = trace_facts(str(path), FACTS, step_range=(1, 3))
    whole = trace_facts(str(path), FACTS)
    assert [s["step"] for s in cut.steps] == [1, 2, 3] and len(whole.steps) == 4
    forward = next(g for g in cut.causes.matrix_ops["groups"] if g["op"] in ("aten::linear", "aten::addmm"))
    assert forward["calls_per_step"] == 1
    assert next(g for g in whole.causes.matrix_ops["groups"] if g["name"] == forward["name"])["calls_per_step"] == 0.75
