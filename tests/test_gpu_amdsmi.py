"""amdsmi sampling against the real amdsmi package, with only libamd_smi.so replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_gpu_libs import FakeAmdGpu, forget_amdsmi, install_fake_amdsmi, rocm_symbols

from diag.collectors import device_map, gpu_amdsmi
from diag.collectors.gpu_amdsmi import AmdSmiGpu


@pytest.fixture
def amd(monkeypatch):
    """The real amdsmi package bound to a fake library, on a node that has the AMD driver."""
    fake = install_fake_amdsmi(monkeypatch)
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    yield fake
    forget_amdsmi()


@pytest.fixture
def logs():
    return []


def _uuid(i: int) -> str:
    return f"GPU-{i:04d}a1b2c3d4e5f6"


def _gpus(n=4, enumeration=True, **kw):
    return [FakeAmdGpu(uuid=_uuid(i), hip_id=(i if enumeration else None), **kw) for i in range(n)]


def test_the_real_amdsmi_package_runs_over_the_fake_library(amd):
    import amdsmi

    assert "site-packages" in sys.modules["amdsmi.amdsmi_interface"].__file__
    amd.gpus = _gpus(1)
    amdsmi.amdsmi_init()
    assert len(amdsmi.amdsmi_get_processor_handles()) == 1
    assert amd.calls["amdsmi_get_processor_handles"] == 2  # count, then fill: the real wrapper's protocol


def test_values_flow_through_with_base_units(amd, logs):
    amd.gpus = _gpus(
        2, gfx_activity=64, vram_total_mb=196_592, vram_used_mb=50_000, gfx_clock_mhz=2100,
        socket_power_w=650, energy_ticks=2_000_000, energy_resolution_uj=15.3, temps={"HOTSPOT": 81, "EDGE": 60},
    )
    gpu = AmdSmiGpu.open(1, logs.append, {})
    assert gpu is not None and logs == []
    info = gpu.info()
    assert info["vendor"] == "amd" and info["name"] == "AMD Instinct MI300X"
    assert info["uuid"] == _uuid(1) and info["physical_index"] == 1
    assert info["driver_version"] == "6.10.5"
    assert info["memory_total_bytes"] == 196_592 * 1024**2
    s = gpu.read()
    assert s["utilization_ratio"] == pytest.approx(0.64)
    assert s["memory_used_bytes"] == 50_000 * 1024**2
    assert s["memory_total_bytes"] == 196_592 * 1024**2
    assert s["sm_clock_hz"] == 2_100_000_000
    assert s["power_watts"] == 650.0
    assert s["energy_joules_total"] == pytest.approx(2_000_000 * 15.3e-6, rel=1e-6)
    assert s["temperature_celsius"] == 81.0  # hotspot preferred
    amd.gpus[1].gfx_activity = 5
    assert gpu.read()["utilization_ratio"] == pytest.approx(0.05)
    gpu.close()


def test_na_values_and_unsupported_calls_are_switched_off(amd, logs):
    # An MI200-like part: no socket power (reads 0xFFFF = "N/A"), only the average;
    # an older library without energy counters; only an edge sensor.
    amd.gpus = _gpus(1, socket_power_w=0xFFFF, average_power_w=300, temps={"EDGE": 55},
                     unsupported={"amdsmi_get_energy_count"})
    gpu = AmdSmiGpu.open(0, logs.append, {})
    s = gpu.read()
    assert s["power_watts"] == 300.0
    assert s["temperature_celsius"] == 55.0
    assert "energy_joules_total" not in s
    assert list(gpu.info()["unsupported"]) == ["energy"]
    calls = amd.calls["amdsmi_get_energy_count"]
    gpu.read()
    assert amd.calls["amdsmi_get_energy_count"] == calls == 1
    assert len(logs) == 1 and "energy" in logs[0]


def test_activity_reporting_na_is_unsupported(amd, logs):
    amd.gpus = _gpus(1, gfx_activity=0xFFFF)
    gpu = AmdSmiGpu.open(0, logs.append, {})
    assert "utilization_ratio" not in gpu.read()
    assert "N/A" in gpu.info()["unsupported"]["utilization"]


def test_a_metric_failing_later_is_switched_off_once(amd, logs):
    amd.gpus = _gpus(1, fail_after={"amdsmi_get_gpu_vram_usage": (2, 10)})  # 10: AMDSMI_STATUS_NO_PERM
    gpu = AmdSmiGpu.open(0, logs.append, {})
    assert "memory_used_bytes" in gpu.read()
    for _ in range(3):
        s = gpu.read()
        assert "memory_used_bytes" not in s and s["utilization_ratio"] == pytest.approx(0.64)
    assert amd.calls["amdsmi_get_gpu_vram_usage"] == 3
    assert len([m for m in logs if "memory" in m]) == 1 and "AmdSmiLibraryException" in logs[0]


@pytest.mark.parametrize(
    "env, logical, expected",
    [
        ({}, 3, 3),
        ({"HIP_VISIBLE_DEVICES": "2,3"}, 1, 3),
        ({"CUDA_VISIBLE_DEVICES": "3,1"}, 1, 1),  # HIP honours CUDA_VISIBLE_DEVICES too
        ({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "3"}, 0, 1),  # HIP's own wins
        ({"ROCR_VISIBLE_DEVICES": "1,2,3"}, 0, 1),
        ({"ROCR_VISIBLE_DEVICES": "1,2,3", "HIP_VISIBLE_DEVICES": "2"}, 0, 3),  # HIP indexes ROCr's list
        ({"ROCR_VISIBLE_DEVICES": f"{_uuid(2)},{_uuid(0)}"}, 1, 0),
        ({"HIP_VISIBLE_DEVICES": _uuid(3)}, 0, 3),
    ],
)
def test_visibility_variables_select_the_physical_device(amd, logs, env, logical, expected):
    amd.gpus = _gpus(4)
    gpu = AmdSmiGpu.open(logical, logs.append, env)
    assert gpu is not None, logs
    assert gpu.info()["physical_index"] == expected and gpu.info()["uuid"] == _uuid(expected)
    amd.gpus[expected].gfx_activity = 99
    assert gpu.read()["utilization_ratio"] == pytest.approx(0.99)


def test_hip_order_is_taken_from_enumeration_info_not_handle_order(amd, logs):
    # amdsmi lists handles by PCI address; HIP may number them differently.
    amd.gpus = [FakeAmdGpu(uuid=_uuid(i), hip_id=h) for i, h in enumerate([2, 0, 3, 1])]
    gpu = AmdSmiGpu.open(0, logs.append, {})
    assert gpu.info()["uuid"] == _uuid(1) and gpu.info()["physical_index"] == 0


def test_older_library_without_enumeration_info_waits_for_torch_then_matches_the_pci_address(amd, logs):
    # Before ROCm 6.4 amdsmi has no hip_id: its handle order (PCI order) need not be HIP's.
    amd.gpus = _gpus(3, enumeration=False)
    assert AmdSmiGpu.open(2, logs.append, {}) is None
    assert len(logs) == 1 and "no hip_id" in logs[0] and "PCI address" in logs[0]
    # The fake puts handle i on bus 0x11 + 0x10 * i; torch says its device is on bus 0x21.
    identity = device_map.DeviceIdentity(pci_bus_id="0000:21:00.0", runtime="rocm")
    gpu = AmdSmiGpu.open(2, logs.append, {}, identity=identity)
    assert gpu.info()["uuid"] == _uuid(1) and gpu.info()["pci_bus_id"] == "0000:21:00.0"
    assert gpu.matches(identity)
    assert not gpu.matches(device_map.DeviceIdentity(pci_bus_id="0000:31:00.0", runtime="rocm"))


def test_hidden_device_gives_no_gpu(amd, logs):
    amd.gpus = _gpus(2)
    assert AmdSmiGpu.open(0, logs.append, {"HIP_VISIBLE_DEVICES": ""}) is None
    assert len(logs) == 1 and "not visible" in logs[0]


def test_init_failure_means_no_gpu(amd, logs):
    amd.gpus = _gpus(1)
    amd.init_status = 34  # AMDSMI_STATUS_DRIVER_NOT_LOADED
    assert AmdSmiGpu.open(0, logs.append, {}) is None
    assert len(logs) == 1 and "init failed" in logs[0]


def test_import_failure_without_libamd_smi_switches_amd_off(monkeypatch, logs):
    """On this machine the real import raises (libamd_smi.so is missing): AMD metrics are off."""
    forget_amdsmi()
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    try:
        assert AmdSmiGpu.open(0, logs.append, {}) is None
    finally:
        forget_amdsmi()
    if logs and "init failed" in logs[0]:
        pytest.skip("a real libamd_smi.so is installed here")
    assert len(logs) == 1 and "import failed" in logs[0] and "no AMD GPU metrics" in logs[0]


def test_no_driver_means_amdsmi_is_not_even_imported(monkeypatch, logs):
    forget_amdsmi()
    monkeypatch.setattr(gpu_amdsmi, "KFD", "/nonexistent/kfd")
    assert AmdSmiGpu.open(0, logs.append, {}) is None
    assert "amdsmi" not in sys.modules
    assert len(logs) == 1 and "no AMD GPU driver" in logs[0]


def test_rocm_visibility_resolution():
    env = {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "1,2"}
    assert device_map.resolve_amd(0, env) == device_map.DeviceRef(index=5, source="HIP_VISIBLE_DEVICES+ROCR_VISIBLE_DEVICES")
    assert device_map.resolve_amd(2, env) is None
    assert device_map.resolve_amd(0, {"HIP_VISIBLE_DEVICES": "7"}).index == 7
    assert device_map.resolve_amd(0, {"ROCR_VISIBLE_DEVICES": "GPU-abc"}).uuid == "GPU-abc"


# ---------------------------------------------------------------- which amdsmi, which ROCm


def _rocm_tree(tmp_path, version: str, shipped_package: bool = False):
    """A ROCm installation's layout: its version file and, if asked, its own amdsmi package (here
    a copy of the installed one, the only release this machine has)."""
    import importlib.util
    import shutil

    root = tmp_path / "rocm"
    (root / ".info").mkdir(parents=True)
    (root / ".info" / "version").write_text(f"{version}-120\n")
    if shipped_package:
        installed = Path(importlib.util.find_spec("amdsmi").origin).parent
        shutil.copytree(installed, root / "share" / "amd_smi" / "amdsmi",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("rocm,missing", [("6.2", 29), ("6.4", 5)])
def test_pip_amdsmi_7_on_an_older_rocm_fails_with_one_line_naming_the_rocm_and_the_fix(
        monkeypatch, tmp_path, logs, rocm, missing):
    fake = install_fake_amdsmi(monkeypatch, rocm=rocm, import_now=False)
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    assert len(rocm_symbols("7.0") - fake.exports) == missing  # what amdsmi 7.0 binds and this ROCm lacks
    root = _rocm_tree(tmp_path, f"{rocm}.4")
    try:
        assert AmdSmiGpu.open(0, logs.append, {"ROCM_PATH": str(root)}) is None
        assert "amdsmi" not in sys.modules  # nothing half-imported is left for the next import
    finally:
        forget_amdsmi()
    assert len(logs) == 1 and "\n" not in logs[0]
    assert "undefined symbol: amdsmi_" in logs[0]
    assert f"does not match ROCm {rocm}.4 at {root}" in logs[0]
    assert f"pip install 'amdsmi=={rocm}.*' or pip install {root}/share/amd_smi" in logs[0]


def test_pip_amdsmi_7_on_rocm_7_imports_and_reads(monkeypatch, tmp_path, logs):
    fake = install_fake_amdsmi(monkeypatch, rocm="7.0", import_now=False)
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    fake.gpus = _gpus(2)
    try:
        gpu = AmdSmiGpu.open(1, logs.append, {"ROCM_PATH": str(_rocm_tree(tmp_path, "7.0.2"))})
        assert gpu is not None, logs
        assert gpu.info()["uuid"] == _uuid(1) and gpu.read()["utilization_ratio"] == pytest.approx(0.64)
    finally:
        forget_amdsmi()


def test_the_package_rocm_ships_is_preferred_to_the_one_pip_installed(monkeypatch, tmp_path, logs):
    fake = install_fake_amdsmi(monkeypatch, rocm="7.0", import_now=False)
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    fake.gpus = _gpus(1)
    root = _rocm_tree(tmp_path, "7.0.2", shipped_package=True)
    try:
        gpu = AmdSmiGpu.open(0, logs.append, {"ROCM_PATH": str(root)})
        assert gpu is not None, logs
        assert sys.modules["amdsmi"].__file__.startswith(str(root / "share" / "amd_smi"))
        assert sys.modules["amdsmi.amdsmi_interface"].__file__.startswith(str(root))
    finally:
        forget_amdsmi()


def test_rocm_version_file():
    assert gpu_amdsmi.rocm_version(None) is None
    assert gpu_amdsmi.rocm_version(Path("/nonexistent")) is None
