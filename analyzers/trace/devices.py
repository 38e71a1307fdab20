"""Device peaks: dense FLOP/s per dtype and memory bandwidth, and matching of trace device names.

Figures are the vendors' datasheet peaks for dense math (no structured sparsity), in
FLOP/s and bytes/s. fp32 is the non-tensor-core (vector) rate; tf32 is listed separately.
AMD MI250/MI250X appear to PyTorch as two devices (GCDs), each reporting half of the
package; HIP traces often name them only "AMD Radeon Graphics", so AMD devices are also
matched by compute-unit count (`numSms`), wavefront size 64 and memory size.

CPU peaks come from `diag calibrate` (a micro-benchmark), cached in
$XDG_CACHE_HOME/diag/cpu_peaks.json. The agent records them in each rank's rank.json, and
an analysis takes them from there or from `diag analyze --calibration FILE`: never from
the cache of the machine it runs on.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

T = 1e12
GB = 1e9


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    flops: dict = field(default_factory=dict)  # dtype -> FLOP/s (dense)
    mem_bw: float = 0.0  # bytes/s
    mem_bytes: float | None = None

    def peak_flops(self, dtype: str = "bf16") -> float | None:
        f = self.flops
        if dtype in f and f[dtype]:
            return f[dtype]
        if dtype == "bf16" and f.get("fp16"):  # V100 has no bf16 tensor cores; fp16 is the peak
            return f["fp16"]
        return f.get("fp32")

    def knee(self, dtype: str = "bf16") -> float | None:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from bandwidth to compute."""
        p = self.peak_flops(dtype)
        return p / self.mem_bw if p and self.mem_bw else None

    def as_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "flops": dict(self.flops), "mem_bw": self.mem_bw,
                "mem_bytes": self.mem_bytes}


def _d(key, name, fp32, tf32, fp16, bf16, bw_gbs, mem_gb=None):
    fl = {"fp32": fp32 * T, "fp16": fp16 * T}
    if tf32:
        fl["tf32"] = tf32 * T
    if bf16:
        fl["bf16"] = bf16 * T
    return Device(key, name, fl, bw_gbs * GB, mem_gb * GB if mem_gb else None)


PEAKS: dict[str, Device] = {d.key: d for d in [
    _d("v100-sxm2", "NVIDIA V100 SXM2", 15.7, None, 125, None, 900, 32),
    _d("v100-pcie", "NVIDIA V100 PCIe", 14.0, None, 112, None, 900, 32),
    _d("v100s", "NVIDIA V100S PCIe", 16.4, None, 130, None, 1134, 32),
    _d("t4", "NVIDIA T4", 8.1, None, 65, None, 320, 16),
    _d("a100-40gb", "NVIDIA A100 SXM4 40GB", 19.5, 156, 312, 312, 1555, 40),
    _d("a100-80gb", "NVIDIA A100 SXM4 80GB", 19.5, 156, 312, 312, 2039, 80),
    _d("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", 19.5, 156, 312, 312, 1935, 80),
    _d("a10", "NVIDIA A10", 31.2, 62.5, 125, 125, 600, 24),
    _d("l4", "NVIDIA L4", 30.3, 60, 121, 121, 300, 24),
    _d("l40s", "NVIDIA L40S", 91.6, 183, 362, 362, 864, 48),
    _d("h100-sxm", "NVIDIA H100 SXM", 67, 494.7, 989.4, 989.4, 3350, 80),
    _d("h100-pcie", "NVIDIA H100 PCIe", 51, 378, 756, 756, 2000, 80),
    _d("h100-nvl", "NVIDIA H100 NVL", 60, 417.5, 835, 835, 3900, 94),
    _d("gh200", "NVIDIA GH200", 67, 494.7, 989.4, 989.4, 4000, 96),
    _d("h200", "NVIDIA H200", 67, 494.7, 989.4, 989.4, 4800, 141),
    _d("b200", "NVIDIA B200", 75, 1100, 2250, 2250, 8000, 180),
    _d("mi210", "AMD Instinct MI210", 22.6, None, 181, 181, 1638, 64),
    _d("mi250-gcd", "AMD Instinct MI250 (one GCD)", 22.6, None, 181, 181, 1638, 64),
    _d("mi250x-gcd", "AMD Instinct MI250X (one GCD)", 23.9, None, 191.5, 191.5, 1638, 64),
    _d("mi250x", "AMD Instinct MI250X (package)", 47.9, None, 383, 383, 3277, 128),
    _d("mi300x", "AMD Instinct MI300X", 163.4, 653.7, 1307.4, 1307.4, 5300, 192),
    _d("mi325x", "AMD Instinct MI325X", 163.4, 653.7, 1307.4, 1307.4, 6000, 256),
]}

