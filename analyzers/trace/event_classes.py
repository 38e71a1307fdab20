"""What each trace event is: communication, memory copy/set, compute-bound or bandwidth-bound work.

Names change across CUDA, NCCL, ROCm and PyTorch versions, so the rules are regular
expressions over every generation seen in the wild:
- NCCL kernels: `ncclKernel_*` (NCCL <= 2.18), `ncclDevKernel_*` and `ncclDevKernel_Generic`
  (NCCL >= 2.19), RCCL (same names, sometimes with a `void ` prefix), MSCCL
  (`mscclKernel_*`);
- host-side collectives: `c10d::*`, `gloo:*`, `nccl:*` annotations, `record_param_comms`;
- compute-bound kernels: GEMM (cuBLAS/cuBLASLt/CUTLASS `*gemm*`, Hopper `nvjet_*`,
  Tensile `Cijk_*`, hipBLASLt, Triton templates), convolution (cuDNN/MIOpen, implicit GEMM,
  Winograd, FFT, cuDNN's `*scudnn*` implicit-GEMM kernels) and attention (flash, fmha, memory-efficient attention);
- every other kernel is bandwidth-bound (elementwise, reductions, norms, copies, softmax).
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

# Device-side classes (also used as the integer codes of per-kernel class arrays).
COMM, MEMCPY, COMPUTE, BANDWIDTH, OTHER = 0, 1, 2, 3, 4
CLASS_NAMES = {COMM: "comm", MEMCPY: "memcpy", COMPUTE: "compute", BANDWIDTH: "memory", OTHER: "other"}

COMM_KERNEL_RE = re.compile(r"^(?:void\s+)?(?:nccl|rccl|msccl)\w*(?:Kernel|_)", re.IGNORECASE)
MEMORY_OP_RE = re.compile(r"^(?:Memcpy|Memset|dma|\[?memcpy|\[?memset)", re.IGNORECASE)
COMPUTE_KERNEL_RE = re.compile(
    r"(?<!fb)gemm|gemv_?batched|cutlass|cublas|xmma|nvjet|Cijk_|hipblaslt|Tensile|wmma|mma_|"
    r"triton_(?:tem|mm|bmm)|conv|winograd|wgrad|dgrad|fprop|implicit_|fft|"
    r"flash|fmha|attention|attn|sdpa|mha_|matmul|ck::|dot_kernel|"
    # cuDNN's implicit-GEMM convolutions (volta_scudnn_128x64_relu_interior_nn_v1,
    # turing_fp16_s1688cudnn_fp16_...) and tile-shaped GEMM names (_128x64_).
    r"[sh]cudnn|s\d{3,5}cudnn|_\d+x\d+_",
    re.IGNORECASE,
)
# Device-side synchronisation records (cuda_sync category and HTA's "Sync" kernels).
SYNC_RE = re.compile(r"Sync$|^(?:Stream|Event|Context) (?:Sync|Wait)", re.IGNORECASE)

HOST_COMM_RE = re.compile(r"^(?:c10d::|gloo:|nccl:|record_param_comms$|ProcessGroup)", re.IGNORECASE)
DATA_RE = re.compile(r"enumerate\(DataLoader\)|_DataLoaderIter\.__next__|DataLoader", re.IGNORECASE)
HOST_SYNC_RE = re.compile(
    r"^(?:aten::item|aten::_local_scalar_dense|aten::is_nonzero|"
    r"cuda(?:Stream|Device|Event)Synchronize|hip(?:Stream|Device|Event)Synchronize|"
    r"cudaMemcpy$|hipMemcpy$|cudaStreamWaitEvent)"
)
# CPU ops that run compute-bound kernels (CPU-only traces attribute these to compute).
CPU_COMPUTE_RE = re.compile(
    r"^aten::(?:mm|addmm|_addmm_activation|bmm|baddbmm|addbmm|matmul|linear|einsum|"
    r"conv\w*|_convolution\w*|convolution\w*|cudnn_convolution\w*|mkldnn_convolution\w*|"
    r"miopen_convolution\w*|_nnpack\w*|slow_conv\w*|thnn_conv\w*|mkldnn_linear|mkldnn_matmul|"
    r"scaled_dot_product_attention|_scaled_dot_product\w*|_flash_attention\w*|"
    r"_efficient_attention\w*|tensordot|chain_matmul|multi_dot|_int_mm|_scaled_mm)$"
)
# Ops that only touch metadata (no data movement); they are host overhead.
CPU_META_RE = re.compile(
    r"^aten::(?:view|_unsafe_view|reshape|as_strided|t|transpose|permute|expand|expand_as|detach|"
    r"detach_|squeeze|unsqueeze|select|slice|narrow|alias|empty|empty_like|empty_strided|"
    r"resize_|set_|lift_fresh|numpy_T|unbind|split|chunk|size|stride|is_same_size|_reshape_alias|"
    r"view_as|flatten|unflatten|contiguous|result_type|_has_compatible_shallow_copy_type|"
    r"record_stream|to|_to_copy_meta)$"
)


def device_classes(names: list[str], name_ids: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """Class code per device event (kind from trace_load: 0 kernel, 1 memcpy, 2 memset, 3 sync)."""
    per_name = np.array([kernel_class(n) for n in names], dtype=np.int8) if names else np.zeros(0, np.int8)
    out = per_name[name_ids] if len(name_ids) else np.zeros(0, np.int8)
    out = np.where((kinds == 1) | (kinds == 2), MEMCPY, out)
    out = np.where(kinds == 3, OTHER, out)
    return out.astype(np.int8)


def kernel_class(name: str) -> int:
    if COMM_KERNEL_RE.match(name):
        return COMM
    if MEMORY_OP_RE.match(name):
        return MEMCPY
    if SYNC_RE.search(name):
        return OTHER
    # Only the kernel's own name and template arguments: parameter types such as
    # at::GenericPackedTensorAccessor or fbgemm_gpu::... say nothing about the work.
    if COMPUTE_KERNEL_RE.search(strip_parameters(name)):
        return COMPUTE
    return BANDWIDTH


def strip_parameters(name: str) -> str:
    """A demangled name without its trailing parameter list: `void f<T>(int, float)` -> `void f<T>`."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        c = name[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                return name[:i]
    return name


