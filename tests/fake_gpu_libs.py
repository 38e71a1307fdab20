"""Fake C libraries under the REAL pynvml and amdsmi Python modules.

Only the bottom layer is replaced: for pynvml, the shared-library handle and the C
function pointers (``pynvml.nvmlLib`` and ``pynvml._nvmlGetFunctionPointer``); for amdsmi,
the ``ctypes.CDLL`` that ``amdsmi_wrapper`` loads ``libamd_smi.so`` with. The real
wrappers then run unchanged: their ctypes structs are passed ``byref`` to our functions,
which fill them and return C status codes, exactly as the drivers' libraries do. So
unit handling, struct layouts, error classes and version quirks are the libraries' own.
"""

from __future__ import annotations

import ctypes
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pynvml


def _out(ref):
    """The ctypes object behind a byref() argument."""
    return ref._obj


def _val(arg):
    """A C scalar argument as a Python value (ctypes scalar, enum or plain int)."""
    return arg.value if hasattr(arg, "value") else arg


# ---------------------------------------------------------------- NVML -------------


@dataclass
class FakeNvidiaGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util_pct: int = 87
    mem_total: int = 80 * 1024**3
    mem_used: int = 30 * 1024**3
    sm_clock_mhz: int = 1980
    power_mw: int = 312_500
    energy_mj: int = 123_456_789
    temp_c: int = 71
    clock_reasons: int = 0
    pcie_kbps: tuple[int, int] = (2048, 512)  # tx, rx in KB/s
    nvlink_kib: tuple[int, int] | None = (1_000, 3_000)  # aggregate tx, rx counters; None: unsupported
    nvlink_per_link_kib: list[tuple[int, int]] | None = None  # (tx, rx) per link, aggregate unsupported
    ecc: tuple[int, int] = (0, 0)  # corrected, uncorrected (volatile)
    event_types: int = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
    # An XID code (NVML attributes it to no MIG instance), or (code, GPU instance, compute instance).
    pending_xids: list = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # C functions answering NOT_SUPPORTED
    fail_after: dict[str, tuple[int, int]] = field(default_factory=dict)  # fn -> (ok calls, error code)
    mig_children: list[str] = field(default_factory=list)  # MIG UUIDs on this board


# nvmlErrorString's texts for the codes the tests use, as libnvidia-ml returns them.
_NVML_ERROR_STRINGS = {
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: b"Driver Not Loaded",
    pynvml.NVML_ERROR_GPU_IS_LOST: b"GPU is lost",
    pynvml.NVML_ERROR_NOT_SUPPORTED: b"Not Supported",
}


UNATTRIBUTED = 0xFFFFFFFF  # nvmlEventData_t's instance ids for an event of no MIG instance


