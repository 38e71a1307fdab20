"""Per-GPU training memory: the published formulas, each with its source, in one place.

Model states (parameters, gradients, optimizer state) under data-parallel sharding follow
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20), section 3 and Figure 1: with Psi parameters, mixed-precision Adam keeps
2 bytes of fp16/bf16 parameters, 2 bytes of gradients and K = 12 bytes of optimizer state
per parameter (fp32 master copy, momentum and variance: 4 + 4 + 4). Some popular tables
count 8 bytes of Adam state; that leaves out the fp32 master copy, which mixed precision
cannot do without. Stage 1 shards the optimizer state over the Nd data-parallel ranks,
stage 2 also the gradients, stage 3 also the parameters. PyTorch FSDP's FULL_SHARD is
stage 3 and SHARD_GRAD_OP stage 2. Tensor and pipeline parallelism divide the parameters
a GPU holds before data-parallel sharding.

Activations per transformer layer follow Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (MLSys 2023), section 4 and Table 2, for a
GPT-style layer with 16-bit activations and dropout masks (s sequence length, b
micro-batch, h hidden size, a attention heads, t tensor-parallel size):
  no parallelism                     s*b*h*(34 + 5*a*s/h)
  tensor parallel                    s*b*h*(10 + 24/t + 5*a*s/(h*t))
  tensor + sequence parallel         s*b*h*(34 + 5*a*s/h) / t
  tensor parallel, selective recompute          s*b*h*(10 + 24/t)
  tensor + sequence parallel, selective         s*b*h*34/t
  full recomputation                 2*s*b*h (the layer's input), /t with sequence parallel
The 5*a*s/h term is the attention's s x s scores, softmax and dropout mask. FlashAttention
(PyTorch's scaled_dot_product_attention on GPUs) never stores them and recomputes them in
the backward pass, which is what selective recomputation does: with `flash` the term goes,
as in the paper's selective rows. The 34 assumes the paper's 4h GeLU MLP; a gated MLP of
about the same parameter count (LLaMA's 8/3 h SwiGLU) stores about as much.
Bytes throughout; a GB in the papers is 10**9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from diag.errors import DiagInputError

# Bytes per value of the training copy of parameters and of gradients, by precision.
PARAM_BYTES = {"fp32": 4, "tf32": 4, "bf16-mixed": 2, "fp16-mixed": 2, "fp8-mixed": 2}
# Optimizer state bytes per parameter (K). Mixed precision keeps an fp32 master copy.
OPTIMIZER_BYTES = {
    # fp32 master (mixed only) + exp_avg + exp_avg_sq
    ("adam", True): 12, ("adamw", True): 12, ("adam", False): 8, ("adamw", False): 8,
    # fp32 master (mixed only) + momentum
    ("sgd", True): 8, ("sgd", False): 4,
    # fp32 master (mixed only); Adafactor's factored second moments are O(rows + columns),
    # negligible against the parameters, and it keeps no first moment by default.
    ("adafactor", True): 4, ("adafactor", False): 0,
}
SHARDING = ("0", "1", "2", "3", "fsdp-full", "fsdp-grad-op")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelStates:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def zero_stage(sharding: str | int) -> int:
    """The ZeRO stage a sharding setting amounts to (FSDP FULL_SHARD = 3, SHARD_GRAD_OP = 2)."""
    s = str(sharding)
    if s not in SHARDING:
        raise DiagInputError(f"unknown sharding {sharding!r}; choose from {', '.join(SHARDING)}")
    return {"fsdp-full": 3, "fsdp-grad-op": 2}.get(s, int(s) if s.isdigit() else 0)


def optimizer_bytes_per_param(optimizer: str, precision: str) -> int:
    key = (optimizer.lower(), precision not in ("fp32", "tf32"))
    if key not in OPTIMIZER_BYTES:
        raise DiagInputError(f"unknown optimizer {optimizer!r}; choose from adam, adamw, sgd, adafactor")
    return OPTIMIZER_BYTES[key]


def model_states(params: float, precision: str = "bf16-mixed", optimizer: str = "adam", sharding: str | int = 0,
                 dp: int = 1, tp: int = 1, pp: int = 1) -> ModelStates:
    """Bytes of model states on one GPU (ZeRO section 3: Psi*(2 + 2 + K) unsharded)."""
    if precision not in PARAM_BYTES:
        raise DiagInputError(f"unknown precision {precision!r}; choose from {', '.join(PARAM_BYTES)}")
    if min(dp, tp, pp) < 1 or params <= 0:
        raise DiagInputError("parameters and parallel degrees must be positive")
    stage = zero_stage(sharding)
    psi = params / (tp * pp)  # what this GPU's tensor/pipeline slice holds
    b = PARAM_BYTES[precision]
    k = optimizer_bytes_per_param(optimizer, precision)
    return ModelStates(
        params_bytes=b * psi / (dp if stage >= 3 else 1),
        grads_bytes=b * psi / (dp if stage >= 2 else 1),
        optimizer_bytes=k * psi / (dp if stage >= 1 else 1),
    )


def activations_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False,
                          recompute: str = "none", flash: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for the backward pass (Korthikanti Table 2)."""
    if recompute not in RECOMPUTE:
        raise DiagInputError(f"unknown recomputation {recompute!r}; choose from {', '.join(RECOMPUTE)}")
    if min(seq, micro_batch, hidden, heads, tp) < 1:
        raise DiagInputError("sequence, micro-batch, hidden size, heads and tensor parallelism must be positive")
    sbh = seq * micro_batch * hidden
    attn = 0.0 if flash else 5 * heads * seq / hidden  # the attention score, softmax and dropout terms
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    if recompute == "selective":  # the attention terms are recomputed
        return sbh * 34 / tp if sp else sbh * (10 + 24 / tp)
    if sp:
        return sbh * (34 + attn) / tp
    return sbh * (10 + 24 / tp + attn / tp)
