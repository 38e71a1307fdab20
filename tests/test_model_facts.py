"""What the agent reads from the live model and optimizer (diag.collectors.model_facts)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch

from diag.collectors.model_facts import config_of, describe, unwrap


def test_tied_weights_count_once_and_adam_state_is_two_fp32_moments():
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2 and Llama's small variants
    model = torch.nn.Sequential(emb, torch.nn.Linear(8, 8), head)
    opt = torch.optim.AdamW(model.parameters())
    before = describe(model, opt)
    assert before["params"] == 100 * 8 + 8 * 8 + 8 and before["optimizer_state_bytes"] == 0  # no state before a step
    model(torch.randint(0, 100, (4,))).sum().backward()
    opt.step()
    after = describe(model, opt)
    n = before["params"]
    assert after["grad_bytes"] == 4 * n and after["optimizer_state_bytes"] == 8 * n
    assert after["optimizer_state_dtypes"] == {"float32": 8 * n} and after["largest_param"] == 800
    assert after["sharded"] is False and "config" not in after


def test_bf16_parameters_and_buffers_by_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    facts = describe(model)
    assert facts["param_dtypes"] == {"bfloat16": 2 * (16 + 4 + 4 + 4)}
    # BatchNorm's running mean and variance (bf16) and its batch counter (int64).
    assert facts["buffer_bytes"] == 2 * 4 + 2 * 4 + 8
    assert facts["optimizer"] is None and facts["optimizer_state_bytes"] is None


def test_config_of_a_wrapped_model_and_the_plan_reads_it():
    class Config:  # a configuration object without to_dict(), as some libraries keep
        def __init__(self):
            self.num_hidden_layers, self.hidden_size, self.num_attention_heads = 32, 4096, 32
            self.num_key_value_heads, self.intermediate_size, self.vocab_size = 8, 14336, 128256
            self.max_position_embeddings, self.model_type, self.rope_scaling = 8192, "llama", {"factor": 8.0}

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(2, 2)
            self.model.config = Config()

    cfg = config_of(Wrapped())
    assert "rope_scaling" not in cfg and cfg["num_key_value_heads"] == 8  # scalars only
    from diag.analyzers.plan.models import PRESETS, from_hf_dict

    # The recorded configuration gives Llama 3 8B's published shape and count.
    assert from_hf_dict(cfg, "recorded").params() == PRESETS["llama3-8b"].params()
    assert config_of(torch.nn.Linear(2, 2)) is None

def test_unwrap_compiled():
    class Compiled(torch.nn.Module):  # the attribute torch.compile's wrapper keeps the module under
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    inner = torch.nn.Linear(3, 3)
    assert unwrap(Compiled(inner)) is inner


def test_fsdp2_shards_are_counted_per_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "facts"
    worker = Path(__file__).with_name("fsdp_facts_worker.py")
    subprocess.run([sys.executable, str(worker), str(port), str(out)], check=True, timeout=180)
    full = 8 * 16 + 16 + 16 * 4 + 4
    for rank in (0, 1):
        facts = json.loads(Path(f"{out}.{rank}").read_text())
        assert facts["sharded"] is True and facts["params"] == full
        # Each rank holds half of every parameter, its gradient, and Adam's two moments of it.
        assert facts["local_params"] == full // 2 and facts["param_bytes"] == facts["grad_bytes"] == 4 * full // 2
        assert facts["optimizer_state_bytes"] == 8 * full // 2
