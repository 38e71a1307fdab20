"""Event classes across naming generations: NCCL/RCCL/MSCCL, memcpy, GEMM/conv/attention, CPU ops."""

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
