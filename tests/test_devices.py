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
