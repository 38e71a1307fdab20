"""Model shapes and parameter counts against the published totals."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from diag.analyzers.plan.models import PRESETS, from_hf_config, from_shape, preset
from diag.errors import DiagInputError

# Parameter counts as the model repositories report them (safetensors totals, which include
# the few biases diag leaves out), and the GPT-3 paper's 175B.
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama2-70b": 68_976_648_192, "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
    "gpt2": 124_439_808, "gpt3-175b": 175e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_count_their_published_parameters(name):
    assert preset(name).params() == pytest.approx(PUBLISHED[name], rel=0.003 if name.startswith("gpt") else 1e-6)


@pytest.mark.parametrize("config, published", [
    ("qwen2.5-32b.json", 32_763_876_352),  # includes the q/k/v biases: 64 x 7,168
    ("gemma-2-9b.json", 9_241_705_984),    # tied embeddings, head_dim 256 (not hidden / heads)
])
def test_hugging_face_configs_count_their_published_parameters(config, published):
    m = from_hf_config(FIXTURES / "hf_configs" / config)
    assert m.params() == pytest.approx(published, rel=1e-4)


def test_shape_flags_and_the_gated_mlp_default():
    m = from_shape(layers=32, hidden=4096, heads=32, seq=4096, kv_heads=8, ffn=14336, vocab=32000)
    assert m.params() == PRESETS["mistral-7b"].params()
    assert from_shape(2, 4096, 32, 128).ffn == 11008  # LLaMA's 8/3 x hidden, to a multiple of 256


@pytest.mark.parametrize("call, words", [
    (lambda: preset("llama9-1t"), "unknown model preset"),
    (lambda: from_shape(32, 4096, 30, 4096), "not divisible"),
    (lambda: from_shape(32, 4096, 32, 4096, kv_heads=6), "cannot be grouped"),
    (lambda: from_shape(0, 4096, 32, 4096), "must be positive"),
])
def test_impossible_shapes_are_one_line_errors(call, words):
    with pytest.raises(DiagInputError, match=words) as exc:
        call()
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("content, words", [
    ("{not json", "not a readable config.json"),
    ("[1, 2]", "not a model configuration"),
    (json.dumps({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}), "no layers in the config"),
    (b"\xff\xfe", "not a readable config.json"),
])
def test_malformed_config_files_are_one_line_errors(tmp_path, content, words):
    p = tmp_path / "config.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DiagInputError, match=words) as exc:
        from_hf_config(p)
    assert "\n" not in str(exc.value)
    with pytest.raises(DiagInputError, match="no such config file"):
        from_hf_config(tmp_path / "missing.json")
