"""NVIDIA device metrics through NVML (nvidia-ml-py, module ``pynvml``).

One table (``NvmlGpu.table``) lists every metric with its reader and optional one-time
setup; each reader fills its keys of the sample's ``gpu`` record. At open
each metric is probed once; those the device, driver or permissions do not support are
switched off and never asked again. A metric that raises later is switched off alone and
logged once; the others go on. ``pynvml`` is imported only when a sampler opens, and a
node without the driver (LibraryNotFound, DriverNotLoaded) simply has no NVIDIA metrics.

Units follow the sample contract: ratios 0-1, bytes, hertz, watts, joules, celsius.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from diag.collectors import device_map
from diag.collectors.metric_set import Log, Metric, MetricSet, describe_error

# Clock-event ("throttle") reason bits of nvmlDeviceGetCurrentClocksEventReasons, by the
# pynvml constant suffix, with the names used in samples and the exporter's label values.
CLOCK_EVENT_REASONS: tuple[tuple[str, int, str], ...] = (
    ("GpuIdle", 0x001, "gpu_idle"),
    ("ApplicationsClocksSetting", 0x002, "applications_clocks_setting"),
    ("SwPowerCap", 0x004, "sw_power_cap"),
    ("HwSlowdown", 0x008, "hw_slowdown"),
    ("SyncBoost", 0x010, "sync_boost"),
    ("SwThermalSlowdown", 0x020, "sw_thermal"),
    ("HwThermalSlowdown", 0x040, "hw_thermal"),
    ("HwPowerBrakeSlowdown", 0x080, "hw_power_brake"),
    ("DisplayClockSetting", 0x100, "display_clock_setting"),
    ("BoardLimit", 0x200, "board_limit"),
    ("Reliability", 0x400, "reliability"),
)

NVLINK_AGGREGATE_SCOPE = 0xFFFFFFFF  # scopeId UINT_MAX: the NVLink counter summed over all links
KIB = 1024
# nvmlEventData_t's instance ids for an XID that no MIG instance can be blamed for.
UNATTRIBUTED_INSTANCE = 0xFFFFFFFF
XID_EVENTS_PER_SAMPLE = 64  # drained per sample; more than this in one second is reported next time


def decode_clock_events(mask: int, nvml=None) -> list[str]:
    """Names of the set reason bits, in bit order. Bit values come from pynvml when given."""
    names = []
    for suffix, default_bit, name in CLOCK_EVENT_REASONS:
        bit = default_bit
        if nvml is not None:
            bit = (getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
                   or getattr(nvml, f"nvmlClocksThrottleReason{suffix}", None) or default_bit)
        if mask & bit:
            names.append(name)
    known = sum(bit for _, bit, _ in CLOCK_EVENT_REASONS)
    if mask & ~known:
        names.append(f"other_0x{mask & ~known:x}")
    return names


class NvmlGpu(MetricSet):
    """The rank's NVIDIA device: static facts and one ``read()`` per sample."""

    vendor = "nvidia"
    source = "nvml"

    def __init__(self, nvml, handle, board, ref: device_map.DeviceRef, log: Log):
        super().__init__(log)
        self.nvml = nvml
        self.handle = handle  # the rank's device: the MIG instance for MIG, else the GPU
        self.board = board  # the physical GPU
        self.ref = ref
        self._xid_set = None
        self._xid_total = 0
        self._xid_last: int | None = None
        self._xid_instance: tuple[int, int] | None = None  # (GPU instance, compute instance) under MIG
        self._nvlink_fields: list = []
        # The readers their probes chose: a newer call where the driver has it, else the older one.
        self._temperature: Callable[..., Any] | None = None
        self._clock_events: Callable[..., Any] | None = None
        self._facts = self._static_facts()
        self.probe(str(self._facts.get("name")))

    # ---- opening -------------------------------------------------------------------

    @classmethod
    def open(cls, logical_index: int | None, log: Log, env: Mapping[str, str] | None = None,
             identity: device_map.DeviceIdentity | None = None) -> NvmlGpu | None:
        """The device for ``logical_index`` (or the one torch names in ``identity``), or None (no
        pynvml, no driver, no visible GPU), logged once."""
        env = os.environ if env is None else env
        try:
            import pynvml as nvml
        except Exception as e:  # not installed or broken install
            log(f"nvml: pynvml unavailable ({type(e).__name__}: {e}); no NVIDIA GPU metrics")
            return None
        try:
            nvml.nvmlInit()
        except Exception as e:
            log(f"nvml: not available ({describe_error(e)}); no NVIDIA GPU metrics")
            return None
        try:
            count = nvml.nvmlDeviceGetCount()
            if count <= 0:
                log("nvml: driver loaded but no NVIDIA GPU found")
                _shutdown(nvml)
                return None
            found = _resolve(nvml, logical_index, env, count, identity)
            if found is None:
                log(
                    f"nvml: logical device {logical_index} is not visible "
                    f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}, {count} GPUs); no GPU metrics"
                )
                _shutdown(nvml)
                return None
            handle, board, ref = found
            return cls(nvml, handle, board, ref, log)
        except Exception as e:
            log(f"nvml: could not open logical device {logical_index} ({describe_error(e)}); no NVIDIA GPU metrics")
            _shutdown(nvml)
            return None

    def _static_facts(self) -> dict:
        nvml, h, b = self.nvml, self.handle, self.board
        facts: dict = {"vendor": "nvidia", "mig": self.handle_is_mig()}
        for key, fn in (
            ("name", lambda: nvml.nvmlDeviceGetName(h)),
            ("uuid", lambda: nvml.nvmlDeviceGetUUID(h)),
            ("board_uuid", lambda: nvml.nvmlDeviceGetUUID(b)),
            ("physical_index", lambda: nvml.nvmlDeviceGetIndex(b)),
            ("memory_total_bytes", lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).total)),
            ("driver_version", nvml.nvmlSystemGetDriverVersion),
            ("cuda_driver_version", lambda: _cuda_version(nvml.nvmlSystemGetCudaDriverVersion())),
            ("pci_bus_id", lambda: _text(nvml.nvmlDeviceGetPciInfo(b).busId)),
        ):
            try:
                facts[key] = fn()
            except Exception:
                facts[key] = None
        if facts["physical_index"] is None and self.ref.index is not None:
            facts["physical_index"] = self.ref.index
        facts["index"] = facts["physical_index"]
        facts["selected_by"] = self.ref.describe()
        return facts

    def matches(self, identity: device_map.DeviceIdentity) -> bool:
        """Whether this is the device (the MIG instance, under MIG) torch uses."""
        if identity.uuid:
            return device_map.uuid_matches(identity.uuid, self._facts.get("uuid"))
        return device_map.pci_matches(identity.pci_bus_id, self._facts.get("pci_bus_id"))

    def handle_is_mig(self) -> bool:
        return self.handle is not self.board

    # ---- the metric table ----------------------------------------------------------

    def table(self) -> list[Metric]:
        # Utilization and memory are read from the rank's own device (a MIG slice if it
        # is one); clocks, power, temperature, links and errors belong to the whole board.
        return [
            Metric("utilization", self._read_utilization),
            Metric("memory", self._read_memory),
            Metric("sm_clock", self._read_sm_clock),
            Metric("power", self._read_power),
            Metric("energy", self._read_energy),
            Metric("temperature", self._read_temperature, self._probe_temperature),
            Metric("clock_events", self._read_clock_events, self._probe_clock_events),
            Metric("pcie", self._read_pcie),
            Metric("nvlink", self._read_nvlink, self._probe_nvlink),
            Metric("ecc", self._read_ecc),
            Metric("xid", self._read_xid, self._probe_xid),
        ]

    def read(self) -> dict:
        """One ``gpu`` record of the sample contract. Failing metrics are switched off, logged once."""
        gpu = {"index": self._facts["index"], "uuid": self._facts["uuid"], "name": self._facts["name"]}
        self.read_into(gpu)
        return gpu

    def info(self) -> dict:
        return {**self._facts, **self.state()}

    def close(self) -> None:
        if self._xid_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._xid_set)
            except Exception:
                pass
            self._xid_set = None
        _shutdown(self.nvml)

    # ---- readers: each fills its keys of the gpu record --------------------------

    def _read_utilization(self, gpu: dict) -> None:
        gpu["utilization_ratio"] = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100.0

    def _read_memory(self, gpu: dict) -> None:
        mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)  # bytes
        gpu["memory_used_bytes"] = int(mem.used)
        gpu["memory_total_bytes"] = int(mem.total)

    def _read_sm_clock(self, gpu: dict) -> None:
        gpu["sm_clock_hz"] = self.nvml.nvmlDeviceGetClockInfo(self.board, self.nvml.NVML_CLOCK_SM) * 1_000_000

    def _read_power(self, gpu: dict) -> None:
        gpu["power_watts"] = self.nvml.nvmlDeviceGetPowerUsage(self.board) / 1000.0  # mW

    def _read_energy(self, gpu: dict) -> None:
        gpu["energy_joules_total"] = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.board) / 1000.0  # mJ

    def _probe_temperature(self) -> None:
        # nvmlDeviceGetTemperatureV replaces the deprecated call on new drivers; old
        # drivers (or old pynvml) only have nvmlDeviceGetTemperature.
        nvml = self.nvml
        self._temperature = getattr(nvml, "nvmlDeviceGetTemperature", None)
        reader = getattr(nvml, "nvmlDeviceGetTemperatureV", None)
        if reader is not None:
            try:
                reader(self.board, nvml.NVML_TEMPERATURE_GPU)
                self._temperature = reader
            except nvml.NVMLError:
                pass
        if self._temperature is None:
            raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _read_temperature(self, gpu: dict) -> None:
        read = _probed(self._temperature, self.nvml)
        gpu["temperature_celsius"] = float(read(self.board, self.nvml.NVML_TEMPERATURE_GPU))

    def _probe_clock_events(self) -> None:
        # The "throttle reasons" call was renamed "clocks event reasons" (driver 535).
        nvml = self.nvml
        self._clock_events = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reader = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if reader is not None:
            try:
                reader(self.board)
                self._clock_events = reader
            except nvml.NVMLError:
                pass
        if self._clock_events is None:
            raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _read_clock_events(self, gpu: dict) -> None:
        gpu["clock_events"] = decode_clock_events(_probed(self._clock_events, self.nvml)(self.board), self.nvml)


    def _read_pcie(self, gpu: dict) -> None:
        nvml = self.nvml
        # KB/s over a 20 ms window measured by the driver; NVML's KB are KiB.
        tx = nvml.nvmlDeviceGetPcieThroughput(self.board, nvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = nvml.nvmlDeviceGetPcieThroughput(self.board, nvml.NVML_PCIE_UTIL_RX_BYTES)
        gpu["pcie_tx_bytes_per_second"] = tx * KIB
        gpu["pcie_rx_bytes_per_second"] = rx * KIB

    def _probe_nvlink(self) -> None:
        """Prefer the all-links aggregate; else sum the links that answer; else unsupported."""
        nvml = self.nvml
        tx, rx = nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
        agg = [(tx, NVLINK_AGGREGATE_SCOPE), (rx, NVLINK_AGGREGATE_SCOPE)]
        values = nvml.nvmlDeviceGetFieldValues(self.board, agg)
        if all(v.nvmlReturn == nvml.NVML_SUCCESS for v in values):
            self._nvlink_fields = agg
            return
        count = nvml.nvmlDeviceGetFieldValues(self.board, [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
        links = _field_value(nvml, count) if count.nvmlReturn == nvml.NVML_SUCCESS else 0
        per_link = [(f, link) for link in range(int(links or 0)) for f in (tx, rx)]
        if per_link:
            values = nvml.nvmlDeviceGetFieldValues(self.board, per_link)
            per_link = [fid for fid, v in zip(per_link, values) if v.nvmlReturn == nvml.NVML_SUCCESS]
        if not per_link:
            raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
        self._nvlink_fields = per_link

    def _read_nvlink(self, gpu: dict) -> None:
        nvml = self.nvml
        tx_id = nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
        tx = rx = 0
        for (fid, _), v in zip(self._nvlink_fields, nvml.nvmlDeviceGetFieldValues(self.board, self._nvlink_fields)):
            if v.nvmlReturn != nvml.NVML_SUCCESS:
                raise nvml.NVMLError(v.nvmlReturn)
            if fid == tx_id:
                tx += _field_value(nvml, v)
            else:
                rx += _field_value(nvml, v)
        gpu["nvlink_tx_bytes_total"] = int(tx) * KIB  # counters in KiB
        gpu["nvlink_rx_bytes_total"] = int(rx) * KIB

    def _read_ecc(self, gpu: dict) -> None:
        # Volatile counts (since the driver loaded), corrected plus uncorrected, as the
        # exporter documents; the uncorrected ones, which kill jobs, also on their own.
        nvml = self.nvml
        uncorrected = nvml.nvmlDeviceGetTotalEccErrors(
            self.board, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        corrected = nvml.nvmlDeviceGetTotalEccErrors(
            self.board, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
        )
        gpu["ecc_errors_total"] = int(corrected) + int(uncorrected)
        gpu["ecc_uncorrected_errors_total"] = int(uncorrected)

    def _probe_xid(self) -> None:
        nvml = self.nvml
        xid_bit = nvml.nvmlEventTypeXidCriticalError
        if not nvml.nvmlDeviceGetSupportedEventTypes(self.board) & xid_bit:
            raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
        event_set = nvml.nvmlEventSetCreate()
        try:
            nvml.nvmlDeviceRegisterEvents(self.board, xid_bit, event_set)
        except Exception:
            nvml.nvmlEventSetFree(event_set)
            raise
        self._xid_set = event_set
        if self.handle_is_mig():
            # Events come from the whole board; a MIG rank counts its own instance's and those
            # NVML cannot attribute to any instance.
            self._xid_instance = (nvml.nvmlDeviceGetGpuInstanceId(self.handle),
                                  nvml.nvmlDeviceGetComputeInstanceId(self.handle))

    def _read_xid(self, gpu: dict) -> None:
        """XID errors since the sampler started: drain pending events without waiting."""
        nvml = self.nvml
        for _ in range(XID_EVENTS_PER_SAMPLE):
            try:
                data = nvml.nvmlEventSetWait(self._xid_set, 0)
            except nvml.NVMLError_Timeout:
                break
            if data.eventType & nvml.nvmlEventTypeXidCriticalError and self._own_xid(data):
                self._xid_total += 1
                self._xid_last = int(data.eventData)
        gpu["xid_errors_total"] = self._xid_total
        if self._xid_last is not None:
            gpu["xid_last_code"] = self._xid_last

    def _own_xid(self, data) -> bool:
        if self._xid_instance is None:
            return True
        return all(got in (own, UNATTRIBUTED_INSTANCE) for got, own in
                   zip((data.gpuInstanceId, data.computeInstanceId), self._xid_instance))


# ---- helpers ------------------------------------------------------------------------


def _resolve(nvml, logical_index, env, count, identity=None):
    """(instance handle, board handle, DeviceRef) of the rank's device, or None when hidden.

    torch's own UUID for the device wins when torch has initialised CUDA; if NVML does not
    know it (a MIG instance reported without its prefix, say), the visibility variables decide.
    """
    refs = []
    if identity is not None:
        uuid = identity.uuid
        if uuid is None and identity.pci_bus_id:
            uuid = _uuid_at_pci(nvml, identity.pci_bus_id, count)
    else:
        uuid = device_map.torch_cuda_uuid(logical_index)
    if uuid:
        refs.append(device_map.DeviceRef(uuid=uuid, source="torch"))
        if uuid.upper().startswith("GPU-"):
            refs.append(device_map.DeviceRef(uuid="MIG-" + uuid[4:], source="torch"))
    env_ref = device_map.resolve_nvidia(logical_index, env)
    if env_ref is None and not refs:
        return None
    if env_ref is not None:
        refs.append(env_ref)
    for ref in refs:
        found = _find(nvml, ref, count)
        if found is not None:
            return (*found, ref)
    return None


def _uuid_at_pci(nvml, pci_bus_id: str, count: int) -> str | None:
    for i in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if device_map.pci_matches(pci_bus_id, _text(nvml.nvmlDeviceGetPciInfo(handle).busId)):
                return nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError:
            continue
    return None


def _find(nvml, ref, count):
    if ref.uuid is None:
        if ref.index >= count:
            return None
        handle = nvml.nvmlDeviceGetHandleByIndex(ref.index)
        return handle, handle
    if ref.is_mig:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(ref.uuid)
        except nvml.NVMLError:
            return None
        return handle, nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    matches = []
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        if device_map.uuid_matches(ref.uuid, nvml.nvmlDeviceGetUUID(handle)):
            matches.append(handle)
    if len(matches) != 1:  # none, or an ambiguous prefix (CUDA itself would refuse it)
        return None
    return matches[0], matches[0]


def _field_value(nvml, v) -> float | int:
    """The value of one nvmlFieldValue_t according to its valueType."""
    kind = v.valueType
    if kind == nvml.NVML_VALUE_TYPE_DOUBLE:
        return v.value.dVal
    if kind == nvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return v.value.uiVal
    if kind == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return v.value.ulVal
    if kind == nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return v.value.sllVal
    if kind == getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", -1):
        return v.value.siVal
    if kind == getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", -1):
        return v.value.usVal
    return v.value.ullVal


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


def _probed(reader: Callable[..., Any] | None, nvml) -> Callable[..., Any]:
    """The reader a probe chose; a metric whose probe found none is never read, and would fail
    as NVML fails a call the driver lacks."""
    if reader is None:
        raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    return reader
