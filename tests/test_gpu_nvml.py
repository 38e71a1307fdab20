"""NVML sampling against the real pynvml module, with only its C library replaced."""

from __future__ import annotations

import pynvml
import pytest
from fake_gpu_libs import FakeNvidiaGpu, FakeNvml

from diag.collectors import device_map
from diag.collectors.gpu_nvml import NvmlGpu, decode_clock_events


def _uuid(i: int) -> str:
    return f"GPU-{i}{i}{i}{i}abcd-1111-2222-3333-44445555666{i}"


def _gpus(n=4, **kw) -> list[FakeNvidiaGpu]:
    return [FakeNvidiaGpu(uuid=_uuid(i), **kw) for i in range(n)]


@pytest.fixture
def logs():
    return []


def _open(monkeypatch, gpus, logs, logical=0, env=None, **fake_kw):
    fake = FakeNvml(gpus, **fake_kw)
    fake.install(monkeypatch)
    return fake, NvmlGpu.open(logical, logs.append, env or {})


def test_values_flow_through_with_base_units(monkeypatch, logs):
    gpus = _gpus(
        2,
        util_pct=87,
        mem_used=30 * 1024**3,
        sm_clock_mhz=1410,
        power_mw=312_500,
        energy_mj=123_456_789,
        temp_c=71,
        clock_reasons=pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        pcie_kbps=(2048, 512),
        nvlink_kib=(1_000, 3_000),
        ecc=(5, 2),
    )
    fake, gpu = _open(monkeypatch, gpus, logs, logical=1)
    assert gpu is not None and logs == []
    info = gpu.info()
    assert info["vendor"] == "nvidia"
    assert info["uuid"] == _uuid(1) and info["physical_index"] == 1 and info["index"] == 1
    assert info["name"] == "NVIDIA H100 80GB HBM3"
    assert info["driver_version"] == "550.54.15" and info["cuda_driver_version"] == "12.4"
    assert info["memory_total_bytes"] == 80 * 1024**3
    assert info["pci_bus_id"] == "00000000:18:00.0"
    assert info["unsupported"] == {}

    s = gpu.read()
    assert s["index"] == 1 and s["uuid"] == _uuid(1)
    assert s["utilization_ratio"] == pytest.approx(0.87)
    assert s["memory_used_bytes"] == 30 * 1024**3
    assert s["memory_total_bytes"] == 80 * 1024**3
    assert s["sm_clock_hz"] == 1_410_000_000
    assert s["power_watts"] == pytest.approx(312.5)
    assert s["energy_joules_total"] == pytest.approx(123_456.789)
    assert s["temperature_celsius"] == 71.0
    assert s["clock_events"] == ["sw_power_cap", "hw_thermal"]
    assert s["pcie_tx_bytes_per_second"] == 2048 * 1024
    assert s["pcie_rx_bytes_per_second"] == 512 * 1024
    assert s["nvlink_tx_bytes_total"] == 1_000 * 1024
    assert s["nvlink_rx_bytes_total"] == 3_000 * 1024
    assert s["ecc_errors_total"] == 7 and s["ecc_uncorrected_errors_total"] == 2
    assert s["xid_errors_total"] == 0 and "xid_last_code" not in s

    # Values change between samples: the next read sees them.
    gpus[1].util_pct, gpus[1].power_mw, gpus[1].clock_reasons = 3, 95_000, 0
    s = gpu.read()
    assert s["utilization_ratio"] == pytest.approx(0.03)
    assert s["power_watts"] == pytest.approx(95.0)
    assert s["clock_events"] == []
    gpu.close()


def test_xid_events_are_counted_without_blocking(monkeypatch, logs):
    gpus = _gpus(2)
    fake, gpu = _open(monkeypatch, gpus, logs, logical=0)
    assert fake.registered == [(0, pynvml.nvmlEventTypeXidCriticalError)]
    assert gpu.read()["xid_errors_total"] == 0
    gpus[0].pending_xids.extend([79, 48])
    gpus[1].pending_xids.append(13)  # another GPU's error is not ours
    s = gpu.read()
    assert s["xid_errors_total"] == 2 and s["xid_last_code"] == 48
    gpus[0].pending_xids.append(94)
    s = gpu.read()
    assert s["xid_errors_total"] == 3 and s["xid_last_code"] == 94
    assert gpus[1].pending_xids == [13]