class FakeNvml:
    """A fake libnvidia-ml: a table of C functions over a list of fake GPUs."""

    def __init__(self, gpus: list[FakeNvidiaGpu], init_error: int = pynvml.NVML_SUCCESS, driver="550.54.15"):
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.calls: Counter[str] = Counter()
        self.missing: set[str] = set()  # functions the "driver" does not export
        self.failing: dict[str, int] = {}  # C function -> the error code it returns on every call
        # One opaque struct per device (and per MIG instance): a handle points at it.
        self._boards = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        self._migs: dict[str, tuple[int, object]] = {}
        for i, g in enumerate(gpus):
            for mig_uuid in g.mig_children:
                self._migs[mig_uuid] = (i, pynvml.struct_c_nvmlDevice_t())
        self._event_sets: dict[int, list[int]] = {}
        self._event_structs: list = []
        self.registered: list[tuple[int, int]] = []

    # -- install under the real module --
    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlLib", self)  # "loaded": _LoadNvmlLibrary skips CDLL
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self.function)

    def function(self, name: str):
        impl = getattr(self, "c_" + name, None)
        if impl is None or name in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        def call(*args):
            self.calls[name] += 1
            if name in self.failing:
                return self.failing[name]
            return impl(*args)

        return call

    # -- handle bookkeeping --
    def _gpu_of(self, handle) -> tuple[int, FakeNvidiaGpu, str | None]:
        addr = ctypes.addressof(handle.contents)
        for i, s in enumerate(self._boards):
            if ctypes.addressof(s) == addr:
                return i, self.gpus[i], None
        for mig_uuid, (i, s) in self._migs.items():
            if ctypes.addressof(s) == addr:
                return i, self.gpus[i], mig_uuid
        raise AssertionError("unknown handle")

    def _status(self, name: str, handle) -> int | None:
        """NOT_SUPPORTED / injected failures for device functions; None means go on."""
        _, gpu, mig = self._gpu_of(handle)
        if name in gpu.unsupported:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        if mig is not None and name in ("nvmlDeviceGetUtilizationRates",):
            return pynvml.NVML_ERROR_NOT_SUPPORTED  # as on real MIG instances
        if name in gpu.fail_after:
            ok, code = gpu.fail_after[name]
            if self.calls[name] > ok:
                return code
        return None

    # -- C functions (signatures as pynvml calls them) --
    def c_nvmlInitWithFlags(self, flags):
        return self.init_error

    def c_nvmlShutdown(self):
        return pynvml.NVML_SUCCESS

    def c_nvmlErrorString(self, result):
        code = _val(result)
        return _NVML_ERROR_STRINGS.get(code, b"fake error %d" % code)

    def c_nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = self.driver.encode()
        return pynvml.NVML_SUCCESS

    def c_nvmlSystemGetCudaDriverVersion(self, ref):
        _out(ref).value = 12040
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetCount_v2(self, ref):
        _out(ref).value = len(self.gpus)
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        i = _val(index)
        if i >= len(self.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _out(ref).contents = self._boards[i]
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetHandleByUUID(self, uuid, ref):
        wanted = _val(uuid).decode()
        for i, g in enumerate(self.gpus):
            if g.uuid == wanted:
                _out(ref).contents = self._boards[i]
                return pynvml.NVML_SUCCESS
        if wanted in self._migs:
            _out(ref).contents = self._migs[wanted][1]
            return pynvml.NVML_SUCCESS
        return pynvml.NVML_ERROR_NOT_FOUND

    def c_nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig, ref):
        i, _, mig_uuid = self._gpu_of(mig)
        if mig_uuid is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _out(ref).contents = self._boards[i]
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetGpuInstanceId(self, handle, ref):
        # MIG instance n of a board (in mig_children order) is GPU instance n + 1, compute instance 0.
        i, gpu, mig = self._gpu_of(handle)
        if mig is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT  # as for a board handle
        _out(ref).value = gpu.mig_children.index(mig) + 1
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetComputeInstanceId(self, handle, ref):
        if self._gpu_of(handle)[2] is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _out(ref).value = 0
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetName(self, handle, buf, size):
        _, gpu, mig = self._gpu_of(handle)
        buf.value = (gpu.name + (" MIG 1g.10gb" if mig else "")).encode()
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetUUID(self, handle, buf, size):
        _, gpu, mig = self._gpu_of(handle)
        buf.value = (mig or gpu.uuid).encode()
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetIndex(self, handle, ref):
        _out(ref).value = self._gpu_of(handle)[0]
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetPciInfo_v3(self, handle, ref):
        i = self._gpu_of(handle)[0]
        _out(ref).busId = b"00000000:%02X:00.0" % (0x17 + i)
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetMemoryInfo(self, handle, ref):
        if (st := self._status("nvmlDeviceGetMemoryInfo", handle)) is not None:
            return st
        _, gpu, mig = self._gpu_of(handle)
        mem = _out(ref)
        total = gpu.mem_total // 8 if mig else gpu.mem_total
        used = gpu.mem_used // 8 if mig else gpu.mem_used
        mem.total, mem.used, mem.free = total, used, total - used
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetUtilizationRates(self, handle, ref):
        if (st := self._status("nvmlDeviceGetUtilizationRates", handle)) is not None:
            return st
        util = _out(ref)
        util.gpu = self._gpu_of(handle)[1].util_pct
        util.memory = 40
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetClockInfo(self, handle, clock_type, ref):
        if (st := self._status("nvmlDeviceGetClockInfo", handle)) is not None:
            return st
        assert _val(clock_type) == pynvml.NVML_CLOCK_SM
        _out(ref).value = self._gpu_of(handle)[1].sm_clock_mhz
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetPowerUsage(self, handle, ref):
        if (st := self._status("nvmlDeviceGetPowerUsage", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].power_mw
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
        if (st := self._status("nvmlDeviceGetTotalEnergyConsumption", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].energy_mj
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetTemperatureV(self, handle, ref):
        if (st := self._status("nvmlDeviceGetTemperatureV", handle)) is not None:
            return st
        t = _out(ref)
        assert t.version == pynvml.nvmlTemperature_v1 and t.sensorType == pynvml.NVML_TEMPERATURE_GPU
        t.temperature = self._gpu_of(handle)[1].temp_c
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetTemperature(self, handle, sensor, ref):
        if (st := self._status("nvmlDeviceGetTemperature", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].temp_c
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        if (st := self._status("nvmlDeviceGetCurrentClocksEventReasons", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].clock_reasons
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, ref):
        if (st := self._status("nvmlDeviceGetCurrentClocksThrottleReasons", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].clock_reasons
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetPcieThroughput(self, handle, counter, ref):
        if (st := self._status("nvmlDeviceGetPcieThroughput", handle)) is not None:
            return st
        tx, rx = self._gpu_of(handle)[1].pcie_kbps
        _out(ref).value = tx if _val(counter) == pynvml.NVML_PCIE_UTIL_TX_BYTES else rx
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetFieldValues(self, handle, count, ref):
        if (st := self._status("nvmlDeviceGetFieldValues", handle)) is not None:
            return st
        gpu = self._gpu_of(handle)[1]
        values = _out(ref)
        tx_id, rx_id = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
        for i in range(_val(count)):
            v = values[i]
            v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            if v.fieldId == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and gpu.nvlink_per_link_kib is not None:
                v.valueType, v.value.uiVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, len(gpu.nvlink_per_link_kib)
                v.nvmlReturn = pynvml.NVML_SUCCESS
            elif v.fieldId in (tx_id, rx_id):
                which = 0 if v.fieldId == tx_id else 1
                if v.scopeId == 0xFFFFFFFF and gpu.nvlink_kib is not None:
                    value = gpu.nvlink_kib[which]
                elif v.scopeId != 0xFFFFFFFF and gpu.nvlink_per_link_kib and v.scopeId < len(gpu.nvlink_per_link_kib):
                    value = gpu.nvlink_per_link_kib[v.scopeId][which]
                else:
                    continue
                v.valueType, v.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, value
                v.nvmlReturn = pynvml.NVML_SUCCESS
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type, ref):
        if (st := self._status("nvmlDeviceGetTotalEccErrors", handle)) is not None:
            return st
        assert _val(counter_type) == pynvml.NVML_VOLATILE_ECC
        corrected, uncorrected = self._gpu_of(handle)[1].ecc
        _out(ref).value = uncorrected if _val(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else corrected
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceGetSupportedEventTypes(self, handle, ref):
        if (st := self._status("nvmlDeviceGetSupportedEventTypes", handle)) is not None:
            return st
        _out(ref).value = self._gpu_of(handle)[1].event_types
        return pynvml.NVML_SUCCESS

    def c_nvmlEventSetCreate(self, ref):
        event_set = pynvml.struct_c_nvmlEventSet_t()
        self._event_structs.append(event_set)  # kept alive: the handle points at it
        _out(ref).contents = event_set
        self._event_sets[ctypes.addressof(event_set)] = []
        return pynvml.NVML_SUCCESS

    def c_nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
        i = self._gpu_of(handle)[0]
        self._event_sets[ctypes.addressof(event_set.contents)].append(i)
        self.registered.append((i, _val(event_types)))
        return pynvml.NVML_SUCCESS

    def c_nvmlEventSetWait_v2(self, event_set, ref, timeout_ms):
        assert _val(timeout_ms) == 0, "the sampler must never block on events"
        for i in self._event_sets[ctypes.addressof(event_set.contents)]:
            gpu = self.gpus[i]
            if gpu.pending_xids:
                data = _out(ref)
                data.device = ctypes.pointer(self._boards[i])
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                xid = gpu.pending_xids.pop(0)
                code, gi, ci = xid if isinstance(xid, tuple) else (xid, UNATTRIBUTED, UNATTRIBUTED)
                data.eventData, data.gpuInstanceId, data.computeInstanceId = code, gi, ci
                return pynvml.NVML_SUCCESS
        return pynvml.NVML_ERROR_TIMEOUT

    def c_nvmlEventSetFree(self, event_set):
        return pynvml.NVML_SUCCESS


# ---------------------------------------------------------------- amdsmi -----------

AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_NOT_SUPPORTED = 2


@dataclass
class FakeAmdGpu:
    uuid: str
    hip_id: int | None  # None: amdsmi_get_gpu_enumeration_info unsupported (older library)
    market_name: str = "AMD Instinct MI300X"
    gfx_activity: int = 64  # %, 0xFFFF = N/A
    vram_total_mb: int = 196_592
    vram_used_mb: int = 50_000
    gfx_clock_mhz: int = 2100
    socket_power_w: int = 650  # 0xFFFF = N/A
    average_power_w: int = 640
    energy_ticks: int = 1_000_000
    energy_resolution_uj: float = 15.3
    temps: dict[str, int] = field(default_factory=lambda: {"HOTSPOT": 75})
    pci_bus: int | None = None  # None: bus 0x11 + 0x10 * the handle's position
    unsupported: set[str] = field(default_factory=set)
    fail_after: dict[str, tuple[int, int]] = field(default_factory=dict)


class _FakeCFunction:
    """Stands in for a ctypes function pointer: accepts restype/argtypes and is callable."""

    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.restype = None
        self.argtypes = None

    def __call__(self, *args):
        return self.lib.dispatch(self.name, args)


AMDSMI_SYMBOLS = Path(__file__).parent / "fixtures" / "amdsmi"


def rocm_symbols(rocm: str) -> frozenset[str]:
    """The functions ROCm `rocm` ("6.2", "6.4", "7.0")'s libamd_smi.so exports (see the files' source)."""
    lines = (AMDSMI_SYMBOLS / f"rocm-{rocm}.symbols").read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


class FakeAmdSmiLib:
    """A fake libamd_smi.so: what ctypes.CDLL returns to amdsmi_wrapper. With `rocm`, it
    exports only that release's functions and refuses the others as the dynamic linker does."""

    HANDLE_BASE = 0x7F000000

    def __init__(self, rocm: str | None = "7.0", path: str = "/opt/rocm/lib/libamd_smi.so"):
        self.gpus: list[FakeAmdGpu] = []
        self.init_status = AMDSMI_STATUS_SUCCESS
        self.calls: Counter[str] = Counter()
        self.exports = rocm_symbols(rocm) if rocm else None
        self.path = path
        self._functions: dict[str, _FakeCFunction] = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.exports is not None and name not in self.exports:
            raise AttributeError(f"{self.path}: undefined symbol: {name}")  # ctypes' own message
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = _FakeCFunction(self, name)
        return fn

    def dispatch(self, name, args):
        self.calls[name] += 1
        impl = getattr(type(self), "c_" + name, None)
        if impl is None:
            return AMDSMI_STATUS_NOT_SUPPORTED
        return impl(self, *args)

    def _gpu(self, name, handle) -> FakeAmdGpu | int:
        gpu = self.gpus[_val(handle) - self.HANDLE_BASE]
        if name in gpu.unsupported:
            return AMDSMI_STATUS_NOT_SUPPORTED
        if name in gpu.fail_after:
            ok, code = gpu.fail_after[name]
            if self.calls[name] > ok:
                return code
        return gpu

    def c_amdsmi_init(self, flags):
        return self.init_status

    def c_amdsmi_shut_down(self):
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_socket_handles(self, count_ref, handles):
        _out(count_ref).value = 1
        if handles:
            handles[0] = 0x5000
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_processor_handles(self, socket, count_ref, handles):
        _out(count_ref).value = len(self.gpus)
        if handles:
            for i in range(len(self.gpus)):
                handles[i] = self.HANDLE_BASE + i
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_enumeration_info(self, handle, ref):
        gpu = self._gpu("amdsmi_get_gpu_enumeration_info", handle)
        if isinstance(gpu, int):
            return gpu
        if gpu.hip_id is None:
            return AMDSMI_STATUS_NOT_SUPPORTED
        info = _out(ref)
        info.hip_id, info.hsa_id, info.drm_card, info.drm_render = gpu.hip_id, gpu.hip_id + 2, gpu.hip_id, 128
        info.hip_uuid = gpu.uuid.encode()
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_device_bdf(self, handle, ref):
        gpu = self._gpu("amdsmi_get_gpu_device_bdf", handle)
        if isinstance(gpu, int):
            return gpu
        bdf = _out(ref).struct_amdsmi_bdf_t
        position = _val(handle) - self.HANDLE_BASE
        bdf.domain_number, bdf.device_number, bdf.function_number = 0, 0, 0
        bdf.bus_number = gpu.pci_bus if gpu.pci_bus is not None else 0x11 + 0x10 * position
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_device_uuid(self, handle, length_ref, buf):
        gpu = self._gpu("amdsmi_get_gpu_device_uuid", handle)
        if isinstance(gpu, int):
            return gpu
        buf.value = gpu.uuid.encode()
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_asic_info(self, handle, ref):
        gpu = self._gpu("amdsmi_get_gpu_asic_info", handle)
        if isinstance(gpu, int):
            return gpu
        info = _out(ref)
        info.market_name = gpu.market_name.encode()
        info.vendor_id, info.vendor_name, info.device_id = 0x1002, b"Advanced Micro Devices Inc.", 0x74A1
        info.asic_serial = b"A1B2C3D4E5F60718"
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_driver_info(self, handle, ref):
        info = _out(ref)
        info.driver_name, info.driver_version, info.driver_date = b"amdgpu", b"6.10.5", b"2025/01/01"
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_memory_total(self, handle, mem_type, ref):
        gpu = self._gpu("amdsmi_get_gpu_memory_total", handle)
        if isinstance(gpu, int):
            return gpu
        _out(ref).value = gpu.vram_total_mb * 1024 * 1024
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_activity(self, handle, ref):
        gpu = self._gpu("amdsmi_get_gpu_activity", handle)
        if isinstance(gpu, int):
            return gpu
        usage = _out(ref)
        usage.gfx_activity, usage.umc_activity, usage.mm_activity = gpu.gfx_activity, 20, 0xFFFF
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_gpu_vram_usage(self, handle, ref):
        gpu = self._gpu("amdsmi_get_gpu_vram_usage", handle)
        if isinstance(gpu, int):
            return gpu
        usage = _out(ref)
        usage.vram_total, usage.vram_used = gpu.vram_total_mb, gpu.vram_used_mb
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_clock_info(self, handle, clock_type, ref):
        gpu = self._gpu("amdsmi_get_clock_info", handle)
        if isinstance(gpu, int):
            return gpu
        import amdsmi

        assert clock_type == amdsmi.AmdSmiClkType.GFX
        info = _out(ref)
        info.clk, info.min_clk, info.max_clk = gpu.gfx_clock_mhz, 500, 2100
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_power_info(self, handle, ref):
        gpu = self._gpu("amdsmi_get_power_info", handle)
        if isinstance(gpu, int):
            return gpu
        info = _out(ref)
        info.socket_power = gpu.socket_power_w
        info.current_socket_power = 0xFFFF
        info.average_socket_power = gpu.average_power_w
        info.power_limit = 750
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_energy_count(self, handle, acc_ref, res_ref, ts_ref):
        gpu = self._gpu("amdsmi_get_energy_count", handle)
        if isinstance(gpu, int):
            return gpu
        _out(acc_ref).value = gpu.energy_ticks
        _out(res_ref).value = gpu.energy_resolution_uj
        _out(ts_ref).value = 1
        return AMDSMI_STATUS_SUCCESS

    def c_amdsmi_get_temp_metric(self, handle, sensor, metric, ref):
        gpu = self._gpu("amdsmi_get_temp_metric", handle)
        if isinstance(gpu, int):
            return gpu
        import amdsmi

        assert metric == amdsmi.AmdSmiTemperatureMetric.CURRENT
        name = amdsmi.AmdSmiTemperatureType(sensor).name
        if name not in gpu.temps:
            return AMDSMI_STATUS_NOT_SUPPORTED
        _out(ref).value = gpu.temps[name]
        return AMDSMI_STATUS_SUCCESS


def install_fake_amdsmi(monkeypatch, rocm: str | None = "7.0", import_now: bool = True) -> FakeAmdSmiLib:
    """Answer ctypes.CDLL('libamd_smi.so') with a fake of ROCm `rocm`'s library and (unless
    `import_now` is false) import the real amdsmi package over it.

    The caller must call ``forget_amdsmi()`` at teardown so later imports load for real.
    """
    fake = FakeAmdSmiLib(rocm)
    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if "amd_smi" in str(name):
            return fake
        return real_cdll(name, *args, **kwargs)

    forget_amdsmi()
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    if import_now:
        import amdsmi  # noqa: F401  (the real package, bound to the fake library)

    return fake


def forget_amdsmi() -> None:
    for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
        del sys.modules[name]