def is_comm_kernel(name: str) -> bool:
    return bool(COMM_KERNEL_RE.match(name))


# CPU-op classes for CPU-only traces (the host timeline is the execution timeline).
CPU_COMPUTE, CPU_MEMORY, CPU_COMM, CPU_DATA, CPU_HOST = "compute", "memory", "comm", "data", "host"


def cpu_op_class(name: str) -> str:
    """Class of a leaf CPU op when the CPU itself executes the model."""
    if HOST_COMM_RE.match(name):
        return CPU_COMM
    if DATA_RE.search(name):
        return CPU_DATA
    if HOST_SYNC_RE.match(name):
        return CPU_HOST
    if CPU_COMPUTE_RE.match(name):
        return CPU_COMPUTE
    if name.startswith("aten::") and not CPU_META_RE.match(name):
        # Elementwise, reductions, norms, copies, fills, indexing, optimizer foreach ops.
        return CPU_MEMORY
    return CPU_HOST


def is_host_comm(name: str) -> bool:
    return bool(HOST_COMM_RE.match(name))


def is_data_annotation(name: str) -> bool:
    return bool(DATA_RE.search(name))


def is_host_sync(name: str) -> bool:
    return bool(HOST_SYNC_RE.match(name))


# Collective names: kernel fragments and c10d / gloo / record_param_comms names -> contract B names.
_COLL_WORDS = [
    ("reduce_scatter", r"reduce_?scatter|reducescatter"),
    ("all_gather", r"all_?gather|allgather"),
    ("all_reduce", r"all_?reduce|allreduce"),
    ("all_to_all", r"all_?to_?all|alltoall|sendrecv_?all"),
    ("broadcast", r"broadcast|bcast"),
    # NCCL's SendRecv kernel serves send/recv and all_to_all alike; the host side names which.
    ("send_recv", r"sendrecv"),
    ("barrier", r"barrier"),
    ("reduce", r"reduce"),
    ("send", r"send"),
    ("recv", r"recv|receive"),
    ("gather", r"gather"),
    ("scatter", r"scatter"),
]
_COLL_RES = [(n, re.compile(p, re.IGNORECASE)) for n, p in _COLL_WORDS]


@lru_cache(maxsize=4096)  # a trace repeats a handful of collective names thousands of times
def collective_name(text: str | None) -> str | None:
    if not text:
        return None
    for name, rx in _COLL_RES:
        if rx.search(text):
            return name
    return None
