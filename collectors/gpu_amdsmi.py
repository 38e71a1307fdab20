"""AMD device metrics through amdsmi (ROCm's management library, module ``amdsmi``).

The same probe-once table as NVML: activity, VRAM, GFX clock, power, energy and
temperature. ``amdsmi`` is imported only when a sampler opens and only on a node with
the AMD compute driver (``/dev/kfd``): its import loads ``libamd_smi.so`` and, where that
is missing, prints to stdout and raises. Any failure there switches AMD metrics off.

amdsmi 6.x and 7.x differ in a few field names; both are read:
- clocks: ``clk`` (6.1+) or ``cur_clk`` (6.0), MHz;
- power: ``socket_power`` (6.2+/7.x), ``current_socket_power`` (6.1),
  ``average_socket_power`` (6.0, and MI200 parts), watts; "N/A" when the part lacks it;
- energy: ``energy_accumulator`` (6.1+) or ``power`` (6.0) ticks of ``counter_resolution`` µJ;
- VRAM usage is in MiB; temperatures are °C.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from diag.collectors import device_map
from diag.collectors.metric_set import Log, Metric, MetricSet, NotAvailable, describe_error

MIB = 1024 * 1024
KFD = "/dev/kfd"  # present wherever ROCm can run compute work (also inside containers)


def driver_present() -> bool:
    return os.path.exists(KFD)


def _number(value, what: str) -> float:
    """amdsmi's dicts hold "N/A" (a str) for values the part does not report."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NotAvailable(f"{what} is {value!r}")
    return value


class AmdSmiGpu(MetricSet):
    """The rank's AMD device: static facts and one ``read()`` per sample."""

    vendor = "amd"
    source = "amdsmi"

    def __init__(self, smi, handle, ref: device_map.DeviceRef, physical_index: int | None, log: Log):
        super().__init__(log)
        self.smi = smi
        self.handle = handle
        self.ref = ref
        self._power_key: str | None = None
        self._clock_key: str | None = None
        self._temp_sensor = None
        self._facts = self._static_facts(physical_index)
        self.probe(str(self._facts.get("name")))

    @classmethod
    def open(cls, logical_index: int | None, log: Log, env: Mapping[str, str] | None = None) -> AmdSmiGpu | None:
        env = os.environ if env is None else env
        if not driver_present():
            log(f"amdsmi: no AMD GPU driver ({KFD} absent); no AMD GPU metrics")
            return None
        try:
            import amdsmi as smi
        except BaseException as e:  # libamd_smi.so missing raises KeyError inside the package
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            log(f"amdsmi: import failed ({describe_error(e)}); no AMD GPU metrics")
            return None
        try:
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except Exception as e:
            log(f"amdsmi: init failed ({describe_error(e)}); no AMD GPU metrics")
            return None
        try:
            handles = smi.amdsmi_get_processor_handles()
            if not handles:
                log("amdsmi: initialised but found no AMD GPU")
                _shutdown(smi)
                return None
            found = _resolve(smi, handles, logical_index, env)
            if found is None:
                log(
                    f"amdsmi: logical device {logical_index} is not visible (ROCR_VISIBLE_DEVICES="
                    f"{env.get('ROCR_VISIBLE_DEVICES')!r}, HIP_VISIBLE_DEVICES={env.get('HIP_VISIBLE_DEVICES')!r}, "
                    f"{len(handles)} GPUs); no GPU metrics"
                )
                _shutdown(smi)
                return None
            handle, ref, physical = found
            return cls(smi, handle, ref, physical, log)
        except Exception as e:
            log(f"amdsmi: could not open logical device {logical_index} ({describe_error(e)}); no AMD GPU metrics")
            _shutdown(smi)
            return None

    def _static_facts(self, physical_index: int | None) -> dict:
        smi, h = self.smi, self.handle
        facts: dict = {"vendor": "amd", "mig": False, "physical_index": physical_index}

        def name():
            market = smi.amdsmi_get_gpu_asic_info(h).get("market_name")
            if market and market != "N/A":
                return market
            return smi.amdsmi_get_gpu_board_info(h).get("product_name")

        for key, fn in (
            ("name", name),
            ("uuid", lambda: smi.amdsmi_get_gpu_device_uuid(h)),
            ("memory_total_bytes", lambda: int(smi.amdsmi_get_gpu_memory_total(h, smi.AmdSmiMemoryType.VRAM))),
            ("driver_version", lambda: smi.amdsmi_get_gpu_driver_info(h).get("driver_version")),
            ("pci_bus_id", lambda: smi.amdsmi_get_gpu_device_bdf(h)),
        ):
            try:
                facts[key] = fn()
            except Exception:
                facts[key] = None
        facts["index"] = physical_index
        facts["selected_by"] = self.ref.describe()
        return facts

    def table(self) -> list[Metric]:
        return [
            Metric("utilization", self._read_activity),
            Metric("memory", self._read_vram),
            Metric("sm_clock", self._read_clock, self._probe_clock),
            Metric("power", self._read_power, self._probe_power),
            Metric("energy", self._read_energy),
            Metric("temperature", self._read_temperature, self._probe_temperature),
        ]

    def read(self) -> dict:
        gpu = {"index": self._facts["index"], "uuid": self._facts["uuid"], "name": self._facts["name"]}
        self.read_into(gpu)
        return gpu

    def info(self) -> dict:
        return {**self._facts, **self.state()}

    def close(self) -> None:
        _shutdown(self.smi)

    # ---- readers ---------------------------------------------------------------------

    def _read_activity(self, gpu: dict) -> None:
        activity = self.smi.amdsmi_get_gpu_activity(self.handle)
        gpu["utilization_ratio"] = _number(activity.get("gfx_activity"), "gfx_activity") / 100.0

    def _read_vram(self, gpu: dict) -> None:
        usage = self.smi.amdsmi_get_gpu_vram_usage(self.handle)
        used = _number(usage.get("vram_used"), "vram_used")
        total = _number(usage.get("vram_total"), "vram_total")
        gpu["memory_used_bytes"] = int(used) * MIB
        gpu["memory_total_bytes"] = int(total) * MIB

    def _probe_clock(self) -> None:
        info = self.smi.amdsmi_get_clock_info(self.handle, self.smi.AmdSmiClkType.GFX)
        self._clock_key = "clk" if "clk" in info else "cur_clk"

    def _read_clock(self, gpu: dict) -> None:
        info = self.smi.amdsmi_get_clock_info(self.handle, self.smi.AmdSmiClkType.GFX)
        gpu["sm_clock_hz"] = int(_number(info.get(self._clock_key), "gfx clock")) * 1_000_000

    def _probe_power(self) -> None:
        info = self.smi.amdsmi_get_power_info(self.handle)
        for key in ("socket_power", "current_socket_power", "average_socket_power"):
            value = info.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._power_key = key
                return
        raise NotAvailable("no socket power reading")

    def _read_power(self, gpu: dict) -> None:
        info = self.smi.amdsmi_get_power_info(self.handle)
        gpu["power_watts"] = float(_number(info.get(self._power_key), self._power_key))

    def _read_energy(self, gpu: dict) -> None:
        energy = self.smi.amdsmi_get_energy_count(self.handle)
        ticks = energy.get("energy_accumulator", energy.get("power"))
        resolution = _number(energy.get("counter_resolution"), "counter_resolution")
        gpu["energy_joules_total"] = _number(ticks, "energy_accumulator") * resolution / 1e6  # µJ

    def _probe_temperature(self) -> None:
        # Hotspot (junction) is the die's hottest point, what throttling acts on; the
        # edge sensor is absent on MI300-class parts.
        smi = self.smi
        errors = []
        for sensor in (smi.AmdSmiTemperatureType.HOTSPOT, smi.AmdSmiTemperatureType.EDGE):
            try:
                smi.amdsmi_get_temp_metric(self.handle, sensor, smi.AmdSmiTemperatureMetric.CURRENT)
            except smi.AmdSmiException as e:
                errors.append(describe_error(e))
                continue
            self._temp_sensor = sensor
            return
        raise NotAvailable("; ".join(errors))

    def _read_temperature(self, gpu: dict) -> None:
        smi = self.smi
        value = smi.amdsmi_get_temp_metric(self.handle, self._temp_sensor, smi.AmdSmiTemperatureMetric.CURRENT)
        gpu["temperature_celsius"] = float(value)


