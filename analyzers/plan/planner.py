"""One training layout: memory per GPU, whether it fits, communication per step, step time.

The memory comes from `memory.py` (the published formulas). The step-time model is the
usual one for dense transformers (Narayanan et al., SC'21, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM"):
- compute: 6 FLOPs per parameter per token plus 12*L*h*s for attention scores (model
  FLOPs, what MFU counts); full recomputation runs the forward pass again (x 4/3);
- tensor-parallel collectives sit on the critical path: per layer and micro-batch two in
  the forward and two in the backward pass, each of s*b*h 16-bit values (an all-reduce,
  or with sequence parallelism an all-gather and a reduce-scatter);
- pipeline send/recv of one activation per micro-batch and stage boundary each way, and
  the 1F1B bubble of (p - 1) / m of the ideal time;
- data-parallel gradient traffic overlaps the backward pass (two thirds of compute); only
  what does not fit under it is exposed. ZeRO-3 gathers parameters in every micro-batch.
Rates: achieved FLOP/s per GPU and bus bandwidth inside and across nodes, either measured
(the caller says where from) or the device's datasheet peak at an assumed MFU and the
healthy bus bandwidth of the links (diag.analyzers.nccl.expected). Every result says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diag.analyzers.plan.memory import activations_per_layer, model_states, zero_stage
from diag.analyzers.plan.models import Model
from diag.errors import DiagInputError

SCHEMA = "diag.plan/1"
# Memory the formulas do not count: the CUDA context, cuBLAS/cuDNN workspaces and NCCL
# buffers (about 1.5 GiB), and fragmentation of the caching allocator (about 10% of what
# it holds), as reported by PyTorch's memory snapshots on large jobs.
WORKSPACE_BYTES = 1.5 * 2**30
FRAGMENTATION = 0.10
LOGIT_BYTES = 6  # per vocabulary entry and token on the last stage: 16-bit logits + fp32 for the loss
DEFAULT_MFU = 0.45  # a well-tuned dense transformer on current GPUs; a measured rate replaces it
BACKWARD_SHARE = 2 / 3  # of compute: the window data-parallel traffic overlaps
# Links of each GPU's reference system, assumed when no link is given or measured
# (device key -> intra-node link, inter-node link, NICs per node; diag.analyzers.nccl.expected names).
REFERENCE_LINKS = {
    "v100-sxm2": ("nvlink2", "ib_edr", 4, "DGX-1V"),
    "a100-40gb": ("nvlink3", "ib_hdr", 8, "DGX A100"),
    "a100-80gb": ("nvlink3", "ib_hdr", 8, "DGX A100"),
    "h100-sxm": ("nvlink4", "ib_ndr", 8, "DGX H100"),
    "h200": ("nvlink4", "ib_ndr", 8, "DGX H200"),
    "b200": ("nvlink5", "ib_ndr", 8, "DGX B200"),
}
# The global batch --search assumes when none is given: about 4M tokens, as recent dense
# models train with (Llama 3 started at 4M tokens per step), rounded to whole GPUs.
DEFAULT_BATCH_TOKENS = 4 * 2**20


def default_global_batch(seq: int, gpus: int) -> int:
    return max(1, -(-DEFAULT_BATCH_TOKENS // seq // gpus)) * gpus


@dataclass(frozen=True)
class Job:
    gpus: int
    gpus_per_node: int = 8
    micro_batch: int = 1
    global_batch: int | None = None  # default: one micro-batch per data-parallel rank
    seq: int | None = None  # default: the model's
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    sharding: str = "0"
    tp: int = 1
    pp: int = 1
    sp: bool = False
    recompute: str = "none"
    offload: bool = False
    flash: bool = True  # FlashAttention / SDPA: no s x s attention matrices kept
    gpu_memory_bytes: float | None = None


@dataclass(frozen=True)
class Rates:
    flops_per_gpu: float | None  # achieved FLOP/s (dense, the training precision)
    peak_flops: float | None  # datasheet peak, for MFU
    intra_busbw: float | None  # bytes/s, inside a node
    inter_busbw: float | None  # bytes/s, across nodes
    sources: dict = field(default_factory=dict)
    overhead_s: float = 0.0  # measured data and host time per step, which no layout changes


def data_parallel(gpus: int, tp: int, pp: int) -> int:
    """The data-parallel size of a layout, or a one-line error when tp x pp does not divide the GPUs."""
    if min(gpus, tp, pp) < 1:
        raise DiagInputError("GPUs and parallel degrees must be positive")
    if gpus % (tp * pp):
        raise DiagInputError(f"tp x pp = {tp * pp} does not divide {gpus} GPUs")
    return gpus // (tp * pp)


def validate(model: Model, job: Job) -> int:
    """The data-parallel size, or a one-line error for an impossible layout."""
    if min(job.gpus, job.gpus_per_node, job.micro_batch, job.tp, job.pp) < 1:
        raise DiagInputError("GPUs, GPUs per node, micro-batch and parallel degrees must be positive")
    dp = data_parallel(job.gpus, job.tp, job.pp)
    if model.heads % job.tp:
        raise DiagInputError(f"{model.heads} attention heads are not divisible by tp = {job.tp}")
    if model.kv_heads % job.tp and job.tp % model.kv_heads:
        raise DiagInputError(f"{model.kv_heads} key-value heads cannot be split over tp = {job.tp}")
    if model.layers % job.pp:
        raise DiagInputError(f"{model.layers} layers are not divisible by pp = {job.pp}")
    if job.sp and job.tp == 1:
        raise DiagInputError("sequence parallelism needs tp > 1")
    if job.global_batch is not None and job.global_batch % (job.micro_batch * dp):
        raise DiagInputError(f"global batch {job.global_batch} is not a multiple of micro-batch x data-parallel "
                             f"size = {job.micro_batch * dp}")
    zero_stage(job.sharding)
    return dp


def plan(model: Model, job: Job, rates: Rates) -> dict:
    """The diag.plan/1 document of one layout."""
    dp = validate(model, job)
    seq = job.seq or model.seq
    accum = (job.global_batch // (job.micro_batch * dp)) if job.global_batch else 1
    params = model.params()
    stage = zero_stage(job.sharding)

    states = model_states(params, job.precision, job.optimizer, job.sharding, dp, job.tp, job.pp)
    optimizer_bytes = 0.0 if job.offload else states.optimizer_bytes
    params_bytes = states.params_bytes if not (job.offload and stage >= 3) else 0.0
    per_layer = activations_per_layer(seq, job.micro_batch, model.hidden, model.heads, job.tp, job.sp, job.recompute,
                                      job.flash)
    in_flight = min(job.pp, accum) if job.pp > 1 else 1  # 1F1B: the first stage holds p micro-batches
    activations = per_layer * (model.layers // job.pp) * in_flight
    logits = seq * job.micro_batch * model.vocab * LOGIT_BYTES / job.tp
    held = params_bytes + states.grads_bytes + optimizer_bytes + activations + logits
    allowance = WORKSPACE_BYTES + FRAGMENTATION * held
    total = held + allowance
    fits = None if job.gpu_memory_bytes is None else total <= job.gpu_memory_bytes

    comm, groups = _comm_bytes(model, job, dp, seq, accum, params, stage)
    timing = _timing(model, job, rates, dp, seq, accum, groups)
    out = {
        "schema": SCHEMA,
        "model": {"name": model.name, "params": params, "layers": model.layers, "hidden": model.hidden,
                  "heads": model.heads, "kv_heads": model.kv_heads, "ffn": model.ffn, "vocab": model.vocab,
                  "seq": seq, "source": model.source},
        "layout": {"gpus": job.gpus, "gpus_per_node": job.gpus_per_node, "dp": dp, "tp": job.tp, "pp": job.pp,
                   "sp": job.sp, "flash_attention": job.flash, "sharding": job.sharding, "zero_stage": stage, "recompute": job.recompute,
                   "offload": job.offload, "micro_batch": job.micro_batch, "grad_accum": accum,
                   "global_batch": job.micro_batch * dp * accum, "precision": job.precision,
                   "optimizer": job.optimizer},
        "per_gpu": {
            "params_bytes": params_bytes, "grads_bytes": states.grads_bytes, "optimizer_bytes": optimizer_bytes,
            "activations_bytes": activations + logits, "activations_per_layer_bytes": per_layer,
            "logits_bytes": logits, "allowance_bytes": allowance, "total_bytes": total,
            "gpu_memory_bytes": job.gpu_memory_bytes,
            "allowance": f"{WORKSPACE_BYTES / 2**30:.1f} GiB of CUDA context, library workspaces and NCCL buffers, "
                         f"plus {FRAGMENTATION:.0%} of the rest for allocator fragmentation",
        },
        "fits": fits,
        "comm_bytes_per_step": comm,
        **timing,
    }
    out["tp_crosses_nodes"] = job.tp > job.gpus_per_node
    return out


def _comm_bytes(model: Model, job: Job, dp: int, seq: int, accum: int, params: float,
                stage: int) -> tuple[dict, dict]:
    """Bus bytes per GPU per step (nccl-tests' busbw convention), by collective kind and by
    the group that moves them (tp, pp, dp)."""
    groups = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    grad_b = 4 if job.precision in ("fp32", "tf32") else 2
    out = dp_comm_bytes(params / (job.tp * job.pp) * grad_b, dp, stage, accum)
    groups["dp"] = sum(out.values())
    if job.tp > 1:
        act = seq * job.micro_batch * model.hidden * 2
        n = 4 + (2 if job.recompute == "full" else 0)  # full recomputation repeats the forward's
        per_step = n * (model.layers // job.pp) * accum * (job.tp - 1) / job.tp * act
        if job.sp:
            out["all_gather"] += per_step
            out["reduce_scatter"] += per_step
        else:
            out["all_reduce"] += 2 * per_step
        groups["tp"] = 2 * per_step
    if job.pp > 1:
        act = seq * job.micro_batch * model.hidden * 2 / (job.tp if job.sp else 1)
        out["send_recv"] += 2 * accum * act
        groups["pp"] = out["send_recv"]
    return out, groups


def dp_comm_bytes(slice_bytes: float, dp: int, stage: int, accum: int) -> dict:
    """Data-parallel bus bytes per GPU per step of one GPU's slice of gradients (`slice_bytes`):
    an all-reduce up to ZeRO-1, reduce-scatter + all-gather at ZeRO-2, and at ZeRO-3 the
    parameters gathered for the forward and the backward of every micro-batch."""
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0, "send_recv": 0.0}
    if dp > 1:
        ring = (dp - 1) / dp
        if stage <= 1:
            out["all_reduce"] += 2 * ring * slice_bytes
        elif stage == 2:
            out["reduce_scatter"] += ring * slice_bytes
            out["all_gather"] += ring * slice_bytes
        else:
            out["all_gather"] += 2 * accum * ring * slice_bytes
            out["reduce_scatter"] += accum * ring * slice_bytes
    return out


def model_flops_per_step(model: Model, tokens: float, seq: int) -> float:
    return 6 * model.params() * tokens + 12 * model.layers * model.hidden * seq * tokens


def _timing(model: Model, job: Job, rates: Rates, dp: int, seq: int, accum: int, groups: dict) -> dict:
    tokens = job.micro_batch * dp * accum * seq
    flops = model_flops_per_step(model, tokens, seq)
    hw_flops = flops * (4 / 3 if job.recompute == "full" else 1.0)
    out: dict = {"tokens_per_step": tokens, "model_flops_per_step": flops, "rates": dict(rates.sources)}
    if not rates.flops_per_gpu:
        out.update(step_time_s=None, mfu=None, breakdown_s=None)
        return out
    compute = hw_flops / job.gpus / rates.flops_per_gpu
    out.update(step_timing(job, rates, compute, accum, groups))
    if out["step_time_s"]:
        out["mfu"] = flops / (out["step_time_s"] * job.gpus * rates.peak_flops) if rates.peak_flops else None
    return out


def step_timing(job: Job, rates: Rates, compute: float, accum: int, groups: dict) -> dict:
    """Step time from the compute seconds per GPU and the bus bytes of each group (tp, pp, dp)."""
    nodes_of = lambda n: n > job.gpus_per_node  # noqa: E731  (a group of n GPUs spans nodes)
    intra, inter = rates.intra_busbw, rates.inter_busbw

    def seconds(nbytes: float, crosses: bool) -> float | None:
        bw = inter if crosses else intra
        return nbytes / bw if nbytes and bw else (0.0 if not nbytes else None)

    tp_t = seconds(groups["tp"], nodes_of(job.tp))
    pp_t = seconds(groups["pp"], nodes_of(job.tp * job.pp))
    dp_t = seconds(groups["dp"], nodes_of(job.gpus))
    if tp_t is None or pp_t is None or dp_t is None:
        return {"step_time_s": None, "mfu": None, "breakdown_s": None,
                "missing": "bus bandwidth of the links these groups cross (pass --intra/--inter or --nccl)"}
    bubble = (job.pp - 1) / accum * (compute + tp_t) if job.pp > 1 else 0.0
    dp_exposed = max(0.0, dp_t - BACKWARD_SHARE * compute)
    step = compute + tp_t + pp_t + dp_exposed + bubble + rates.overhead_s
    return {
        "step_time_s": step,
        "breakdown_s": {"compute": compute, "tp_comm": tp_t, "pp_comm": pp_t, "dp_comm_exposed": dp_exposed,
                        "dp_comm": dp_t, "pipeline_bubble": bubble, "overhead": rates.overhead_s},
        "bubble_share": bubble / step if step > 0 else 0.0,
    }


def time_to_train(doc: dict, tokens: float) -> float | None:
    step, per_step = doc.get("step_time_s"), doc.get("tokens_per_step")
    return tokens / per_step * step if step and per_step else None
