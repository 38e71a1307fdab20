"""Device peak table and name matching, and CPU peaks from a real `diag calibrate` run."""

from __future__ import annotations

import json

import pytest

from diag.analyzers.trace import devices


@pytest.mark.parametrize("props, key", [
    ({"name": "NVIDIA A100-PG509-200", "totalGlobalMem": 42297524224}, "a100-40gb"),
    ({"name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 85198045184}, "a100-80gb"),
    ({"name": "NVIDIA A100 80GB PCIe", "totalGlobalMem": 85198045184}, "a100-pcie-80gb"),
    ({"name": "Tesla V100-SXM2-32GB", "totalGlobalMem": 34079637504}, "v100-sxm2"),
    ({"name": "Tesla V100-DGXS-32GB"}, "v100-sxm2"),
    ({"name": "Tesla V100-PCIE-16GB"}, "v100-pcie"),
    ({"name": "NVIDIA H100 80GB HBM3"}, "h100-sxm"),
    ({"name": "NVIDIA H100 PCIe"}, "h100-pcie"),
    ({"name": "NVIDIA H200"}, "h200"),
    ({"name": "NVIDIA B200"}, "b200"),
    ({"name": "AMD Instinct MI300X"}, "mi300x"),
    ({"name": "AMD Instinct MI250X"}, "mi250x-gcd"),
    # ROCm often reports a generic name: the MI250's GCD is 104 CUs with 64-wide wavefronts.
    ({"name": "AMD Radeon Graphics", "warpSize": 64, "numSms": 104, "totalGlobalMem": 68702699520}, "mi250-gcd"),
    ({"name": "AMD Radeon Graphics", "warpSize": 64, "numSms": 110}, "mi250x-gcd"),
    ({"name": "AMD Radeon Graphics", "warpSize": 64, "numSms": 304}, "mi300x"),
])
def test_lookup(props, key):
    d = devices.lookup(props)
    assert d is not None and d.key == key
    if props.get("totalGlobalMem"):
        assert d.mem_bytes == props["totalGlobalMem"]


def test_unknown_devices():
    assert devices.lookup(None) is None
    assert devices.lookup({"name": "AMD Radeon Graphics", "warpSize": 64, "numSms": 12}) is None
    assert devices.lookup({"name": "Mystery GPU"}) is None


def test_required_devices_have_all_peaks():
    for key in ("v100-sxm2", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi250x", "mi300x"):
        d = devices.PEAKS[key]
        assert d.mem_bw > 1e11
        for dtype in ("fp32", "fp16", "bf16"):
            assert d.peak_flops(dtype) > 1e12
    a100 = devices.PEAKS["a100-40gb"]
    assert a100.peak_flops("bf16") == 312e12 and a100.mem_bw == 1555e9
    assert a100.knee("bf16") == pytest.approx(312e12 / 1555e9)
    # V100 has no bf16 tensor cores: its bf16 peak falls back to fp16's.
    assert devices.PEAKS["v100-sxm2"].peak_flops("bf16") == 125e12
    # The tensor-core knee sits far above the fp32 knee.
    assert devices.PEAKS["h100-sxm"].knee("bf16") > 5 * devices.PEAKS["h100-sxm"].knee("fp32")


def test_cpu_peaks_from_a_real_calibration(tmp_path, monkeypatch):
    from diag import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    doc = calibrate.measure(seconds=0.4, matmul_n=128, stream_elems=1 << 18)
    path = calibrate.save(doc)
    assert path == str(tmp_path / "diag" / "cpu_peaks.json")
    assert json.loads((tmp_path / "diag" / "cpu_peaks.json").read_text())["schema"] == calibrate.SCHEMA
    cpu = devices.cpu_device()
    assert cpu is not None and cpu.key == "cpu"
    assert cpu.peak_flops("fp32") == doc["flops"]["fp32"] > 1e8
    assert cpu.mem_bw == doc["mem_bw"] > 1e8
    assert not list((tmp_path / "diag").glob(".*.tmp"))  # atomic write leaves no temp file


def test_cpu_peaks_absent_or_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert devices.cpu_device() is None
    (tmp_path / "diag").mkdir()
    (tmp_path / "diag" / "cpu_peaks.json").write_text("{not json")
    assert devices.cpu_device() is None


@pytest.mark.slow
def test_calibrate_command(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    show = subprocess.run([sys.executable, "-m", "diag", "calibrate", "--show"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert show.returncode == 2 and show.stderr.startswith("diag: error:") and "no calibration" in show.stderr
    run = subprocess.run([sys.executable, "-m", "diag", "calibrate", "--seconds", "0.3", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["flops"]["fp32"] > 1e8 and doc["mem_bw"] > 1e8
    assert json.loads((tmp_path / "diag" / "cpu_peaks.json").read_text())["mem_bw"] == doc["mem_bw"]
    again = subprocess.run([sys.executable, "-m", "diag", "calibrate", "--show"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "GB/s" in again.stdout


class _Clock:
    """A clock that moves only by the work the fake calls do."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds_per_flop", [1 / 40e9, 1 / 0.5e9])  # fp32 here, bf16 without its units
def test_the_benchmark_keeps_its_budget_however_slow_a_dtype_runs(monkeypatch, seconds_per_flop):
    """A matrix product that runs at 0.5 GFLOP/s (bf16 on a CPU without bf16 units) is sized
    down so that its stage keeps its share of the budget, where a 1024 product would take 4 s
    a call; at 40 GFLOP/s the full size fits. The rate found is the rate the calls ran at."""
    from diag import calibrate

    clock = _Clock()
    monkeypatch.setattr(calibrate.time, "perf_counter", clock)

    def product(n):
        def run():
            clock.now += 2.0 * n**3 * seconds_per_flop
        return run

    budget = 0.75  # one stage of a 3 s calibration
    n = calibrate._matmul_size(lambda k: product(k)(), 1024, budget)
    spent_sizing = clock.now
    start = clock.now
    rate = calibrate._best_rate(product(n), 2.0 * n**3, budget)
    assert rate == pytest.approx(1 / seconds_per_flop)
    assert clock.now - start <= budget + 2.0 * n**3 * seconds_per_flop  # the budget, and one call past it at most
    assert spent_sizing <= budget / 4
    assert n == (1024 if seconds_per_flop < 1e-10 else 256)


def test_a_busy_machine_is_said(monkeypatch, capsys, tmp_path):
    """Peaks measured while other work holds the CPUs come out low: the command says so."""
    import argparse

    from diag import calibrate
    from diag.commands import calibrate as command

    monkeypatch.setattr(calibrate, "busy_percent", lambda sample_s=0.3: 80.0)
    command.run(argparse.Namespace(show=False, seconds=0.2, json=False, cache=str(tmp_path / "peaks.json")))
    err = capsys.readouterr().err
    assert "diag calibrate: fp32 matrix multiply" in err and "diag calibrate: memory bandwidth" in err
    assert "80% of this machine's CPUs were busy with other work" in err
    assert json.loads((tmp_path / "peaks.json").read_text())["busy_cpu_percent"] == 80.0