def test_unsupported_metrics_are_switched_off_after_the_probe(monkeypatch, logs):
    gpus = _gpus(
        1,
        nvlink_kib=None,
        event_types=0,  # no XID events on this part
        unsupported={"nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTotalEccErrors"},
    )
    fake, gpu = _open(monkeypatch, gpus, logs)
    info = gpu.info()
    assert set(info["unsupported"]) == {"pcie", "energy", "ecc", "nvlink", "xid"}
    assert "NVMLError_NotSupported" in info["unsupported"]["pcie"]
    assert set(info["metrics"]) == {"utilization", "memory", "sm_clock", "power", "temperature", "clock_events"}
    assert len(logs) == 1 and "switched off" in logs[0] and "pcie" in logs[0]

    probe_calls = dict(fake.calls)
    for _ in range(5):
        s = gpu.read()
    for key in ("pcie_tx_bytes_per_second", "energy_joules_total", "ecc_errors_total", "nvlink_tx_bytes_total", "xid_errors_total"):
        assert key not in s
    assert s["utilization_ratio"] == pytest.approx(0.87)
    # Not asked again after the probe.
    for fn in ("nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTotalEccErrors",
               "nvmlDeviceGetFieldValues", "nvmlDeviceGetSupportedEventTypes"):
        assert fake.calls[fn] == probe_calls.get(fn, 0), fn
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == probe_calls["nvmlDeviceGetUtilizationRates"] + 5
    assert len(logs) == 1


def test_a_metric_failing_later_is_switched_off_once_and_others_continue(monkeypatch, logs):
    # Power answers the probe and two samples, then the driver reports the GPU lost.
    gpus = _gpus(1, fail_after={"nvmlDeviceGetPowerUsage": (3, pynvml.NVML_ERROR_GPU_IS_LOST)})
    fake, gpu = _open(monkeypatch, gpus, logs)
    assert gpu.read()["power_watts"] == pytest.approx(312.5)
    assert gpu.read()["power_watts"] == pytest.approx(312.5)
    for _ in range(4):
        s = gpu.read()
        assert "power_watts" not in s
        assert s["utilization_ratio"] == pytest.approx(0.87)
        assert s["temperature_celsius"] == 71.0
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 4  # probe + 2 good + the failing one, then never again
    power_logs = [m for m in logs if "power" in m]
    assert len(power_logs) == 1 and "GpuIsLost" in power_logs[0]
    assert "power" in gpu.info()["unsupported"]


def test_temperature_and_clock_events_fall_back_to_the_older_calls(monkeypatch, logs):
    fake = FakeNvml(_gpus(1, temp_c=64, clock_reasons=pynvml.nvmlClocksThrottleReasonHwSlowdown))
    fake.missing = {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"}  # an older driver
    fake.install(monkeypatch)
    gpu = NvmlGpu.open(0, logs.append, {})
    s = gpu.read()
    assert s["temperature_celsius"] == 64.0 and s["clock_events"] == ["hw_slowdown"]
    assert fake.calls["nvmlDeviceGetTemperature"] >= 2 and fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] >= 2


def test_nvlink_sums_links_when_the_aggregate_scope_is_unsupported(monkeypatch, logs):
    gpus = _gpus(1, nvlink_kib=None, nvlink_per_link_kib=[(10, 20), (30, 40), (5, 6)])
    _, gpu = _open(monkeypatch, gpus, logs)
    s = gpu.read()
    assert s["nvlink_tx_bytes_total"] == 45 * 1024 and s["nvlink_rx_bytes_total"] == 66 * 1024


@pytest.mark.parametrize(
    "code, name",
    [(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded"), (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission")],
)
def test_init_failure_means_no_gpu_logged_once(monkeypatch, logs, code, name):
    fake, gpu = _open(monkeypatch, _gpus(1), logs, init_error=code)
    assert gpu is None
    assert len(logs) == 1 and name in logs[0] and "no NVIDIA GPU metrics" in logs[0]
    assert fake.calls["nvmlDeviceGetCount_v2"] == 0


