"""What each trace event is: communication, memory copy/set, compute-bound or bandwidth-bound work.

Names change across CUDA, NCCL, ROCm and PyTorch versions, so the rules are regular
expressions over every generation seen in the wild:
- communication kernels: every family of `COMM_FAMILIES` below (NCCL/RCCL/MSCCL/NCCLX,
  expert-parallel dispatch/combine, NVSHMEM, PyTorch symmetric memory, the custom all-reduce
  kernels of vLLM, SGLang, AIter, TensorRT-LLM and FlashInfer, MSCCL++, Userbuffers, oneCCL);
  each family maps its kernels to collective kinds where the name tells;
- host-side collectives: `c10d::*`, `gloo:*`, `nccl:*` annotations, `record_param_comms`;
- compute-bound kernels: GEMM (cuBLAS/cuBLASLt/CUTLASS `*gemm*`, Hopper `nvjet_*`,
  Tensile `Cijk_*`, hipBLASLt, Triton templates), convolution (cuDNN/MIOpen, implicit GEMM,
  Winograd, FFT, cuDNN's `*scudnn*` implicit-GEMM kernels) and attention (flash, fmha, memory-efficient attention);
- every other kernel is bandwidth-bound (elementwise, reductions, norms, copies, softmax).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# Device-side classes (also used as the integer codes of per-kernel class arrays).
COMM, MEMCPY, COMPUTE, BANDWIDTH, OTHER = 0, 1, 2, 3, 4
CLASS_NAMES = {COMM: "comm", MEMCPY: "memcpy", COMPUTE: "compute", BANDWIDTH: "memory", OTHER: "other"}


@dataclass(frozen=True)
class CommFamily:
    """A family of communication kernels, recognised by a regular expression over their names.

    `on` says what the pattern reads: "name" is the whole demangled name (parameter types
    included), "function" is the qualified function name alone (`ns::f` of `void ns::f<T>(A)`),
    so that template arguments and parameter types cannot make a kernel communication.
    `kind` is the collective every kernel of the family performs; `kinds` refines it by the
    function's own name (first match wins); with neither, the name's words decide
    (`collective_name`).
    """

    name: str
    pattern: str
    on: str
    kind: str | None
    kinds: tuple[tuple[str, str], ...]
    source: str
    example: str


# The communication word as a name part: after a non-letter, or at a lower-to-upper camel-case
# step, so `moeAllToAllKernel` and `allgather_naive` count but `small_gather` does not.
_COMM_WORD = r"(?:(?<![A-Za-z])|(?<=[a-z0-9])(?=[A-Z]))(?i:all_?reduce|all_?gather|reduce_?scatter|all_?to_?all)"

COMM_FAMILIES: tuple[CommFamily, ...] = (
    CommFamily(
        "nccl", r"^(?i:(?:void\s+)?(?:nccl|rccl|msccl)\w*(?:Kernel|_))", "name", None, (),
        "NCCL <= 2.18 ncclKernel_*, >= 2.19 ncclDevKernel_* (Generic, symmetric ncclSymk*), RCCL, "
        "MSCCL mscclKernel_*, Meta NCCLX/CTran ncclKernel*Ctran*",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
    CommFamily(
        # deep_ep::{intranode,internode,internode_ll,elastic}, DeepSeek's own dpsk::ep, and forks
        # (primus_turbo::deep_ep). get_dispatch_layout and the *_epilogue kernels are local work.
        "deepep",
        r"(?:^|::)(?:deep_ep|ep)::(?:\w+::)*(?:(?:cached_)?notify_(?:dispatch|combine)|cached_notify"
        r"|(?:hybrid_)?(?:dispatch|combine)(?!\w*epilogue)\w*|barrier(?:_impl)?|pp_(?:send|recv)_impl)$",
        "function", "all_to_all", (("^barrier", "barrier"), ("^pp_send", "send"), ("^pp_recv", "recv")),
        "DeepEP csrc/kernels/legacy/{intranode,internode,internode_ll}.cu, deep_ep/include/deep_ep/impls; "
        "deepseek-ai/profile-data train.json (dpsk::ep)",
        "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, ...)"),
    CommFamily(
        # pplx-kernels defines its kernels in an anonymous namespace, with these exact names.
        "pplx", r"^\(anonymous namespace\)::(?:dispatch|combine)Kernel$", "function", "all_to_all", (),
        "ppl-ai/pplx-kernels csrc/all_to_all/{intranode,internode}_{dispatch,combine}.cu",
        "void (anonymous namespace)::dispatchKernel<4u, true, true>(int*, unsigned long, std::byte*, ...)"),
    CommFamily(
        "mori", r"^mori::(?:moe::Ep(?:Dispatch|Combine)\w*|collective::\w+Kernel|shmem::\w*[Bb]arrier\w*)$",
        "function", None, (("^Ep(?:Dispatch|Combine)", "all_to_all"), ("[Bb]arrier", "barrier")),
        "ROCm/mori src/ops/dispatch_combine, include/mori/collective",
        "void mori::moe::EpDispatchInterNodeKernel<__hip_bfloat16>(mori::moe::EpDispatchCombineArgs<...>)"),
    CommFamily(
        "moe_alltoall", r"(?:^|::)(?:moeA2A\w*Kernel|moeAllToAllKernel)$", "function", "all_to_all", (),
        "TensorRT-LLM kernels/communicationKernels/moeAlltoAllKernels.cu, FlashInfer comm/trtllm_alltoall.cuh",
        "void tensorrt_llm::kernels::moe_comm::moeA2ADispatchKernel<...BlockPolicy, 8, false>(int const*, ...)"),
    CommFamily(
        # Host-launched NVSHMEM work; the one-time heap and team set-up kernels are local.
        "nvshmem",
        r"^nvshmemi?x?_(?!init_array_kernel$|team_mapping_kernel$|team_index_kernel$)\w+$"
        r"|^(?:barrier|sync|rdxn|reducescatter|fcollect|broadcast|alltoall)_on_stream_kernel\w*$",
        "function", None, (("^rdxn", "all_reduce"), ("^fcollect", "all_gather"), ("^sync_on_stream", "barrier")),
        "NVIDIA/nvshmem src/include/internal/non_abi/nvshmemi_h_to_d_coll_defs.cuh",
        "barrier_on_stream_kernel_threadgroup(int, int)"),
    CommFamily(
        # PyTorch symmetric memory (CUDASymmetricMemory*.cu: anonymous namespace or
        # c10d::symmetric_memory), its NVSHMEM extension and the older IntraNodeComm.
        "c10d_symm_mem",
        r"^c10d::(?:symmetric_memory|nvshmem_extension|intra_node_comm)::\w+$"
        r"|(?:^|::)(?:multimem_(?:one_shot_)?all_reduce|multimem_all_gather|one_shot_all_reduce"
        r"|two_shot_all_reduce|multimem_barrier)_kernel(?:_inplace)?$",
        "function", None, (),
        "pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory{,Ops}.cu",
        "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, ...)"),
    CommFamily(
        # MSCCL++ kernels live in mscclpp:: or take its channel handles as parameters
        # (SGLang's allreduce_1shotLL_1node(mscclpp::MemoryChannelDeviceHandle*, ...)).
        "mscclpp", r"(?<!\w)mscclpp::", "name", None, (),
        "microsoft/mscclpp src/ext/collectives, sglang sgl-kernel/csrc/allreduce/mscclpp_allreduce.cuh",
        "void mscclpp::collective::allreduceAllPairs<...>(float*, float*, float*, "
        "mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, ...)"),
    CommFamily(
        # IPC all-reduce of vLLM (also ROCm quick-reduce), SGLang, AIter and FlashInfer's vLLM port;
        # cross_device_reduce_* are all-reduces though their name only says "reduce".
        "custom_allreduce",
        r"(?:^|::)cross_device_reduce_\w+$|^(?:vllm|sglang|aiter|quickreduce)::(?:\w+::)*\w*?" + _COMM_WORD + r"\w*$",
        "function", None, (("^cross_device_reduce", "all_reduce"),),
        "vllm csrc/custom_all_reduce.cuh, csrc/quickreduce; sglang sgl-kernel/csrc/allreduce; "
        "ROCm/aiter csrc/include/custom_all_reduce.cuh",
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, ...)"),
    CommFamily(
        # TensorRT-LLM's custom, Lamport, fused and MNNVL all-reduces and FlashInfer's ports of them.
        "trtllm_allreduce",
        r"(?:^|::)(?:[Oo]ne|[Tt]wo)Shot(?i:all_?reduce)\w*Kernel$|^(?:tensorrt_llm|flashinfer)::(?:\w+::)*\w*?"
        + _COMM_WORD + r"\w*$",
        "function", None, (),
        "TensorRT-LLM cpp/tensorrt_llm/kernels/customAllReduceKernels.cu, kernels/communicationKernels; "
        "FlashInfer include/flashinfer/comm/trtllm_*.cuh",
        "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<...>(...)"),
    CommFamily(
        # Userbuffers of TransformerEngine / Megatron (comm+GEMM overlap).
        "userbuffers", r"^k?userbuffers_\w+$", "function", None,
        (("_rs(?:_|$)", "reduce_scatter"), ("_ag(?:_|$)", "all_gather"), ("pushsendrecv", "send_recv"),
         ("(?:pull|push)send", "send"), ("(?:pull|push)recv", "recv"), ("sum_inplace", "all_reduce")),
        "NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu",
        "void userbuffers_fp16_sum_inplace_gpu_rr_rs<8>(int, int, int, int, int, int, int, void**, int, "
        "unsigned long)"),
    CommFamily(
        "oneccl", r"^oneccl_\w+$", "function", None, (),
        "Intel oneCCL on XPU, seen in Kineto traces (intel/torch-xpu-ops#5384)",
        "oneccl_reduce_base<float, 2, 16, 1, 1, 2>"),
)
# In table order: the first family that matches wins (a leftmost-match alternation would let
# `^flashinfer::` beat `::moeAllToAllKernel$`).
_FAMILY_RES = tuple((f, re.compile(f.pattern)) for f in COMM_FAMILIES)
# A GEMM fused with a collective (GEMM + reduce-scatter/all-reduce in one kernel) spends its time
# in the GEMM: it stays compute even when a library's communication namespace holds it.
FUSED_COMPUTE_RE = re.compile(r"(?i:gemm|matmul)")
_KINDS = {f.name: tuple((re.compile(p), k) for p, k in f.kinds) for f in COMM_FAMILIES}

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
    if comm_family(name) is not None:
        return COMM
    if MEMORY_OP_RE.match(name):
        return MEMCPY
    if SYNC_RE.search(name):
        return OTHER
    # Only the kernel's own name and template arguments: parameter types such as
    # at::GenericPackedTensorAccessor or fbgemm_gpu::... say nothing about the work, nor does
    # a return type (vLLM's `std::enable_if<...vllm::_typeConvert<T>::exists, void>::type`).
    if COMPUTE_KERNEL_RE.search(drop_return_type(strip_parameters(name))):
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


def drop_return_type(s: str) -> str:
    """`std::enable_if<(8)>(0), void>::type ns::f<T>` -> `ns::f<T>`: what follows the last space
    outside template arguments and parentheses (the whole name when there is none)."""
    s = s.strip()
    paren = angle = 0
    for i in range(len(s) - 1, -1, -1):
        c = s[i]
        if c == ")":
            paren += 1
        elif c == "(":
            paren -= 1
        elif not paren:
            if c == ">":
                angle += 1
            elif c == "<":
                angle -= 1
            elif c == " " and not angle:
                return s[i + 1:]
    return s


def function_name(name: str) -> str:
    """The qualified function of a demangled kernel name, without return type, template
    arguments or parameters: `void ns::f<T, (E)1>(A*, B)` -> `ns::f`."""
    # Nsight Systems writes `<unnamed>` where CUPTI writes `(anonymous namespace)`.
    s = drop_return_type(strip_parameters(name).replace("<unnamed>", "(anonymous namespace)"))
    out = []
    angle = paren = 0
    for c in s:
        if angle:
            # Inside template arguments: a `>` within parentheses (`(8)>(0)`) closes nothing.
            if c == "(":
                paren += 1
            elif c == ")":
                paren -= 1
            elif not paren:
                angle += (c == "<") - (c == ">")
            continue
        if c == "<":
            angle = 1
            paren = 0
            continue
        out.append(c)
    return "".join(out)


@lru_cache(maxsize=8192)  # per distinct kernel name; traces repeat a few hundred names
def comm_family(name: str) -> CommFamily | None:
    """The communication family a kernel belongs to, or None for local work."""
    fn = function_name(name)
    for family, rx in _FAMILY_RES:
        if rx.search(name if family.on == "name" else fn):
            if family.name != "nccl" and FUSED_COMPUTE_RE.search(fn.rsplit("::", 1)[-1]):
                return None
            return family
    return None


def is_comm_kernel(name: str) -> bool:
    return comm_family(name) is not None


def kernel_collective(name: str) -> str | None:
    """The collective kind a communication kernel's family states (all_reduce for the custom
    all-reduce kernels, all_to_all for expert-parallel dispatch/combine, ...); None when the
    kernel is not communication or its family leaves the kind to the name's words."""
    family = comm_family(name)
    if family is None:
        return None
    own = function_name(name).rsplit("::", 1)[-1]
    for rx, kind in _KINDS[family.name]:
        if rx.search(own):
            return kind
    return family.kind


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


def is_data_annotation(name: str) -> bool:
    return bool(DATA_RE.search(name))


# Collective names: kernel fragments and c10d / gloo / record_param_comms names -> the collective names of collective records.
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
    """The collective name (as collective records give it) of a kernel name, host op name or collective argument."""
    if not text:
        return None
    kind = kernel_collective(text)
    if kind is not None:
        return kind
    if comm_family(text) is not None:
        # Template arguments and parameter types name no collective; the function does.
        text = function_name(text)
    for name, rx in _COLL_RES:
        if rx.search(text):
            return name
    return None
