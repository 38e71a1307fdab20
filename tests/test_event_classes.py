"""Event classes across naming generations: every communication family (NCCL/RCCL/MSCCL, expert-parallel
dispatch/combine, NVSHMEM, symmetric memory, custom all-reduces, MSCCL++, Userbuffers, oneCCL), memcpy,
GEMM/conv/attention, CPU ops."""

from __future__ import annotations

import numpy as np
import pytest

from diag.analyzers.trace import event_classes as ec

COMM_KERNELS = [
    "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",  # NCCL <= 2.18
    "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",  # NCCL >= 2.19
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
    "ncclDevKernel_Generic_4(ncclDevComm*, unsigned long, ncclWork*)",
    "void ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",  # RCCL demangled
    "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t",  # RCCL without parameters
    "mscclKernel_Sum_float_Simple_false(ncclDevComm*, mscclAlgo*, mscclWork*)",
]
COMPUTE_KERNELS = [
    "volta_sgemm_128x64_nn",
    "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN",
    "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_16x3_nn_align4>(Params)",
    "Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT16x16x8_MI16x16x1_SN_LDSB0",  # Tensile (rocBLAS)
    "volta_scudnn_128x64_relu_interior_nn_v1",
    "void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int, int, float const*)",
    "void cudnn::cnn::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int)",
    "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16",
    "void fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass::half_t>>(Flash_fwd_params)",
    "triton_tem_fused_mm_0",
]
BANDWIDTH_KERNELS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
    "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 128, true, 1>(float, float, float)",
    "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::MeanOps<float, float> > >(at::native::ReduceOp<float>)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*, float const*, int)",
    "triton_poi_fused_add_mul_0",
    # Argument types that mention GEMM libraries do not make an embedding kernel compute-bound.
    "void split_embedding_codegen_forward_unweighted_kernel<c10::Half, float>(at::GenericPackedTensorAccessor<fbgemm_gpu::gemm_t>)",
    "void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, int*)",
]
MEMCPY = ["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD (Device -> Device)", "Memset (Device)", "dma_copy"]


