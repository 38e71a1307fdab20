"""What the live model and optimizer hold: parameter count, bytes by dtype, gradients,
optimizer state, and the model's configuration where it publishes one (its shape).

`diag plan --run` and the report's memory section start from these numbers instead of a
guessed precision and optimizer. They are read once, after the first training step
(optimizers such as Adam create their state lazily in the first `step()`), in the
training thread, by walking the tensors' metadata: no copy, no device synchronisation.
"""

from __future__ import annotations


def unwrap(model):
    """The user's module inside DDP, FSDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model


def _local(t):
    """The shard this process holds: a DTensor's local tensor, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


def _add(by_dtype: dict, t) -> int:
    n = _nbytes(t)
    key = str(t.dtype).replace("torch.", "")
    by_dtype[key] = by_dtype.get(key, 0) + n
    return n


def config_of(model) -> dict | None:
    """The scalar entries of a `config` attribute (Hugging Face models and many others): the
    shape `diag plan` reads as it reads a config.json (diag.analyzers.plan.models)."""
    for m in (model, getattr(model, "model", None)):
        cfg = getattr(m, "config", None)
        if cfg is None:
            continue
        doc = cfg if isinstance(cfg, dict) else (cfg.to_dict() if callable(getattr(cfg, "to_dict", None))
                                                  else vars(cfg))
        out: dict[str, object] = {k: v for k, v in doc.items()
                                  if isinstance(k, str) and isinstance(v, (int, float, str, bool))}
        text = doc.get("text_config")  # multimodal wrappers keep the decoder's shape here
        if isinstance(text, dict):
            out["text_config"] = {k: v for k, v in text.items() if isinstance(v, (int, float, str, bool))}
        return out or None
    return None


def _optimizer_states(optimizer):
    """The state dicts of an optimizer and of the optimizers it wraps (DeepSpeed, Lightning, ...)."""
    seen = set()  # a wrapper's `state` is often its inner optimizer's own dict: counted once
    for _ in range(4):
        if optimizer is None:
            return
        state = getattr(optimizer, "state", None)
        if isinstance(state, dict) and id(state) not in seen:
            seen.add(id(state))
            yield state
        optimizer = getattr(optimizer, "optimizer", None)


def describe(model, optimizer=None) -> dict:
    """The facts of one rank's model and optimizer, in bytes this process holds."""
    import torch

    root = unwrap(model)
    seen: set[int] = set()
    params = trainable = local_params = 0
    param_dtypes: dict = {}
    grad_dtypes: dict = {}
    sharded = False
    largest, largest_name = 0, None
    for name, p in root.named_parameters():
        local = _local(p)
        key = local.data_ptr() if local.numel() else id(p)
        if key in seen:  # tied weights (embeddings shared with the output layer) count once
            continue
        seen.add(key)
        sharded = sharded or local is not p
        n = int(p.numel())
        params += n
        if n > largest:
            largest, largest_name = n, name
        trainable += n if p.requires_grad else 0
        local_params += int(local.numel())
        _add(param_dtypes, local)
        if p.grad is not None:
            _add(grad_dtypes, _local(p.grad))
    # FSDP (use_orig_params=False) and DeepSpeed ZeRO-3 keep flat shards: the module's
    # parameters are views of what this rank holds, and the full count is in their metadata.
    flat = [getattr(p, "_unpadded_unsharded_size", None) or getattr(p, "ds_numel", None) for p in root.parameters()]
    if any(flat):
        sharded = True
        params = sum(int(f.numel() if hasattr(f, "numel") else f) for f in flat if f) or params
    opt_dtypes: dict = {}
    for state in _optimizer_states(optimizer):
        for per_param in state.values():
            if not isinstance(per_param, dict):
                continue
            for v in per_param.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # a 0-d "step" counter is not state memory
                    _add(opt_dtypes, _local(v))
    buffers = sum(_nbytes(b) for b in root.buffers())
    out = {
        "class": type(root).__name__,
        "params": params,
        "trainable_params": trainable,
        "local_params": local_params,
        "largest_param": largest,
        "largest_param_name": largest_name,
        "param_bytes": sum(param_dtypes.values()),
        "param_dtypes": param_dtypes,
        "grad_bytes": sum(grad_dtypes.values()),
        "grad_dtypes": grad_dtypes,
        "buffer_bytes": buffers,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "optimizer_state_bytes": sum(opt_dtypes.values()) if optimizer is not None else None,
        "optimizer_state_dtypes": opt_dtypes,
        "sharded": sharded,
    }
    config = config_of(root)
    if config:
        out["config"] = config
    return out
