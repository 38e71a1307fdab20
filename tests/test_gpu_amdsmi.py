"""amdsmi sampling against the real amdsmi package, with only libamd_smi.so replaced."""

from __future__ import annotations

import sys

import pytest
from fake_gpu_libs import FakeAmdGpu, forget_amdsmi, install_fake_amdsmi

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


def test_older_library_without_enumeration_info_uses_handle_order(amd, logs):
    amd.gpus = _gpus(3, enumeration=False)
    gpu = AmdSmiGpu.open(2, logs.append, {})
    assert gpu.info()["uuid"] == _uuid(2)


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