def test_missing_library_on_this_machine_means_no_gpu(monkeypatch, logs):
    # The real loader runs: CDLL("libnvidia-ml.so.1") fails on this GPU-less machine.
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("a real NVML library is installed here")
    except OSError:
        pass
    assert NvmlGpu.open(0, logs.append, {}) is None
    assert len(logs) == 1 and "LibraryNotFound" in logs[0]
    assert pynvml.nvmlLib is None


@pytest.mark.parametrize(
    "visible, logical, expected",
    [
        (None, 2, 2),
        ("2,3", 0, 2),
        ("2,3", 1, 3),
        (" 3 , 1 ", 1, 1),
        (f"{_uuid(3)},{_uuid(0)}", 0, 3),
        (f"{_uuid(3)},{_uuid(0)}", 1, 0),
        ("GPU-2222", 0, 2),  # a unique UUID prefix, as CUDA accepts
        ("1,-1,2", 0, 1),  # the runtime stops at the first invalid entry
    ],
)
def test_cuda_visible_devices_selects_the_physical_handle(monkeypatch, logs, visible, logical, expected):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    fake, gpu = _open(monkeypatch, _gpus(4, util_pct=10), logs, logical=logical, env=env)
    assert gpu is not None, logs
    assert gpu.info()["physical_index"] == expected
    assert gpu.info()["uuid"] == _uuid(expected)
    fake.gpus[expected].util_pct = 55  # only the selected physical GPU changes
    assert gpu.read()["utilization_ratio"] == pytest.approx(0.55)


@pytest.mark.parametrize("visible, logical", [("", 0), ("2,3", 2), ("1,-1,2", 1), ("GPU-9999", 0), ("GPU-", 0)])
def test_a_hidden_device_gives_no_gpu(monkeypatch, logs, visible, logical):
    _, gpu = _open(monkeypatch, _gpus(4), logs, logical=logical, env={"CUDA_VISIBLE_DEVICES": visible})
    assert gpu is None
    assert len(logs) == 1 and "not visible" in logs[0]


def test_mig_uuid_reads_the_instance_and_its_board(monkeypatch, logs):
    mig = "MIG-5c89a3f9-1234-5678-9abc-def012345678"
    gpus = _gpus(2, power_mw=200_000)
    gpus[1].mig_children = [mig]
    gpus[1].power_mw = 410_000
    fake, gpu = _open(monkeypatch, gpus, logs, env={"CUDA_VISIBLE_DEVICES": mig})
    info = gpu.info()
    assert info["mig"] is True and info["uuid"] == mig and info["board_uuid"] == _uuid(1)
    assert info["physical_index"] == 1 and info["name"].endswith("MIG 1g.10gb")
    s = gpu.read()
    assert s["memory_total_bytes"] == 10 * 1024**3  # the instance's slice
    assert s["power_watts"] == pytest.approx(410.0)  # the board's sensor
    assert "utilization_ratio" not in s and "utilization" in info["unsupported"]


def test_a_mig_rank_counts_the_xids_of_its_own_instance_and_of_the_whole_board(monkeypatch, logs):
    migs = ["MIG-aaaaaaaa-1111-2222-3333-444455556666", "MIG-bbbbbbbb-1111-2222-3333-444455556666"]
    gpus = _gpus(1)
    gpus[0].mig_children = migs
    fake, gpu = _open(monkeypatch, gpus, logs, env={"CUDA_VISIBLE_DEVICES": migs[1]})
    assert fake.registered == [(0, pynvml.nvmlEventTypeXidCriticalError)]  # events come from the board
    # Instance 2 (ours), instance 1 (a neighbour's), and one NVML attributes to no instance.
    gpus[0].pending_xids.extend([(43, 2, 0), (31, 1, 0), 79, (13, 2, 5)])
    s = gpu.read()
    assert s["xid_errors_total"] == 2 and s["xid_last_code"] == 79
    # A whole board sees every instance's.
    fake2, board = _open(monkeypatch, _gpus(1), logs)
    fake2.gpus[0].pending_xids.extend([(43, 2, 0), (31, 1, 0), 79])
    assert board.read()["xid_errors_total"] == 3