# Communication kernels of every family in ec.COMM_FAMILIES, as real kernels are named:
# (family, demangled name, collective kind, where the name comes from). "profile" names were
# copied from a real Kineto/nsys profile; "source" names are the demangled form of the kernel
# as the library defines it (long parameter lists are cut with "..."; the classification
# never reads parameters except for MSCCL++ channel handles).
TL = "AMD-AGI/TraceLens tests/traces/b200/eager_trace.json.gz @171dd74 (profile, vLLM TP8 on B200)"
DS = "deepseek-ai/profile-data train.json @4496024 (profile, DeepSeek-V3 EP64 on H800)"
FAMILY_KERNELS = [
    ("nccl", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather", TL),
    ("nccl", "void ncclKernelAllGatherCtranDirect<float>(int*, CtranAlgoDeviceState*, "
             "ctran::allgather::KernelArgs)", "all_gather",
     "source: meta-pytorch/torchcomms comms/ctran/algos/AllGather/AllGatherDirect.cuh (NCCLX CTran)"),
    ("deepep", "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, "
               "dpsk::ep::internode::SourceMeta*, int4 const*, float const*, long const*, float const*, int*, "
               "int*, int*, int*, int const*, int const*, int const*, int const*, int, int, int, int, int, "
               "bool const*, void*, int, int, void**, int, int, int, int, int*)", "all_to_all", DS),
    ("deepep", "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, float*, "
               "bool const*, int4 const*, float const*, int4 const*, int4 const*, int const*, int const*, "
               "dpsk::ep::internode::SourceMeta const*, int const*, int const*, int const*, int, int, int, int, "
               "void*, int, int, void**, int, int, int, int, int*)", "all_to_all", DS),
    ("deepep", "void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, long*, int, int const*, int*, "
               "int const*, int*, int, bool const*, int, int, int, int, int, int, int, int*, int*, int*, int*, "
               "void*, void**, int**, int, int, int*, int)", "all_to_all", DS),
    ("deepep", "void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int*, int, int, int const*, "
               "int const*, int*, void*, void**, int**, int, int, int, int*, bool, int)", "all_to_all", DS),
    ("deepep", "void deep_ep::legacy::intranode::notify_dispatch<8>(int const*, int*, int const*, int*, int, int, "
               "int, bool const*, int*, int*, int, int, void**, int**, int)", "all_to_all",
     "source: deepseek-ai/DeepEP csrc/kernels/legacy/intranode.cu @dd758ca"),
    ("deepep", "void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int const*, int*, int, int, int, "
               "bool const*, int*, int*, int, int, void**, int**, int)", "all_to_all",
     "source: deepseek-ai/DeepEP csrc/kernels/intranode.cu @567632d (before the move to legacy/)"),
    ("deepep", "void deep_ep::legacy::intranode::barrier<8>(int**, int)", "barrier",
     "source: deepseek-ai/DeepEP csrc/kernels/legacy/intranode.cu @dd758ca"),
    ("deepep", "void deep_ep::legacy::internode_ll::dispatch<true, false, 7168>(void*, float*, int*, long*, "
               "int*, int*, int*, void*, int*, void*, ...)", "all_to_all",
     "source: deepseek-ai/DeepEP csrc/kernels/legacy/internode_ll.cu @dd758ca"),
    ("deepep", "void deep_ep::elastic::hybrid_combine_impl<...>(__nv_bfloat16*, ...)", "all_to_all",
     "source: deepseek-ai/DeepEP deep_ep/include/deep_ep/impls/hybrid_combine.cuh @dd758ca"),
    ("pplx", "void (anonymous namespace)::dispatchKernel<4u, true, true>(int*, unsigned long, std::byte*, "
             "unsigned long, unsigned long, float*, ...)", "all_to_all",
     "source: ppl-ai/pplx-kernels csrc/all_to_all/internode_dispatch.cu @12cecfd"),
    ("pplx", "void (anonymous namespace)::combineKernel<__nv_bfloat16, __nv_bfloat16, 4u>(...)", "all_to_all",
     "source: ppl-ai/pplx-kernels csrc/all_to_all/internode_combine.cu @12cecfd"),
    ("mori", "void mori::moe::EpDispatchInterNodeKernel<__hip_bfloat16>(mori::moe::EpDispatchCombineArgs"
             "<__hip_bfloat16>)", "all_to_all", "source: ROCm/mori src/ops/dispatch_combine/internode.hpp @624002c"),
    ("mori", "void mori::collective::OneShotAllReduceKernel<float>(int, int, ...)", "all_reduce",
     "source: ROCm/mori include/mori/collective/inter_node/kernels/one_shot_kernel.hpp @624002c"),
    ("moe_alltoall", "void tensorrt_llm::kernels::moe_comm::moeA2ADispatchKernel<tensorrt_llm::kernels::moe_comm::"
                     "BlockPolicy, 8, false>(int const*, ...)", "all_to_all",
     "source: NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/communicationKernels/moeAlltoAllKernels.cu"),
    ("moe_alltoall", "flashinfer::trtllm_alltoall::moeAllToAllKernel(flashinfer::trtllm_alltoall::MoeEpWorldInfo, "
                     "flashinfer::trtllm_alltoall::MoeCommWorkspace, ...)", "all_to_all",
     "source: flashinfer-ai/flashinfer include/flashinfer/comm/trtllm_alltoall.cuh @fb28d72"),
    ("nvshmem", "barrier_on_stream_kernel_threadgroup(int, int)", "barrier",
     "source: NVIDIA/nvshmem src/include/internal/non_abi/nvshmemi_h_to_d_coll_defs.cuh @2d7d25f"),
    ("nvshmem", "void rdxn_on_stream_kernel<float, (rdxn_ops)0>(int, float*, float const*, unsigned long)",
     "all_reduce", "source: NVIDIA/nvshmem src/include/internal/non_abi/nvshmemi_h_to_d_coll_defs.cuh @2d7d25f"),
    ("nvshmem", "nvshmemi_signal_op_kernel(unsigned long*, unsigned long, int, int)", None,
     "source: NVIDIA/nvshmem src/include/internal/non_abi/nvshmemi_h_to_d_sync_defs.cuh @2d7d25f"),
    ("c10d_symm_mem", "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, "
                      "unsigned long, unsigned int**, unsigned long, unsigned long)", "all_reduce", TL),
    ("c10d_symm_mem", "void (anonymous namespace)::one_shot_all_reduce_kernel<float, 16, 8>(float**, float*, "
                      "float*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "all_reduce", "source: pytorch/pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu"),
    ("c10d_symm_mem", "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)",
     "barrier", "source: pytorch/pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.cu"),
    ("custom_allreduce", "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, "
                         "vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)", "all_reduce",
     "source: vllm-project/vllm csrc/custom_all_reduce.cuh"),
    ("custom_allreduce", "void sglang::cross_device_reduce_2stage<__nv_bfloat16, 4>(sglang::RankData*, "
                         "sglang::RankSignals, sglang::Signal*, __nv_bfloat16*, int, int)", "all_reduce",
     "profile: https://github.com/sgl-project/sglang/issues/6067; sgl-kernel/csrc/allreduce/custom_all_reduce.cuh"),
    ("custom_allreduce", "void aiter::cross_device_reduce_1stage<__hip_bfloat16, 8>(aiter::RankData*, ...)",
     "all_reduce", "source: ROCm/aiter csrc/include/custom_all_reduce.cuh @e404860"),
    ("custom_allreduce", "void aiter::reduce_scatter_split_first_dim<__hip_bfloat16, 8>(...)", "reduce_scatter",
     "source: ROCm/aiter csrc/include/custom_all_reduce.cuh @e404860"),
    ("custom_allreduce", "void quickreduce::allreduce_prototype_twoshot<quickreduce::AllReduceTwoshot<__half, "
                         "quickreduce::CodecFP<__half, 8> >, __half>(__half const*, __half*, unsigned int, "
                         "unsigned int, int, unsigned char**, unsigned int, unsigned int)", "all_reduce",
     "source: vllm-project/vllm csrc/quickreduce/quick_reduce.h"),
    ("trtllm_allreduce", "void tensorrt_llm::kernels::twoShotAllReduceKernel<__nv_bfloat16, 8>("
                         "tensorrt_llm::kernels::AllReduceParams)", "all_reduce",
     "https://github.com/NVIDIA/TensorRT-LLM/issues/2575; cpp/tensorrt_llm/kernels/customAllReduceKernels.cu"),
    ("trtllm_allreduce", "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport"
                         "<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, "
                         "true, true>(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)",
     "all_reduce",
     "source: flashinfer-ai/flashinfer include/flashinfer/comm/trtllm_allreduce_fusion.cuh @fb28d72"),
    ("trtllm_allreduce", "void flashinfer::trtllm_mnnvl_allreduce::twoshotAllreduceKernel<(unsigned char)8, "
                         "__nv_bfloat16, true, float4>(flashinfer::trtllm_mnnvl_allreduce::AllReduceKernelParams"
                         "<__nv_bfloat16>)", "all_reduce",
     "source: flashinfer-ai/flashinfer include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh @fb28d72"),
    ("c10d_symm_mem", "void c10d::intra_node_comm::oneShotAllReduceKernel<8u, true>(c10::BFloat16*, unsigned long, "
                      "unsigned long, c10d::intra_node_comm::P2pState**, c10::BFloat16**, unsigned long)",
     "all_reduce", "source: pytorch/pytorch torch/csrc/distributed/c10d/intra_node_comm.cu (PyTorch 2.3)"),
    ("mscclpp", "void mscclpp::collective::allreduceAllPairs<(mscclpp::ReduceOp)0, float, float>(float*, float*, "
                "float*, mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, unsigned long, unsigned long, int, int, "
                "int, unsigned long, unsigned int, void*, unsigned int)", "all_reduce",
     "source: microsoft/mscclpp src/ext/collectives/allreduce/allreduce_allpair_packet.cu @1f5f065"),
    ("mscclpp", "void sglang::allreduce_1shotLL_1node<__nv_bfloat16>(mscclpp::MemoryChannelDeviceHandle*, "
                "__nv_bfloat16*, __nv_bfloat16*, void*, int, int, unsigned long)", "all_reduce",
     "source: sgl-project/sglang sgl-kernel/csrc/allreduce/mscclpp_allreduce.cuh"),
    ("userbuffers", "void userbuffers_fp16_sum_inplace_gpu_rr_rs<8>(int, int, int, int, int, int, int, void**, "
                    "int, unsigned long)", "reduce_scatter",
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    ("userbuffers", "void userbuffers_fp16_sum_inplace_gpu_rw_ag<8>(...)", "all_gather",
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    ("userbuffers", "void userbuffers_fp16_sum_inplace_gpu_rw<8>(...)", "all_reduce",
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    ("userbuffers", "kuserbuffers_pullsend(int, int, int*, int*)", "send",
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    ("userbuffers", "kuserbuffers_pushsendrecv(int*, int*, int4*, int4*, int4*, int, int, int)", "send_recv",
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    ("oneccl", "oneccl_reduce_base<float, 2, 16, 1, 1, 2>", "reduce",
     "profile: https://github.com/intel/torch-xpu-ops/issues/5384 (a dist.all_reduce on XCCL)"),
]

# Real kernels that resemble communication but are local work (or GEMMs fused with a collective).
NOT_COMM = [
    # DeepEP's layout kernel counts tokens per rank on the local GPU.
    ("void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int, "
     "int, int)", ec.BANDWIDTH, DS),
    ("void deep_ep::elastic::dispatch_copy_epilogue_impl<...>(void*, void*, ...)", ec.BANDWIDTH,
     "source: deepseek-ai/DeepEP deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh"),
    # vLLM's MoE routing (Triton) on MI300: "combined" is not "combine".
    ("_combined_routing_compute", ec.BANDWIDTH,
     "AMD-AGI/TraceLens tests/traces/inference/vllm_decode_full/graph_execution.json.gz @171dd74"),
    ("_combined_routing_memset", ec.BANDWIDTH,
     "AMD-AGI/TraceLens tests/traces/inference/vllm_decode_full/graph_execution.json.gz @171dd74"),
    ("_finalize_matmul_scatter_bf16", ec.COMPUTE,
     "AMD-AGI/TraceLens tests/traces/inference/vllm_decode_full/graph_execution.json.gz @171dd74"),
    # TensorRT-LLM / FlashInfer namespaces hold local kernels too.
    ("void tensorrt_llm::kernels::quantize_with_block_size<(tensorrt_llm::BlockScaleQuantizationType)2, "
     "__nv_bfloat16, 32, true>(int, int, int, int, __nv_bfloat16 const*, float const*, unsigned int*, "
     "unsigned int*, flashinfer::QuantizationSFLayout)", ec.BANDWIDTH, TL),
    ("void moe::dev::finalize::finalizeKernelVecLoad<moe::dev::finalize::KernelParams<cutlass::bfloat16_t, "
     "cutlass::bfloat16_t, 4, true> >(moe::dev::finalize::KernelParams<cutlass::bfloat16_t, "
     "cutlass::bfloat16_t, 4, true>)", ec.COMPUTE, TL),  # "cutlass" in its template arguments
    # (Compute, not memory: COMPUTE_KERNEL_RE reads "flash" in every flashinfer:: name.)
    ("void flashinfer::trtllm_mnnvl_allreduce::rmsNormLamport<__nv_bfloat16>(...)", ec.COMPUTE,
     "source: flashinfer-ai/flashinfer include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh"),
    # The return type names vllm::_typeConvert: it neither makes the norm a convolution nor comm.
    ("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, c10::BFloat16*, "
     "c10::BFloat16 const*, float, int, int)", ec.BANDWIDTH, TL),
    # NVSHMEM's one-time symmetric-heap initialisation.
    ("void nvshmemi_init_array_kernel<int>(int*, int, int)", ec.BANDWIDTH,
     "source: NVIDIA/nvshmem src/host/team/team_internal_cuda.cu @2d7d25f"),
    # TransformerEngine's local reduction after a Userbuffers reduce-scatter.
    ("void reduce_fp8_in_bf16_out_cuda<__nv_fp8_e4m3>(void*, void*, float*, int, int, int)", ec.BANDWIDTH,
     "source: NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu"),
    # Fused GEMM + reduce-scatter (Triton-distributed): the GEMM dominates, so compute.
    ("kernel_gemm_rs_producer_persistent", ec.COMPUTE,
     "source: ByteDance-Seed/Triton-distributed python/triton_dist/kernels/nvidia/gemm_reduce_scatter.py"),
]


@pytest.mark.parametrize("family, name, kind, source", FAMILY_KERNELS)
def test_comm_families(family, name, kind, source):
    f = ec.comm_family(name)
    assert f is not None and f.name == family, source
    assert ec.kernel_class(name) == ec.COMM
    assert ec.is_comm_kernel(name)
    # The collective kind, from the whole name and from the name without its parameter list.
    assert ec.collective_name(name) == kind, source
    assert ec.collective_name(ec.strip_parameters(name)) == kind, source


@pytest.mark.parametrize("name, cls, source", NOT_COMM)
def test_local_kernels_are_not_communication(name, cls, source):
    assert ec.comm_family(name) is None, source
    assert ec.kernel_class(name) == cls, source


def test_every_family_has_real_kernels():
    tested = {f for f, *_ in FAMILY_KERNELS}
    assert tested == {f.name for f in ec.COMM_FAMILIES}
    assert len(ec.COMM_FAMILIES) == len({f.name for f in ec.COMM_FAMILIES})
    for f in ec.COMM_FAMILIES:
        assert f.source and f.example and f.on in ("name", "function")


def test_fused_gemm_in_a_communication_namespace_stays_compute():
    # Rule check: the GEMM guard, on the pattern of the fused GEMM+all-reduce kernels that
    # TensorRT-LLM and FlashInfer ship (GemmAllReduce, gemm_allreduce_two_shot).
    assert ec.comm_family("void flashinfer::comm::gemm_allreduce_two_shot_kernel<float>(float*)") is None
    assert ec.comm_family("void flashinfer::comm::allreduce_two_shot_kernel<float>(float*)").name == "trtllm_allreduce"


@pytest.mark.parametrize("name, fn", [
    ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*)", "dpsk::ep::internode::dispatch"),
    ("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long)", "vllm::fused_add_rms_norm_kernel"),
    ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)",
     "(anonymous namespace)::multimem_all_reduce_kernel"),
    ("void <unnamed>::multimem_all_reduce_kernel<c10::BFloat16, (int)16>(T1 *, unsigned long)",
     "(anonymous namespace)::multimem_all_reduce_kernel"),  # nsys' spelling
    ("void tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport<(tensorrt_llm::kernels::"
     "ar_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true>(tensorrt_llm::kernels::ar_fusion::"
     "AllReduceFusionParams<__nv_bfloat16>)", "tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport"),
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_Generic"),
    ("triton_poi_fused_add_mul_0", "triton_poi_fused_add_mul_0"),
])
def test_function_name(name, fn):
    assert ec.function_name(name) == fn


def test_template_arguments_and_parameters_do_not_make_communication():
    # A local kernel whose template argument and parameter types name DeepEP and TensorRT-LLM's all-reduce.
    name = ("void at::native::vectorized_elementwise_kernel<4, deep_ep::internode::dispatch<int>, "
            "tensorrt_llm::kernels::oneShotAllReduceKernel>(int, deep_ep::internode::SourceMeta*)")
    assert ec.comm_family(name) is None


@pytest.mark.parametrize("name", COMM_KERNELS)
def test_comm_kernels_every_generation(name):
    assert ec.kernel_class(name) == ec.COMM
    assert ec.is_comm_kernel(name)


@pytest.mark.parametrize("name", COMPUTE_KERNELS)
def test_compute_bound_kernels(name):
    assert ec.kernel_class(name) == ec.COMPUTE


@pytest.mark.parametrize("name", BANDWIDTH_KERNELS)
def test_bandwidth_bound_kernels(name):
    assert ec.kernel_class(name) == ec.BANDWIDTH


@pytest.mark.parametrize("name", MEMCPY)
def test_memory_ops(name):
    assert ec.kernel_class(name) == ec.MEMCPY


def test_device_classes_use_the_event_kind():
    names = ["Memcpy HtoD", "volta_sgemm_128x64_nn", "Stream Sync"]
    ids = np.array([0, 1, 1, 2])
    kinds = np.array([1, 0, 2, 3])  # memcpy, kernel, memset, cuda_sync
    assert ec.device_classes(names, ids, kinds).tolist() == [ec.MEMCPY, ec.COMPUTE, ec.MEMCPY, ec.OTHER]


def test_strip_parameters():
    assert ec.strip_parameters("void f<a::(anonymous namespace)::g>(int, float)") == \
        "void f<a::(anonymous namespace)::g>"
    assert ec.strip_parameters("volta_sgemm_128x64_nn") == "volta_sgemm_128x64_nn"


@pytest.mark.parametrize("name, cls", [
    ("c10d::allreduce_", "comm"), ("gloo:all_reduce", "comm"), ("record_param_comms", "comm"),
    ("nccl:all_reduce", "comm"),
    ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "data"),
    ("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "data"),
    ("aten::mm", "compute"), ("aten::addmm", "compute"), ("aten::bmm", "compute"), ("aten::conv2d", "compute"),
    ("aten::mkldnn_convolution", "compute"), ("aten::linear", "compute"),
    ("aten::scaled_dot_product_attention", "compute"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "compute"),
    ("aten::add", "memory"), ("aten::mul_", "memory"), ("aten::relu", "memory"), ("aten::copy_", "memory"),
    ("aten::sum", "memory"), ("aten::native_layer_norm", "memory"), ("aten::_foreach_add_", "memory"),
    ("aten::item", "host"), ("aten::_local_scalar_dense", "host"), ("cudaStreamSynchronize", "host"),
    ("aten::view", "host"), ("aten::empty", "host"), ("Optimizer.step#SGD.step", "host"),
])
def test_cpu_op_classes(name, cls):
    assert ec.cpu_op_class(name) == cls


@pytest.mark.parametrize("text, name", [
    ("allreduce", "all_reduce"), ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ("ncclKernel_ReduceScatter_RING", "reduce_scatter"), ("gloo:all_to_all", "all_to_all"),
    ("alltoall_base", "all_to_all"), ("broadcast", "broadcast"), ("ncclKernel_SendRecv_RING", "send_recv"), ("send", "send"),
    ("recv", "recv"), ("barrier", "barrier"), ("reduce", "reduce"), (None, None), ("nothing", None),
])
def test_collective_names(text, name):
    assert ec.collective_name(text) == name
