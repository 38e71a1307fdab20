"""diag.count_samples: the samples of the common batch shapes, and the agent saying once when
the samples passed are len() of an (inputs, labels) batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import diag


@pytest.mark.parametrize("batch,n", [
    (torch.zeros(32, 3), 32),
    ((torch.zeros(16, 3, 8, 8), torch.zeros(16, dtype=torch.long)), 16),
    ([torch.zeros(4, 2), torch.zeros(4)], 4),
    ({"input_ids": torch.zeros(8, 128), "attention_mask": torch.zeros(8, 128)}, 8),
    ({"image": {"pixels": np.zeros((6, 3))}, "label": [1] * 6}, 6),
    (["a sentence", "another"], 2),
    (torch.tensor(3.0), None),  # a scalar holds no samples
    (42, None),
    ({}, None),
])
def test_count_samples_reads_the_first_tensor_of_a_batch(batch, n):
    assert diag.count_samples(batch) == n


def test_the_agent_says_once_that_len_counts_the_parts_of_a_batch(tmp_path):
    logs = []
    batches = [(torch.randn(32, 8), torch.zeros(32)) for _ in range(5)]
    agent = diag.Agent(run_dir=tmp_path / "run", export=False, profile=False, report=False, verbose=False)
    agent._log = logs.append
    with agent:
        for batch in agent.loader(batches):
            agent.step(samples=len(batch))
    said = [m for m in logs if "len(batch) counts the parts" in m]
    assert len(said) == 1 and "hold 32 samples" in said[0] and "diag.count_samples(batch)" in said[0]
    logs.clear()
    agent = diag.Agent(run_dir=tmp_path / "run2", export=False, profile=False, report=False, verbose=False)
    agent._log = logs.append
    with agent:
        for batch in agent.loader(batches):
            agent.step(samples=diag.count_samples(batch))
    assert not [m for m in logs if "len(batch)" in m]