def _enumeration(smi, handle) -> dict | None:
    """hip_id / hip_uuid of a handle (amdsmi 6.4+); None on older libraries."""
    fn = getattr(smi, "amdsmi_get_gpu_enumeration_info", None)
    if fn is None:
        return None
    try:
        return fn(handle)
    except Exception:
        return None


def _resolve(smi, handles, logical_index, env):
    """(handle, DeviceRef, physical index) of the rank's device, or None when hidden."""
    ref = device_map.resolve_amd(logical_index, env)
    if ref is None:
        return None
    enums = [_enumeration(smi, h) for h in handles]
    if ref.uuid is not None:
        matches = []
        for position, (h, en) in enumerate(zip(handles, enums)):
            candidates = [(en or {}).get("hip_uuid")]
            try:
                candidates.append(smi.amdsmi_get_gpu_device_uuid(h))
            except Exception:
                pass
            if any(device_map.uuid_matches(ref.uuid, c) for c in candidates):
                matches.append((h, _hip_id(en, position)))
        if len(matches) != 1:
            return None
        return matches[0][0], ref, matches[0][1]
    # By index: HIP's enumeration order, which amdsmi reports as hip_id when it can.
    for position, (h, en) in enumerate(zip(handles, enums)):
        if en is not None and _hip_id(en, position) == ref.index:
            return h, ref, ref.index
    if any(en is not None for en in enums) or ref.index >= len(handles):
        return None
    return handles[ref.index], ref, ref.index


def _hip_id(en: dict | None, position: int) -> int:
    hip = (en or {}).get("hip_id")
    return hip if isinstance(hip, int) and not isinstance(hip, bool) else position


def _shutdown(smi) -> None:
    try:
        smi.amdsmi_shut_down()
    except Exception:
        pass
