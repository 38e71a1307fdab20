"""Transformer shapes and their parameter counts: presets from published configs, shape
flags, and Hugging Face `config.json` files read from disk (never downloaded).

The count is that of a decoder-only transformer layer: attention projections (q and o of
heads x head_dim, k and v of kv_heads x head_dim, so grouped-query attention counts
right), an MLP of two matrices, or three when gated (SwiGLU, GeGLU), two norms, plus the
token embeddings, a separate output matrix unless tied, and learned position embeddings
where the model has them. Biases are left out: under 0.1% of any model here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from diag.errors import DiagInputError


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int  # the context the model was trained with (the default sequence length)
    gated_mlp: bool = True
    tied_embeddings: bool = False
    head_dim: int | None = None  # hidden / heads unless the model says otherwise
    learned_positions: int = 0  # rows of a learned position table (GPT-2, GPT-3, OPT); 0: none
    source: str = ""

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def params_per_layer(self) -> int:
        h, d = self.hidden, self.dim_per_head
        attn = 2 * h * self.heads * d + 2 * h * self.kv_heads * d
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        out = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return out + self.learned_positions * self.hidden

    def params(self) -> int:
        return self.layers * self.params_per_layer() + self.embedding_params() + self.hidden  # + final norm


# Published configurations (the model cards' config.json, or the paper for GPT-3).
PRESETS = {
    m.name: m for m in (
        Model("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, source="meta-llama/Meta-Llama-3-8B config.json"),
        Model("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, source="meta-llama/Meta-Llama-3-70B config.json"),
        Model("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192,
              source="meta-llama/Llama-3.1-405B config.json"),
        Model("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, source="meta-llama/Llama-2-7b-hf config.json"),
        Model("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, source="meta-llama/Llama-2-70b-hf config.json"),
        Model("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, source="mistralai/Mistral-7B-v0.1 config.json"),
        Model("gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 50257, 2048, gated_mlp=False, tied_embeddings=True,
              learned_positions=2048, source="Brown et al. 2020, Table 2.1"),
        Model("gpt2", 12, 768, 12, 12, 3072, 50257, 1024, gated_mlp=False, tied_embeddings=True,
              learned_positions=1024, source="openai-community/gpt2 config.json"),
    )
}


def preset(name: str) -> Model:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise DiagInputError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def from_shape(layers: int, hidden: int, heads: int, seq: int, kv_heads: int | None = None, ffn: int | None = None,
               vocab: int = 32000, gated_mlp: bool = True) -> Model:
    """A model from shape flags; the MLP defaults to LLaMA's 8/3 x hidden, rounded to 256, when gated."""
    if min(layers, hidden, heads, seq, vocab) < 1:
        raise DiagInputError("layers, hidden size, heads, sequence length and vocabulary must be positive")
    if hidden % heads:
        raise DiagInputError(f"hidden size {hidden} is not divisible by {heads} heads")
    kv = kv_heads or heads
    if heads % kv:
        raise DiagInputError(f"{heads} heads cannot be grouped over {kv} key-value heads")
    if ffn is None:
        ffn = -(-int(hidden * 8 / 3) // 256) * 256 if gated_mlp else 4 * hidden
    return Model("custom", layers, hidden, heads, kv, ffn, vocab, seq, gated_mlp=gated_mlp, source="shape flags")


# config.json keys of the common families, first match wins (GPT-2 style names last).
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "multi_query_group_num"),
    "ffn": ("intermediate_size", "n_inner", "ffn_hidden_size"),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "seq": ("max_position_embeddings", "n_positions", "seq_length"),
}
_UNGATED_TYPES = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder", "gpt_bigcode")
# Families whose configuration class ties the output matrix to the embeddings by default
# (LLaMA, Mistral and Qwen2 set tie_word_embeddings = False in theirs).
_TIED_TYPES = ("gemma", "gpt2", "opt", "bloom", "gpt_bigcode", "starcoder", "gpt_neo")


def from_hf_config(path: str | Path) -> Model:
    """A model from a Hugging Face config.json on disk."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DiagInputError(f"{p}: no such config file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DiagInputError(f"{p}: not a readable config.json ({exc})") from None
    return from_hf_dict(doc, str(p), p.parent.name)


def from_hf_dict(doc, source: str, fallback_name: str = "config") -> Model:
    """A model from the entries of a Hugging Face configuration (a config.json, or the
    `config` the agent recorded from the live model)."""
    p = source
    if not isinstance(doc, dict):
        raise DiagInputError(f"{p}: not a model configuration (expected a JSON object)")
    text = doc.get("text_config")
    doc = text if isinstance(text, dict) else doc  # multimodal wrappers

    def get(field, required=True):
        for key in _KEYS[field]:
            v = doc.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        if required:
            raise DiagInputError(f"{p}: no {field} in the config (looked for {', '.join(_KEYS[field])})")
        return None

    model_type = str(doc.get("model_type") or "")
    gated = not model_type.startswith(_UNGATED_TYPES)
    hidden, heads, seq = get("hidden"), get("heads"), get("seq", required=False) or 2048
    head_dim = doc.get("head_dim") if isinstance(doc.get("head_dim"), int) else None
    m = Model(
        name=str(doc.get("_name_or_path") or fallback_name or doc.get("model_type") or "config"), layers=get("layers"), hidden=hidden,
        heads=heads, kv_heads=get("kv_heads", required=False) or heads,
        ffn=get("ffn", required=False) or 4 * hidden, vocab=get("vocab"), seq=seq,
        gated_mlp=gated, tied_embeddings=bool(doc.get("tie_word_embeddings", model_type.startswith(_TIED_TYPES))),
        head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
        learned_positions=seq if model_type in ("gpt2", "opt", "gpt_bigcode", "starcoder") else 0, source=p)
    if m.heads % m.kv_heads:
        raise DiagInputError(f"{p}: {m.heads} heads cannot be grouped over {m.kv_heads} key-value heads")
    return m


def with_seq(model: Model, seq: int | None) -> Model:
    return replace(model, seq=seq) if seq else model
