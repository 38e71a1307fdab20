"""Which physical GPU is this rank's device? Logical index -> physical index or UUID.

A rank sees its devices through the runtime's visibility variables, so logical device 0
may be physical GPU 3. The management libraries (NVML, amdsmi) always see every GPU on
the node, so the sampler must translate before it asks them anything.

- CUDA: ``CUDA_VISIBLE_DEVICES`` is a comma list of indices, ``GPU-<uuid>`` or
  ``MIG-<uuid>`` entries (unique UUID prefixes are accepted). The runtime stops at the
  first entry it cannot parse, so do we. An empty value hides every device.
- ROCm: ``ROCR_VISIBLE_DEVICES`` (indices or ``GPU-<id>`` UUIDs) is applied first by
  the ROCr runtime; ``HIP_VISIBLE_DEVICES`` (or, when unset, ``CUDA_VISIBLE_DEVICES``,
  which HIP honours too) then indexes into what ROCr left visible.

When torch has already initialised CUDA, the device's UUID from torch is the most
reliable answer (it also covers ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` on mixed nodes,
where CUDA and NVML enumerate in different orders); the sampler prefers it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

# Accepted forms of one visibility entry: a decimal index or a UUID with its prefix.
_INDEX = re.compile(r"^\d+$")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z\-/]*$", re.IGNORECASE)


@dataclass(frozen=True)
class DeviceRef:
    """One physical device: by index in the management library's order, or by UUID (prefix)."""

    index: int | None = None
    uuid: str | None = None
    source: str = "default"  # which variable decided: CUDA_VISIBLE_DEVICES, torch, default, ...

    @property
    def is_mig(self) -> bool:
        return self.uuid is not None and self.uuid.upper().startswith("MIG-")

    def describe(self) -> str:
        what = f"uuid {self.uuid}" if self.uuid else f"index {self.index}"
        return f"{what} (from {self.source})"


def parse_visible(spec: str | None) -> list[str] | None:
    """Entries of a visibility variable; None when unset (everything visible).

    The CUDA runtime ignores entries from the first invalid one on ('0,1,-1,2' -> 0,1),
    and so does ROCr; whitespace around entries is tolerated.
    """
    if spec is None:
        return None
    out: list[str] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if _INDEX.match(entry) or _UUID.match(entry):
            out.append(entry)
        else:
            break
    return out


def _entry_ref(entry: str, source: str) -> DeviceRef:
    if _INDEX.match(entry):
        return DeviceRef(index=int(entry), source=source)
    return DeviceRef(uuid=entry, source=source)


def resolve_nvidia(logical: int | None, env: Mapping[str, str]) -> DeviceRef | None:
    """Physical NVIDIA device of logical index ``logical``; None when it is not visible."""
    logical = 0 if logical is None else int(logical)
    visible = parse_visible(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        return DeviceRef(index=logical, source="default")
    if not 0 <= logical < len(visible):
        return None
    return _entry_ref(visible[logical], "CUDA_VISIBLE_DEVICES")


def resolve_amd(logical: int | None, env: Mapping[str, str]) -> DeviceRef | None:
    """Physical AMD device of logical index ``logical``; None when it is not visible.

    ROCr's list selects from all GPUs; HIP's list indexes into ROCr's result.
    """
    logical = 0 if logical is None else int(logical)
    rocr = parse_visible(env.get("ROCR_VISIBLE_DEVICES"))
    hip_name = "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in env else "CUDA_VISIBLE_DEVICES"
    hip = parse_visible(env.get(hip_name))

    position = logical
    source = "default"
    if hip is not None:
        if not 0 <= logical < len(hip):
            return None
        entry = hip[logical]
        if not _INDEX.match(entry):
            return DeviceRef(uuid=entry, source=hip_name)
        position, source = int(entry), hip_name
    if rocr is None:
        return DeviceRef(index=position, source=source)
    if not 0 <= position < len(rocr):
        return None
    return _entry_ref(rocr[position], "ROCR_VISIBLE_DEVICES" if source == "default" else f"{source}+ROCR_VISIBLE_DEVICES")


def uuid_matches(wanted: str, actual: str | None) -> bool:
    """CUDA accepts any unique prefix of a UUID; compare case-insensitively, with or without 'GPU-'."""
    if not actual:
        return False
    w, a = wanted.strip().lower(), actual.strip().lower()
    if a.startswith(w):
        return True
    for prefix in ("gpu-", "mig-"):
        w2 = w[len(prefix):] if w.startswith(prefix) else w
        a2 = a[len(prefix):] if a.startswith(prefix) else a
        if w2 and a2.startswith(w2):
            return True
    return False


def torch_cuda_uuid(logical: int | None) -> str | None:
    """'GPU-<uuid>' of the logical device from torch, only if torch already initialised CUDA.

    Never imports torch or initialises CUDA: that would cost seconds and device memory
    in a process that may not want it. ROCm builds give none (their UUID format differs).
    """
    identity = torch_device_identity(logical)
    return identity.uuid if identity is not None else None


@dataclass(frozen=True)
class DeviceIdentity:
    """The device the training thread actually uses, as its runtime names it: known only once
    torch has initialised CUDA or ROCm, and then better than any visibility variable."""

    uuid: str | None = None  # CUDA: "GPU-..." (a MIG instance's UUID under MIG); None on ROCm
    pci_bus_id: str | None = None  # "0000:c1:00.0"
    runtime: str = "cuda"  # or "rocm"

    def describe(self) -> str:
        return " ".join(f"{k} {v}" for k, v in (("uuid", self.uuid), ("pci", self.pci_bus_id)) if v) or "unknown"


def torch_device_identity(logical: int | None = None) -> DeviceIdentity | None:
    """The identity of torch's device `logical`, by default its current one on the calling
    thread (the training thread's current device is the rank's); None until torch has
    initialised one."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if logical is None else int(logical))
    except Exception:
        return None
    rocm = bool(getattr(torch.version, "hip", None))
    pci = None
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int) and bus >= 0:
        domain = getattr(props, "pci_domain_id", 0) or 0
        pci = f"{domain:04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0) or 0:02x}.0"
    uuid = None
    if not rocm:
        text = str(getattr(props, "uuid", "") or "")
        if text:
            uuid = text if text.upper().startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    if uuid is None and pci is None:
        return None
    return DeviceIdentity(uuid=uuid, pci_bus_id=pci, runtime="rocm" if rocm else "cuda")


_PCI = re.compile(r"^\s*(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?\s*$")


def pci_key(text) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI address in any of the libraries' spellings: NVML's
    "00000000:C1:00.0", amdsmi's "0000:c1:00.0", lspci's "c1:00.0"."""
    m = _PCI.match(text) if isinstance(text, str) else None
    if m is None:
        return None
    return int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16)


def pci_matches(a, b) -> bool:
    ka, kb = pci_key(a), pci_key(b)
    return ka is not None and ka == kb
