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

Which amdsmi: the Python package must match the ROCm library it binds. PyPI's amdsmi 7.x
binds functions that ROCm 6.2's ``libamd_smi.so`` lacks (29 of them) and 6.4's lacks (5),
and then fails to import. So the package ROCm ships with itself
(``$ROCM_PATH/share/amd_smi``, ``/opt/rocm`` by default) is preferred; another one is used
only when ROCm ships none, and a failed import names the ROCm found and the package to use.

Which device: by ``hip_id`` (amdsmi 6.4+), which is HIP's own order, or by the PCI address
torch reports once it has initialised the device; never by the order of amdsmi's handles,
which need not be HIP's. With neither (amdsmi before 6.4, before torch starts), the sampler
waits for torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from diag.collectors import device_map
from diag.collectors.metric_set import Log, Metric, MetricSet, NotAvailable, describe_error

MIB = 1024 * 1024
KFD = "/dev/kfd"  # present wherever ROCm can run compute work (also inside containers)
DEFAULT_ROCM = "/opt/rocm"
SHIPPED_PACKAGE = ("share", "amd_smi")  # where ROCm installs its own amdsmi package


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
    def open(cls, logical_index: int | None, log: Log, env: Mapping[str, str] | None = None,
             identity: device_map.DeviceIdentity | None = None) -> AmdSmiGpu | None:
        env = os.environ if env is None else env
        if not driver_present():
            log(f"amdsmi: no AMD GPU driver ({KFD} absent); no AMD GPU metrics")
            return None
        smi = import_amdsmi(env, log)
        if smi is None:
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
            found = _resolve(smi, handles, logical_index, env, identity)
            if isinstance(found, str):
                log(f"amdsmi: {found}")
                _shutdown(smi)
                return None
            handle, ref, physical = found
            return cls(smi, handle, ref, physical, log)
        except Exception as e:
            log(f"amdsmi: could not open logical device {logical_index} ({describe_error(e)}); no AMD GPU metrics")
            _shutdown(smi)
            return None

    def matches(self, identity: device_map.DeviceIdentity) -> bool:
        """Whether this is the device torch uses (by PCI address; ROCm's torch has no UUID)."""
        return device_map.pci_matches(identity.pci_bus_id, self._facts.get("pci_bus_id"))

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
        gpu["power_watts"] = float(_number(info.get(self._power_key), str(self._power_key)))

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


def _resolve(smi, handles, logical_index, env, identity=None):
    """(handle, DeviceRef, physical index) of the rank's device, or why there is none."""
    enums = [_enumeration(smi, h) for h in handles]
    if identity is not None and identity.pci_bus_id:
        for position, (h, en) in enumerate(zip(handles, enums)):
            try:
                bdf = smi.amdsmi_get_gpu_device_bdf(h)
            except Exception:
                continue
            if device_map.pci_matches(identity.pci_bus_id, bdf):
                ref = device_map.DeviceRef(index=_hip_id(en, position), source=f"torch (pci {identity.pci_bus_id})")
                return h, ref, ref.index
        return f"no AMD GPU at PCI address {identity.pci_bus_id}, where torch's device is; no GPU metrics"
    ref = device_map.resolve_amd(logical_index, env)
    hidden = (f"logical device {logical_index} is not visible (ROCR_VISIBLE_DEVICES="
              f"{env.get('ROCR_VISIBLE_DEVICES')!r}, HIP_VISIBLE_DEVICES={env.get('HIP_VISIBLE_DEVICES')!r}, "
              f"{len(handles)} GPUs); no GPU metrics")
    if ref is None:
        return hidden
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
            return hidden
        return matches[0][0], ref, matches[0][1]
    # By index: HIP's enumeration order, which amdsmi 6.4+ reports as hip_id.
    if all(en is None for en in enums):
        return ("this amdsmi reports no hip_id (before ROCm 6.4), so HIP's device order is unknown: "
                "no GPU metrics until torch initialises the device, which is then matched by PCI address")
    for position, (h, en) in enumerate(zip(handles, enums)):
        if en is not None and _hip_id(en, position) == ref.index:
            return h, ref, ref.index
    return hidden


def _hip_id(en: dict | None, position: int) -> int:
    hip = (en or {}).get("hip_id")
    return hip if isinstance(hip, int) and not isinstance(hip, bool) else position


def _shutdown(smi) -> None:
    try:
        smi.amdsmi_shut_down()
    except Exception:
        pass


# ---- which amdsmi package ---------------------------------------------------------------


def rocm_root(env: Mapping[str, str]) -> Path | None:
    """The installed ROCm: $ROCM_PATH, $ROCM_HOME or /opt/rocm, the first that exists."""
    for candidate in (env.get("ROCM_PATH"), env.get("ROCM_HOME"), DEFAULT_ROCM):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def rocm_version(root: Path | None) -> str | None:
    """"6.2.4" from ROCm's own version file (``.info/version``: "6.2.4-120")."""
    if root is None:
        return None
    try:
        with open(root / ".info" / "version", encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return text.split("-", 1)[0] or None


def import_amdsmi(env: Mapping[str, str], log: Log):
    """The amdsmi module that matches the installed ROCm, or None (logged once).

    A module already imported by the process is used as it is. Otherwise ROCm's own package
    is loaded from its directory, else whatever ``import amdsmi`` finds."""
    if "amdsmi" in sys.modules:
        return sys.modules["amdsmi"]
    root = rocm_root(env)
    shipped = root.joinpath(*SHIPPED_PACKAGE, "amdsmi") if root is not None else None
    origin = "pip"
    try:
        if shipped is not None and (shipped / "__init__.py").is_file():
            origin = str(shipped.parent)
            return _load_package("amdsmi", shipped)
        import amdsmi

        return amdsmi
    except BaseException as e:  # libamd_smi.so missing raises KeyError inside the package
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
            del sys.modules[name]  # a half-imported package must not be found by the next import
        log(f"amdsmi: import failed ({describe_error(e)}){_mismatch(root, origin)}; no AMD GPU metrics")
        return None


def _load_package(name: str, directory: Path):
    spec = importlib.util.spec_from_file_location(name, directory / "__init__.py",
                                                  submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise ImportError(f"{directory} holds no importable package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _mismatch(root: Path | None, origin: str) -> str:
    """What to install, when the package is not ROCm's own: the ROCm found and its version."""
    if origin != "pip":
        return f": ROCm's own package at {origin} does not load"
    try:
        installed = importlib.metadata.version("amdsmi")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    version = rocm_version(root)
    if root is None:
        return ": no ROCm found ($ROCM_PATH, /opt/rocm)"
    found = f"ROCm {version} at {root}" if version else f"ROCm at {root}"
    if installed and version and installed.split(".")[:2] != version.split(".")[:2]:
        minor = ".".join(version.split(".")[:2])
        return (f": amdsmi {installed} from pip does not match {found}; "
                f"pip install 'amdsmi=={minor}.*' or pip install {root}/share/amd_smi")
    return f" with {found}"
