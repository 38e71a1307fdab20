"""The sizes of an nccl-tests sweep, the element counts of each collective at a size (nccl-tests'
`getCollByteCount`), its bus-bandwidth factor, and the largest size every rank's memory holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv")
# nccl-tests' type names, in its order, and common aliases.
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16")
DTYPE_ALIASES = {
    "char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float",
    "fp32": "float", "float64": "double", "fp64": "double", "bf16": "bfloat16",
}
REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
ROOTED = {"broadcast", "reduce"}
SLICED = {"all_gather", "reduce_scatter", "alltoall"}
# Test-suite only: emulate a device (or, on CPUs, a host share) with this many bytes free.
MEMORY_ENV = "DIAG_NCCL_TEST_MEMORY"
GIB = 1 << 30

def parse_size(text: str | int) -> int:
    """nccl-tests' size syntax: a number with an optional K, M or G suffix (powers of 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgG]?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional K, M or G suffix")
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * unit)


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: int = 2, step_bytes: int = 0) -> list[int]:
    """The sizes nccl-tests visits: multiply by the factor when it is above 1, else add step_bytes."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"invalid sizes: minBytes {min_bytes} > maxBytes {max_bytes}")
    if step_factor <= 1 and step_bytes <= 0:
        raise ValueError("the step must be a factor above 1 (-f) or a positive increment (-i)")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        nxt = size * step_factor if step_factor > 1 else size + step_bytes
        if nxt == size:  # -b 0 with a factor: nccl-tests would loop forever; stop after one row
            break
        size = nxt
    return sizes


def warmup_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """The sizes nccl-tests warms up (since its 2025 releases): every size from min to max by a factor of 2,
    whatever the measured step."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = size * 2 if size else 1
    return sizes


def memory_limit(total_bytes: int, free_bytes: int, check: bool) -> int:
    """The largest message nccl-tests lets a rank allocate: 1 GiB kept back per 16 GiB installed
    (at most 4 GiB) plus 1 GiB for the library, the rest split over the send, receive and, when
    results are checked, expected buffers. nccl-tests starts from the installed memory; a torch
    process may hold some already, so the free memory bounds it too."""
    reserve = min(-(-total_bytes // (16 * GIB)) * GIB, 4 * GIB)
    usable = min(total_bytes - reserve, free_bytes) - GIB
    return max(usable // (3 if check else 2), 0)


def memory_of(device, local_ranks: int) -> tuple[int, int]:
    """(total, free) bytes this rank may use: its device's, or its share of the host's on CPUs."""
    emulated = os.environ.get(MEMORY_ENV, "").strip()
    if emulated:
        size = parse_size(emulated)
        return size, size
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    import psutil

    mem = psutil.virtual_memory()
    share = max(local_ranks, 1)
    return int(mem.total) // share, int(mem.available) // share


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw ratio."""
    if collective == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in SLICED:
        return (nranks - 1) / nranks
    return 1.0


@dataclass(frozen=True)
class Counts:
    """Element counts of one call, as nccl-tests' getCollByteCount computes them."""

    param: int  # the count passed to the collective (the table's count column)
    send: int
    recv: int
    send_inplace_offset: int  # in-place slices start at offset * rank inside the receive buffer
    recv_inplace_offset: int

    def table_bytes(self, elt: int) -> int:
        return max(self.send, self.recv) * elt


def coll_counts(collective: str, size_bytes: int, elt: int, nranks: int) -> Counts:
    count = size_bytes // elt
    if collective in SLICED:
        base = (count // nranks) & -(16 // elt) if elt <= 16 else count // nranks
        if collective == "all_gather":
            return Counts(base, base, base * nranks, base, 0)
        if collective == "reduce_scatter":
            return Counts(base, base * nranks, base, 0, base)
        return Counts(base, base * nranks, base * nranks, 0, 0)
    return Counts(count, count, count, 0, 0)


def bandwidths(collective: str, counts: Counts, elt: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes per second), as nccl-tests' getBw."""
    if seconds <= 0:
        return 0.0, 0.0
    nbytes = counts.param * elt * (nranks if collective in SLICED else 1)
    alg = nbytes / 1.0e9 / seconds
    return alg, alg * bus_factor(collective, nranks)


def normalize_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPES:
        raise ValueError(f"unknown data type {name!r}: choose from {', '.join(DTYPES)} or all")
    return key


def normalize_collective(name: str) -> str:
    key = name.lower().replace("-", "_").removesuffix("_perf")
    key = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "all_to_all": "alltoall", "all_to_all_single": "alltoall", "send_recv": "sendrecv"}.get(key, key)
    if key not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: choose from {', '.join(COLLECTIVES)} or all")
    return key