_NAME_RULES: list[tuple[re.Pattern, str | Callable[[float | None], str]]] = [
    (re.compile(r"V100S", re.I), "v100s"),
    (re.compile(r"V100.*PCIE", re.I), "v100-pcie"),
    (re.compile(r"V100", re.I), "v100-sxm2"),
    (re.compile(r"\bT4\b", re.I), "t4"),
    (re.compile(r"A100.*PCIE", re.I), lambda gb: "a100-pcie-80gb" if gb and gb > 50 else "a100-40gb"),
    (re.compile(r"A100|A800", re.I), lambda gb: "a100-80gb" if gb and gb > 50 else "a100-40gb"),
    (re.compile(r"\bA10\b|A10G", re.I), "a10"),
    (re.compile(r"\bL4\b", re.I), "l4"),
    (re.compile(r"L40", re.I), "l40s"),
    (re.compile(r"GH200", re.I), "gh200"),
    (re.compile(r"H200", re.I), "h200"),
    (re.compile(r"H100.*NVL", re.I), "h100-nvl"),
    (re.compile(r"H100.*PCIE", re.I), "h100-pcie"),
    (re.compile(r"H100|H800", re.I), "h100-sxm"),
    (re.compile(r"B200|GB200", re.I), "b200"),
    (re.compile(r"MI325", re.I), "mi325x"),
    (re.compile(r"MI300", re.I), "mi300x"),
    (re.compile(r"MI250X", re.I), lambda gb: "mi250x" if gb and gb > 100 else "mi250x-gcd"),
    (re.compile(r"MI250", re.I), "mi250-gcd"),
    (re.compile(r"MI210", re.I), "mi210"),
]

# The host link of each device, one direction, in bytes/s: the PCIe generation's x16 rate
# (3.0: 15.75, 4.0: 31.5, 5.0: 63 GB/s), or NVLink-C2C on Grace Hopper (450 GB/s each way).
# A copy from pinned host memory reaches most of it; one from pageable memory is staged
# through a driver buffer by the CPU and reaches far less.
_PCIE = {3: 15.75 * GB, 4: 31.5 * GB, 5: 63 * GB}
HOST_LINK_BW: dict[str, float] = {
    **{k: _PCIE[3] for k in ("v100-sxm2", "v100-pcie", "v100s", "t4")},
    **{k: _PCIE[4] for k in ("a100-40gb", "a100-80gb", "a100-pcie-80gb", "a10", "l4", "l40s", "mi210",
                             "mi250-gcd", "mi250x-gcd", "mi250x")},
    **{k: _PCIE[5] for k in ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "mi300x", "mi325x")},
    "gh200": 450 * GB,
}

# AMD devices by compute units when the name is generic ("AMD Radeon Graphics").
_AMD_BY_CUS = {104: "mi250-gcd", 110: "mi250x-gcd", 220: "mi250x", 304: "mi300x"}


def lookup(props: dict | None) -> Device | None:
    """The peaks of a trace's deviceProperties entry, or None when the device is unknown."""
    if not props:
        return None
    name = str(props.get("name", ""))
    mem = props.get("totalGlobalMem")
    gb = float(mem) / 2**30 if mem else None
    for rx, key in _NAME_RULES:
        if rx.search(name):
            k = key(gb) if callable(key) else key
            return _with_mem(PEAKS[k], mem)
    cus = props.get("numSms") or props.get("multiProcessorCount")
    if props.get("warpSize") == 64 and cus in _AMD_BY_CUS:
        k = _AMD_BY_CUS[cus]
        if k == "mi300x" and gb and gb > 200:
            k = "mi325x"
        return _with_mem(PEAKS[k], mem)
    return None


def _with_mem(dev: Device, mem) -> Device:
    if not mem:
        return dev
    return Device(dev.key, dev.name, dev.flops, dev.mem_bw, float(mem))


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diag" / "cpu_peaks.json"


def cpu_device(path: str | os.PathLike | None = None) -> Device | None:
    """The host CPU's calibrated peaks from a `diag calibrate` file (default: this user's
    cache), or None when not calibrated. Only the agent and `diag plan` look in the cache;
    an analysis takes calibration as an explicit input (`host_device`)."""
    p = Path(path) if path else cache_path()
    try:
        return host_device(json.loads(p.read_text()))
    except (OSError, ValueError):
        return None


def host_device(doc) -> Device | None:
    """The CPU device a calibration document (`diag calibrate`'s file, or the copy the agent
    records in rank.json as "host_peaks") describes, or None when it is not one."""
    try:
        flops = {str(k): float(v) for k, v in doc["flops"].items() if v}
        bw = float(doc["mem_bw"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not flops or not all(math.isfinite(v) and v > 0 for v in flops.values()) or not (math.isfinite(bw) and bw > 0):
        return None
    mem = doc.get("mem_bytes")
    return Device("cpu", str(doc.get("cpu", "CPU")), flops, bw,
                  float(mem) if isinstance(mem, (int, float)) and not isinstance(mem, bool) and mem > 0 else None)
