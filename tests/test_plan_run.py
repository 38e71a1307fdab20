"""`diag plan --run`: plans grounded in an agent run, and the memory section of its report.

The demo run (2 gloo ranks, the healthy MLP 512-512-512-10 on batches of 2048) is the
input; every expected figure below is computed here from the demo model's shapes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_run_dir as analyze_run

LAYERS = ((512, 512), (512, 512), (512, 10))
BATCH = 2048
PARAMS = sum(i * o + o for i, o in LAYERS)
# Forward: 2*B*in*out per layer; backward: the weight gradients (as much again) and the input
# gradients of every layer but the first, whose input needs none.
FLOPS = 2 * BATCH * sum(i * o for i, o in LAYERS) * 2 + 2 * BATCH * sum(i * o for i, o in LAYERS[1:])


def _diag(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def demo_run(demo_run_dir):
    return demo_run_dir


def test_the_agent_records_the_model_and_the_profiled_flops(demo_run):
    doc = analyze_run(demo_run)
    for r in ranks_of(doc):
        m = r["model"]
        assert m["params"] == PARAMS and m["param_bytes"] == m["grad_bytes"] == 4 * PARAMS
        assert m["optimizer"] == "SGD" and m["optimizer_state_bytes"] == 0
        # Every profiled step executed exactly the model's matrix-multiplication FLOPs.
        assert r["rates"]["flops_per_step"] == FLOPS and r["rates"]["flops_per_sample"] == FLOPS / BATCH
        assert 0 < r["rates"]["profiler_dilation"] <= 1 and r["rates"]["achieved_flops_per_s"] > 0


def test_plan_run_uses_the_measured_rates_and_checks_itself(demo_run):
    doc = json.loads(_diag("plan", "--run", str(demo_run), "--json").stdout)
    facts = analyze_run(demo_run)
    achieved = sorted(r["rates"]["achieved_flops_per_s"] for r in ranks_of(facts))
    assert doc["measured"]["achieved_flops_per_s"] == pytest.approx(sum(achieved) / 2)  # the median of two
    assert doc["rates"]["flops"].startswith("measured:") and doc["rates"]["intra_busbw"].startswith("measured:")
    assert doc["layout"]["gpus"] == 2 and doc["layout"]["micro_batch"] == BATCH
    b = doc["breakdown_s"]
    assert b["compute"] == pytest.approx(FLOPS / doc["measured"]["achieved_flops_per_s"])
    # The run's own layout beside its measured unprofiled step time.
    check = doc["self_check"]
    assert check["predicted_step_s"] == doc["step_time_s"]
    assert check["error"] == pytest.approx(check["predicted_step_s"] / check["measured_step_s"] - 1)
    # A data-parallel layout of the same model: ZeRO-3 over 8 GPUs holds an eighth of each state.
    z3 = json.loads(_diag("plan", "--run", str(demo_run), "--gpus", "8", "--zero", "3", "--json").stdout)
    assert z3["per_gpu"]["params_bytes"] == z3["per_gpu"]["grads_bytes"] == 4 * PARAMS / 8
    assert z3["comm_bytes_per_step"]["all_gather"] == pytest.approx(2 * 7 / 8 * 4 * PARAMS)
    text = _diag("plan", "--run", str(demo_run)).stdout
    assert "the run's own layout: predicted" in text and "rate flops: measured:" in text
    # The demo's 530,442 parameters as people say them, not as 0.0005304B.
    assert f": {PARAMS / 1e3:.3g}K parameters" in text, text


def test_plan_run_bad_input_is_one_line(demo_run, tmp_path):
    for args, words in (((str(demo_run), "--tp", "2"), "transformer shape"),
                        ((str(demo_run), "--search"), "transformer shape"),
                        ((str(tmp_path),), "not a diag run directory")):
        proc = _diag("plan", "--run", *args, expect=2)
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_demo_report_shows_the_memory_breakdown(demo_run):
    md = (demo_run / "report.md").read_text()
    section = md[md.index("## Memory"):md.index("## What was missing")]
    assert f"| Parameters | {4 * PARAMS / 2**20:.2f} MiB |" in section
    assert f"| Gradients | {4 * PARAMS / 2**20:.2f} MiB |" in section
    assert "| Measured peak | not measured |" in section  # a CPU run: no device memory statistics
    # ZeRO-3 over the two ranks would move half of the parameters and gradients away.
    assert f"| ZeRO-3 (FSDP FULL_SHARD): also shard the parameters | +{4 * PARAMS / 2**20:.2f} MiB |" in section
    html = (demo_run / "report.html").read_text()
    assert 'class="memory-breakdown"' in html and 'class="memory-levers"' in html
    # The agent profiles with FLOPs on: MFU is missing for the CPU's unknown peak, and said so.
    missing = md[md.index("## What was missing"):]
    assert "FLOPs were counted, but the device's peak is not known" in missing
    assert "Enable with_flops" not in missing


def test_a_diag_nccl_result_in_the_run_directory_is_used(demo_run, tmp_path, real_nccl):
    """`diag nccl --run-dir` leaves RUN_DIR/nccl_bench.json; here, the parse of a real 24-rank
    all_reduce_perf run over three nodes (96.4 GB/s bus bandwidth on its largest messages)."""
    import shutil

    from diag.analyzers.nccl import nccl_tests
    from diag.atomic_io import atomic_write_json

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    atomic_write_json(run / "nccl_bench.json", nccl_tests.parse_file(real_nccl / "nccltests_NVIDIA-nccl-tests_119.txt"))
    doc = json.loads(_diag("plan", "--run", str(run), "--json").stdout)
    assert doc["rates"]["inter_busbw"].startswith("measured: 96.4 GB/s all_reduce busbw (24 ranks")
    assert doc["rates"]["inter_busbw"].endswith("in nccl_bench.json")
    assert doc["rates"]["intra_busbw"].startswith("measured:") and "the run's own" in doc["rates"]["intra_busbw"]
