"""The memory formulas against the figures their papers publish."""

from __future__ import annotations

import pytest

from diag.analyzers.plan.memory import activations_per_layer, model_states, zero_stage
from diag.errors import DiagInputError

GB = 1e9


@pytest.mark.parametrize("stage, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_of_7_5b_on_64_gpus(stage, published_gb):
    """ZeRO (SC'20), Figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision Adam."""
    got = model_states(7.5e9, "bf16-mixed", "adam", stage, dp=64).total_bytes / GB
    assert got == pytest.approx(published_gb, rel=0.02)


def test_fsdp_names_are_zero_stages():
    assert zero_stage("fsdp-full") == 3 and zero_stage("fsdp-grad-op") == 2
    full = model_states(7.5e9, "bf16-mixed", "adam", "fsdp-full", dp=64)
    assert full == model_states(7.5e9, "bf16-mixed", "adam", 3, dp=64)
    # Tensor and pipeline parallelism divide what a GPU holds before data-parallel sharding.
    assert model_states(7.5e9, tp=2, pp=4).total_bytes == pytest.approx(120e9 / 8)


def test_adam_state_is_twelve_bytes_in_mixed_precision_and_eight_in_fp32():
    mixed, fp32 = model_states(1e9, "bf16-mixed", "adamw"), model_states(1e9, "fp32", "adamw")
    assert mixed.optimizer_bytes == 12e9 and mixed.params_bytes == mixed.grads_bytes == 2e9
    assert fp32.optimizer_bytes == 8e9 and fp32.params_bytes == fp32.grads_bytes == 4e9


# GPT-3 175B in Korthikanti et al. (MLSys 2023): s = 2048, h = 12288, a = 96, t = 8, b = 1.
GPT3 = {"seq": 2048, "micro_batch": 1, "hidden": 12288, "heads": 96, "tp": 8}
SBH = 2048 * 1 * 12288


@pytest.mark.parametrize("sp, recompute, per_sbh", [
    (False, "none", 10 + 24 / 8 + 5 * 96 * 2048 / (12288 * 8)),  # tensor parallel: 23 sbh
    (True, "none", (34 + 5 * 96 * 2048 / 12288) / 8),           # + sequence parallel: 14.25 sbh
    (False, "selective", 10 + 24 / 8),                          # selective recomputation
    (True, "selective", 34 / 8),                                # both
    (False, "full", 2.0),                                       # full recomputation: the input
    (True, "full", 2.0 / 8),
])
def test_activation_memory_per_layer_of_gpt3(sp, recompute, per_sbh):
    assert activations_per_layer(**GPT3, sp=sp, recompute=recompute) == pytest.approx(per_sbh * SBH)


def test_sequence_parallel_and_selective_recompute_save_about_5x():
    """The paper's headline: the two together reduce activation memory by about 5x."""
    plain = activations_per_layer(**GPT3)
    both = activations_per_layer(**GPT3, sp=True, recompute="selective")
    assert 5.0 <= plain / both <= 6.0
    assert activations_per_layer(2048, 1, 12288, 96) == pytest.approx(SBH * (34 + 5 * 96 * 2048 / 12288))


@pytest.mark.parametrize("call", [
    lambda: model_states(1e9, sharding="4"),
    lambda: model_states(1e9, precision="int4"),
    lambda: model_states(1e9, optimizer="lion"),
    lambda: model_states(0),
    lambda: activations_per_layer(2048, 1, 12288, 96, recompute="some"),
    lambda: activations_per_layer(2048, 0, 12288, 96),
])
def test_bad_input_is_a_one_line_error(call):
    with pytest.raises(DiagInputError) as exc:
        call()
    assert "\n" not in str(exc.value)