@pytest.mark.parametrize("identity", [
    device_map.DeviceIdentity(uuid=_uuid(2)),
    device_map.DeviceIdentity(pci_bus_id="0000:19:00.0"),  # the fake puts GPU i on bus 0x17 + i
])
def test_torch_identity_picks_the_device_whatever_the_variables_say(monkeypatch, logs, identity):
    fake = FakeNvml(_gpus(4))
    fake.install(monkeypatch)
    gpu = NvmlGpu.open(0, logs.append, {"CUDA_VISIBLE_DEVICES": "0"}, identity=identity)
    assert gpu.info()["uuid"] == _uuid(2) and gpu.info()["physical_index"] == 2
    assert gpu.matches(identity)
    assert not NvmlGpu.open(0, logs.append, {}).matches(identity)


def test_clock_event_bitmask_decoding():
    assert decode_clock_events(0) == []
    mask = (
        pynvml.nvmlClocksEventReasonGpuIdle
        | pynvml.nvmlClocksEventReasonSwPowerCap
        | pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    )
    assert decode_clock_events(mask, pynvml) == [
        "gpu_idle", "sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake",
    ]
    assert decode_clock_events(pynvml.nvmlClocksThrottleReasonBoardLimit | 0x10000, pynvml) == [
        "board_limit", "other_0x10000",
    ]
    assert decode_clock_events(pynvml.nvmlClocksEventReasonSyncBoost, None) == ["sync_boost"]


def test_visibility_parsing():
    assert device_map.parse_visible(None) is None
    assert device_map.parse_visible("") == []
    assert device_map.parse_visible("0,1,bogus,2") == ["0", "1"]
    assert device_map.parse_visible("MIG-abc, GPU-def") == ["MIG-abc", "GPU-def"]
    assert device_map.resolve_nvidia(None, {}) == device_map.DeviceRef(index=0, source="default")
    assert device_map.uuid_matches("GPU-ABCD", "GPU-abcdef12-0000")
    assert device_map.uuid_matches("abcd", "GPU-abcdef12-0000")
    assert not device_map.uuid_matches("GPU-abce", "GPU-abcdef12-0000")


def test_torch_device_uuid_wins_over_the_visibility_variables(monkeypatch, logs):
    # CUDA_DEVICE_ORDER=FASTEST_FIRST on a mixed node: CUDA's device 0 is NVML's GPU 2.
    monkeypatch.setattr(device_map, "torch_cuda_uuid", lambda logical: _uuid(2))
    _, gpu = _open(monkeypatch, _gpus(4), logs, logical=0, env={})
    assert gpu.info()["physical_index"] == 2 and gpu.info()["selected_by"].endswith("(from torch)")


def test_unknown_torch_uuid_falls_back_to_the_visibility_variables(monkeypatch, logs):
    monkeypatch.setattr(device_map, "torch_cuda_uuid", lambda logical: "GPU-ffffffff-0000-0000-0000-000000000000")
    _, gpu = _open(monkeypatch, _gpus(4), logs, logical=1, env={"CUDA_VISIBLE_DEVICES": "3,0"})
    assert gpu.info()["physical_index"] == 0


@pytest.mark.slow  # importing torch takes seconds on a shared machine
def test_torch_uuid_is_only_read_when_torch_initialised_cuda():
    pytest.importorskip("torch")
    import torch

    assert not torch.cuda.is_initialized()
    assert device_map.torch_cuda_uuid(0) is None


def test_one_clock_event_vocabulary():
    """The NVML sampler's reason names are the ones the diagnosis, the report and the exporter know."""
    from diag.analyzers.diagnosis.throttle import CLOCK_EVENTS
    from diag.collectors.gpu_nvml import CLOCK_EVENT_REASONS
    from diag.exporter.metrics_table import CLOCK_EVENT_REASONS as EXPORTED

    assert [name for _, _, name in CLOCK_EVENT_REASONS] == list(CLOCK_EVENTS) == list(EXPORTED)
