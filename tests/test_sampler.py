"""The sampling thread: vendor choice, schedule, the sample contract, and surviving failures."""

from __future__ import annotations

import json
import threading
import time

import pynvml
import pytest
from fake_gpu_libs import FakeAmdGpu, FakeNvidiaGpu, FakeNvml, forget_amdsmi, install_fake_amdsmi
from test_host_metrics import HOST_KEYS

from diag.collectors import gpu_amdsmi
from diag.collectors import sampler as sampler_mod
from diag.collectors.sampler import Sampler

# The keys a sample record may hold (diag.collectors.sampler).
GPU_KEYS = {
    "index", "uuid", "name", "utilization_ratio", "memory_used_bytes", "memory_total_bytes", "sm_clock_hz",
    "power_watts", "energy_joules_total", "temperature_celsius", "clock_events", "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second", "nvlink_tx_bytes_total", "nvlink_rx_bytes_total", "ecc_errors_total",
    "xid_errors_total",
}
GPU_EXTRA_KEYS = {"ecc_uncorrected_errors_total", "xid_last_code"}


def _uuid(i):
    return f"GPU-{i}{i}{i}{i}0000-aaaa-bbbb-cccc-dddddddddddd"


class Collect:
    def __init__(self):
        self.samples: list[dict] = []
        self.logs: list[str] = []
        self.got = threading.Event()
        self.want = 1

    def on_sample(self, s):
        self.samples.append(s)
        if len(self.samples) >= self.want:
            self.got.set()

    def wait(self, n, timeout=10.0):
        self.want = n
        if len(self.samples) < n:
            self.got.clear()
            assert self.got.wait(timeout), f"only {len(self.samples)} samples; logs: {self.logs}"


@pytest.fixture
def no_amd(monkeypatch):
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: False)


def test_without_a_gpu_host_sampling_goes_on(monkeypatch, no_amd):
    """This machine: NVML's library is missing, no AMD driver. gpu is null, host is full."""
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    c = Collect()
    s = Sampler(0, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append)
    s.start()
    c.wait(4)
    info = s.info()
    s.stop()
    assert not s._thread.is_alive()
    assert info["vendor"] is None and info["name"] is None and info["physical_index"] is None
    assert info["state"] == "running" and info["logical_index"] == 0
    assert "LibraryNotFound" in info["gpu_unavailable"] and "/dev/kfd" in info["gpu_unavailable"]
    for sample in c.samples:
        assert sample["gpu"] is None
        assert set(sample["host"]) == HOST_KEYS
        json.dumps(sample)  # plain data, ready for the samples stream
    ts = [x["t"] for x in c.samples]
    assert ts == sorted(ts) and abs(ts[-1] - time.time()) < 5
    assert s.latest() is c.samples[-1]
    assert len([m for m in c.logs if m.startswith("nvml:")]) == 1
    assert len([m for m in c.logs if m.startswith("amdsmi:")]) == 1
    assert len(c.logs) == 2


def test_nvidia_samples_follow_the_contract(monkeypatch, no_amd):
    gpus = [FakeNvidiaGpu(uuid=_uuid(i), util_pct=20 + i) for i in range(4)]
    fake = FakeNvml(gpus)
    fake.install(monkeypatch)
    c = Collect()
    s = Sampler(1, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append,
                env={"CUDA_VISIBLE_DEVICES": "2,3"})
    s.start()
    info = s.info()
    c.wait(3)
    s.stop()
    assert info["vendor"] == "nvidia" and info["physical_index"] == 3 and info["uuid"] == _uuid(3)
    assert info["logical_index"] == 1 and info["driver_version"] == "550.54.15"
    assert info["memory_total_bytes"] == 80 * 1024**3
    assert "utilization" in info["metrics"] and info["host_metrics"]
    gpu = c.samples[-1]["gpu"]
    assert set(gpu) - GPU_EXTRA_KEYS == GPU_KEYS
    assert gpu["index"] == 3 and gpu["utilization_ratio"] == pytest.approx(0.23)
    assert set(c.samples[-1]["host"]) == HOST_KEYS
    json.dumps(c.samples[-1])
    assert c.logs == []
    assert fake.calls["nvmlShutdown"] == 1  # closed by the thread at stop


