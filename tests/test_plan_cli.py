"""`diag plan`: one layout's memory, fit, communication and step time, and `--search`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diag.analyzers.plan.memory import activations_per_layer, model_states
from diag.analyzers.plan.models import preset
from diag.analyzers.plan.planner import Job, Rates, plan

GIB = 2**30


def _plan(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "diag", "plan", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == expect, proc.stderr
    return proc


def test_the_zero_paper_figures_through_the_command():
    """7.5B parameters on 64 GPUs: 120 / 31.4 / 16.6 / 1.9 GB of model states (ZeRO, Figure 1)."""
    for stage, published in (("0", 120.0), ("1", 31.4), ("2", 16.6), ("3", 1.9)):
        doc = json.loads(_plan("--params", "7.5e9", "--gpus", "64", "--zero", stage, "--optimizer", "adam",
                               "--json").stdout)
        assert doc["per_gpu"]["model_states_bytes"] / 1e9 == pytest.approx(published, rel=0.02)


def test_one_layout_adds_up():
    model, rates = preset("llama3-8b"), Rates(None, None, None, None)
    job = Job(gpus=8, micro_batch=1, global_batch=32, tp=2, sp=True, sharding="1", recompute="full",
              gpu_memory_bytes=80 * GIB)
    doc = plan(model, job, rates)
    g, lay = doc["per_gpu"], doc["layout"]
    assert lay["dp"] == 4 and lay["grad_accum"] == 8 and lay["global_batch"] == 32
    states = model_states(model.params(), "bf16-mixed", "adamw", "1", dp=4, tp=2)
    assert (g["params_bytes"], g["grads_bytes"], g["optimizer_bytes"]) == (
        states.params_bytes, states.grads_bytes, states.optimizer_bytes)
    per_layer = activations_per_layer(8192, 1, 4096, 32, tp=2, sp=True, recompute="full", flash=True)
    assert g["activations_per_layer_bytes"] == per_layer == 2 * 8192 * 4096 / 2
    assert g["activations_bytes"] == per_layer * 32 + g["logits_bytes"]
    assert g["total_bytes"] == pytest.approx(sum(g[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                 "activations_bytes", "allowance_bytes")))
    assert doc["fits"] is True and doc["step_time_s"] is None  # no rates, no prediction


def test_step_time_with_rates_and_its_parts():
    model = preset("llama3-70b")
    rates = Rates(flops_per_gpu=400e12, peak_flops=989e12, intra_busbw=360e9, inter_busbw=360e9,
                  sources={"flops": "test"})
    job = Job(gpus=64, micro_batch=1, global_batch=512, tp=8, sp=True, pp=2, sharding="1",
              gpu_memory_bytes=80 * GIB)
    doc = plan(model, job, rates)
    b = doc["breakdown_s"]
    assert b["compute"] == pytest.approx(doc["model_flops_per_step"] / 64 / 400e12)
    assert doc["step_time_s"] == pytest.approx(b["compute"] + b["tp_comm"] + b["pp_comm"] + b["dp_comm_exposed"]
                                               + b["pipeline_bubble"])
    assert b["pipeline_bubble"] == pytest.approx((2 - 1) / 128 * (b["compute"] + b["tp_comm"]))
    assert doc["mfu"] == pytest.approx(doc["model_flops_per_step"] / (doc["step_time_s"] * 64 * 989e12))
    assert doc["comm_bytes_per_step"]["send_recv"] > 0 and doc["comm_bytes_per_step"]["all_gather"] > 0


def test_search_for_llama3_70b_on_64_h100_explains_itself():
    proc = _plan("--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--device", "h100-sxm",
                 "--global-batch", "512", "--intra", "nvlink4", "--inter", "ib_ndr", "--nics-per-node", "8",
                 "--search", "--json")
    doc = json.loads(proc.stdout)
    assert len(doc["best"]) == 3 and doc["layouts_fitting"] > 0
    steps = [b["plan"]["step_time_s"] for b in doc["best"]]
    assert steps == sorted(steps)
    for b in doc["best"]:
        assert b["plan"]["fits"] and b["plan"]["per_gpu"]["total_bytes"] <= 80e9
        assert not b["plan"]["tp_crosses_nodes"]
    assert doc["losers"]["out_of_memory"]["count"] > 0 and "GiB per GPU" in doc["losers"]["out_of_memory"]["why"]
    assert "spans nodes" in doc["losers"]["tp_across_nodes"]["why"]
    assert "assumed" in doc["rates"]["flops"]
    text = _plan("--model", "llama3-70b", "--gpus", "64", "--device", "h100-sxm", "--global-batch", "512",
                 "--intra", "nvlink4", "--inter", "ib_ndr", "--nics-per-node", "8", "--search").stdout
    assert text.splitlines()[1].startswith("  1. tp ")


def test_the_issue_s_search_command_assumes_a_batch_and_the_reference_links():
    """`--device h100` alone: the DGX H100's links and a ~4M-token batch, both said to be assumed
    (bench/bench_plan_search.py times this command against the 2 s bound)."""
    doc = json.loads(_plan("--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--device", "h100",
                           "--search", "--json").stdout)
    assert doc["global_batch"]["sequences"] == 512 == 4 * 2**20 // 8192  # 64 GPUs x 8 sequences of 8192 tokens
    assert doc["global_batch"]["assumed"] is True
    assert "DGX H100 reference system" in doc["rates"]["intra_busbw"]
    assert "DGX H100 reference system" in doc["rates"]["inter_busbw"]
    assert doc["layouts_fitting"] > 0 and all(b["plan"]["step_time_s"] for b in doc["best"])
    assert all(b["plan"]["layout"]["global_batch"] == 512 for b in doc["best"])


@pytest.mark.parametrize("args, words", [
    (["--model", "llama3-8b", "--gpus", "8", "--tp", "3"], "does not divide"),
    (["--model", "llama3-8b", "--gpus", "12", "--tp", "3", "--pp", "1"], "not divisible by tp"),
    (["--model", "llama3-8b", "--gpus", "8", "--pp", "3"], "does not divide"),
    (["--model", "llama9-1t", "--gpus", "8"], "unknown model preset"),
    (["--hf-config", "/nonexistent/config.json", "--gpus", "8"], "no such config file"),
    (["--model", "llama3-8b", "--params", "1e9", "--gpus", "8"], "give the model once"),
    (["--model", "llama3-8b", "--gpus", "8", "--device", "tpu-v9"], "unknown device"),
    (["--model", "llama3-8b", "--gpus", "8", "--search"], "needs the GPU memory"),
])
def test_impossible_requests_are_one_line_errors(args, words):
    proc = _plan(*args, expect=2)
    assert words in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_measured_bus_bandwidth_from_nccl_tests_output(real_nccl):
    """A 24-rank all_reduce_perf run (three 8-GPU nodes) reached 96.4 GB/s busbw on its largest
    messages: the planner uses it across nodes and says so."""
    src = real_nccl / "nccltests_NVIDIA-nccl-tests_119.txt"
    doc = json.loads(_plan("--model", "llama3-70b", "--gpus", "64", "--device", "h100-sxm", "--global-batch", "512",
                           "--tp", "8", "--sp", "--pp", "2", "--intra", "nvlink4", "--nccl", str(src), "--json").stdout)
    assert doc["rates"]["inter_busbw"].startswith("measured: 96.4 GB/s all_reduce busbw (24 ranks")
    assert doc["rates"]["intra_busbw"].startswith("NVLink 4")
    b = doc["breakdown_s"]
    assert b["dp_comm"] == pytest.approx(
        (doc["comm_bytes_per_step"]["all_reduce"]) / 96.435e9, rel=1e-3)  # ZeRO-1: the gradient all-reduce
    empty = real_nccl / "nccltests_NVIDIA-nccl-tests_107.txt"  # a run with no bandwidth figures
    proc = _plan("--model", "llama3-8b", "--gpus", "8", "--nccl", str(empty), expect=2)
    assert "no bus bandwidth measurement" in proc.stderr


@pytest.mark.parametrize("intra", [None, "nvlink4", "pcie4"])
def test_inter_node_rate_is_the_network_s_on_every_device(intra):
    """The inter-node bus bandwidth a plan uses is the network's alone, whatever the GPUs' own links:
    an H100's NVLink once stood in for 8 NDR NICs, and HDR or RoCE were rated as NVLink."""
    import argparse

    from diag.analyzers.nccl.expected import INTER_LINKS, LINKS
    from diag.analyzers.trace.devices import PEAKS
    from diag.commands.plan import _rates

    for device in PEAKS.values():
        for link in INTER_LINKS:
            args = argparse.Namespace(mfu=None, intra=intra, inter=link, nics_per_node=8, nccl=None,
                                      gpus_per_node=8)
            rates = _rates(args, device, "bf16")
            spec = LINKS[link]
            assert rates.inter_busbw == pytest.approx(8 * spec.gbps * spec.efficiency * 1e9), (device.key, link)
            assert spec.label in rates.sources["inter_busbw"], (device.key, link)
            assert "NVLink" not in rates.sources["inter_busbw"] and "PCIe" not in rates.sources["inter_busbw"]


def test_the_issue_s_h100_command_rates_the_network_between_nodes():
    out = _plan("--model", "llama2-7b", "--gpus", "16", "--device", "h100-sxm", "--intra", "nvlink4",
                "--inter", "ib_ndr", "--nics-per-node", "8").stdout
    assert "rate inter_busbw: 8 x InfiniBand NDR 400 Gb/s per node: 400 GB/s x 96%" in out
    assert "rate intra_busbw: NVLink 4 (18 links, H100): 450 GB/s x 80%" in out