def test_a_metric_failing_mid_run_leaves_the_others(monkeypatch, no_amd):
    gpus = [FakeNvidiaGpu(uuid=_uuid(0), fail_after={"nvmlDeviceGetTemperatureV": (3, pynvml.NVML_ERROR_UNKNOWN)})]
    FakeNvml(gpus).install(monkeypatch)
    c = Collect()
    with Sampler(0, interval_s=0.03, on_sample=c.on_sample, log=c.logs.append, env={}):
        c.wait(6)
    assert "temperature_celsius" in c.samples[0]["gpu"]
    assert "temperature_celsius" not in c.samples[-1]["gpu"]
    assert all("power_watts" in x["gpu"] for x in c.samples)
    assert len(c.logs) == 1 and "temperature" in c.logs[0] and "switched off" in c.logs[0]


def test_nvml_init_failure_falls_back_to_amd(monkeypatch):
    FakeNvml([FakeNvidiaGpu(uuid=_uuid(0))], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    amd = install_fake_amdsmi(monkeypatch)
    try:
        amd.gpus = [FakeAmdGpu(uuid=f"GPU-{i:016x}", hip_id=i) for i in range(2)]
        monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
        c = Collect()
        s = Sampler(1, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append, env={})
        s.start()
        c.wait(2)
        info = s.info()
        s.stop()
    finally:
        forget_amdsmi()
    assert info["vendor"] == "amd" and info["physical_index"] == 1
    assert c.samples[-1]["gpu"]["utilization_ratio"] == pytest.approx(0.64)
    assert set(c.samples[-1]["host"]) == HOST_KEYS
    assert len(c.logs) == 1 and "DriverNotLoaded" in c.logs[0]


def test_cpu_rank_has_no_gpu_and_never_touches_the_libraries(monkeypatch):
    fake = FakeNvml([FakeNvidiaGpu(uuid=_uuid(0))])
    fake.install(monkeypatch)
    c = Collect()
    with Sampler(None, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append) as s:
        c.wait(2)
    assert c.samples[-1]["gpu"] is None and s.info()["vendor"] is None
    assert "CPU" in s.info()["gpu_unavailable"]
    assert sum(fake.calls.values()) == 0 and c.logs == []


def test_a_raising_callback_is_logged_once_and_sampling_continues(monkeypatch, no_amd):
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    seen = []
    logs = []

    def bad(sample):
        seen.append(sample)
        raise ValueError("exporter bug")

    s = Sampler(0, interval_s=0.02, on_sample=bad, log=logs.append)
    s.start()
    deadline = time.monotonic() + 10
    while len(seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.stop()
    assert len(seen) >= 5
    assert len([m for m in logs if "on_sample raised" in m]) == 1


def test_schedule_does_not_drift_or_burst():
    c = Collect()
    s = Sampler(None, interval_s=0.1, on_sample=c.on_sample, log=c.logs.append)
    s.start()
    time.sleep(1.0)
    s.stop()
    n = len(c.samples)
    # ~10 at 10 Hz: never more (no catch-up after a stall); fewer only if the thread was
    # starved on this shared machine.
    assert 3 <= n <= 12, n
    gaps = [b["t"] - a["t"] for a, b in zip(c.samples, c.samples[1:])]
    assert min(gaps) > 0.03  # no catch-up bursts


class HangingNvml(FakeNvml):
    """A driver call that blocks (a GPU fallen off the bus) after the probe."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()
        self.entered = threading.Event()

    def c_nvmlDeviceGetPowerUsage(self, handle, ref):
        if self.calls["nvmlDeviceGetPowerUsage"] > 2:
            self.entered.set()
            self.release.wait(30)
        return super().c_nvmlDeviceGetPowerUsage(handle, ref)


def test_stop_is_bounded_when_a_driver_call_hangs(monkeypatch, no_amd):
    fake = HangingNvml([FakeNvidiaGpu(uuid=_uuid(0))])
    fake.install(monkeypatch)
    monkeypatch.setattr(sampler_mod, "STOP_JOIN_S", 0.2)
    logs = []
    s = Sampler(0, interval_s=0.02, log=logs.append, env={})
    s.start()
    assert fake.entered.wait(10)
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 10.0  # bounded: the driver call itself never returns
    assert any("still busy" in m for m in logs)
    fake.release.set()
    s._thread.join(10)
    assert not s._thread.is_alive()


def test_info_is_bounded_when_opening_hangs(monkeypatch, no_amd):
    gate = threading.Event()

    class SlowInit(FakeNvml):
        def c_nvmlInitWithFlags(self, flags):
            gate.wait(30)
            return pynvml.NVML_ERROR_DRIVER_NOT_LOADED

    SlowInit([FakeNvidiaGpu(uuid=_uuid(0))]).install(monkeypatch)
    s = Sampler(0, interval_s=0.05, log=lambda m: None, env={})
    s.start()
    t0 = time.monotonic()
    info = s.info(timeout=0.2)
    assert time.monotonic() - t0 < 10.0  # bounded: opening hangs for 30 s
    assert info["vendor"] is None and info["state"] == "starting"
    gate.set()
    s.stop()
    assert not s._thread.is_alive()


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        Sampler(0, interval_s=0)


def test_the_device_torch_names_later_replaces_the_one_chosen_by_index(monkeypatch, no_amd):
    # At start, before CUDA exists in the process, logical 0 is taken as physical 0; torch then
    # initialises physical 2 (another device order, a launcher's own mapping).
    from diag.collectors import device_map

    gpus = [FakeNvidiaGpu(uuid=_uuid(i), util_pct=20 + i) for i in range(4)]
    fake = FakeNvml(gpus)
    fake.install(monkeypatch)
    c = Collect()
    s = Sampler(0, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append, env={})
    s.start()
    assert s.info()["uuid"] == _uuid(0)
    c.wait(2)
    s.identify(device_map.DeviceIdentity(uuid=_uuid(2)))
    c.wait(len(c.samples) + 3)
    info = s.info()
    assert info["uuid"] == _uuid(2) and info["physical_index"] == 2
    assert c.samples[-1]["gpu"]["index"] == 2 and c.samples[-1]["gpu"]["utilization_ratio"] == pytest.approx(0.22)
    assert len(c.logs) == 1 and "sampling it instead of index 0" in c.logs[0]
    opened = fake.calls["nvmlInitWithFlags"]
    s.identify(device_map.DeviceIdentity(uuid=_uuid(2)))  # the same device: nothing reopens
    c.wait(len(c.samples) + 2)
    s.stop()
    assert fake.calls["nvmlInitWithFlags"] == opened and len(c.logs) == 1


def test_torch_device_identity_reads_uuid_and_pci_address_only_after_cuda_started(monkeypatch):
    import types

    import torch

    from diag.collectors import device_map

    assert device_map.torch_device_identity() is None  # CUDA never initialised here
    props = types.SimpleNamespace(uuid="5c89a3f9-1234-5678-9abc-def012345678", pci_bus_id=0xC1,
                                  pci_device_id=0, pci_domain_id=0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 3 else None)
    ident = device_map.torch_device_identity()
    assert ident == device_map.DeviceIdentity(uuid="GPU-5c89a3f9-1234-5678-9abc-def012345678",
                                              pci_bus_id="0000:c1:00.0", runtime="cuda")
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert device_map.torch_device_identity() == device_map.DeviceIdentity(pci_bus_id="0000:c1:00.0",
                                                                           runtime="rocm")


def test_an_amd_device_without_hip_id_is_sampled_once_torch_names_its_pci_address(monkeypatch):
    from diag.collectors import device_map

    FakeNvml([FakeNvidiaGpu(uuid=_uuid(0))], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    # The devices report no hip_id, as before ROCm 6.4 (the installed package is 7.0's, so the
    # library is too).
    amd = install_fake_amdsmi(monkeypatch, rocm="7.0", import_now=False)
    monkeypatch.setattr(gpu_amdsmi, "driver_present", lambda: True)
    amd.gpus = [FakeAmdGpu(uuid=f"GPU-{i:016x}", hip_id=None, pci_bus=bus) for i, bus in enumerate((0xC1, 0x05))]
    try:
        c = Collect()
        s = Sampler(0, interval_s=0.05, on_sample=c.on_sample, log=c.logs.append, env={})
        s.start()
        c.wait(2)
        assert s.info()["vendor"] is None and c.samples[-1]["gpu"] is None
        s.identify(device_map.DeviceIdentity(pci_bus_id="0000:05:00.0", runtime="rocm"))
        c.wait(len(c.samples) + 3)
        info = s.info()
        s.stop()
    finally:
        forget_amdsmi()
    assert info["vendor"] == "amd" and info["uuid"] == f"GPU-{1:016x}" and "gpu_unavailable" not in info
    assert c.samples[-1]["gpu"]["utilization_ratio"] == pytest.approx(0.64)
    assert any("no hip_id" in m for m in c.logs) and "sampling it" in c.logs[-1]
