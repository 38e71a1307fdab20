"""Counts a step cannot hold (samples=1e30, NaN, negative, text) are left out of throughput:
by the agent as the job passes them (said once), and by the reader of a run directory
(noted); a NumPy scalar or a tensor stays a count."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import diag
from diag import rundir, step_record


@pytest.mark.parametrize("value,ok", [(None, True), (0, True), (32, True), (1e9, True), (np.int64(16), True),
                                      (1e9 + 1, False), (1e30, False), (-1, False), (float("nan"), False),
                                      (float("inf"), False), (True, False), ("16", False), ([16], False)])
def test_a_step_count_is_plausible_from_zero_to_its_bound(value, ok):
    assert step_record.MAX_STEP_COUNTS["samples"] == 1e9
    assert step_record.plausible_count(value, "samples") is ok


def test_the_agent_leaves_an_implausible_count_out_and_says_so_once(tmp_path):
    logs = []
    agent = diag.Agent(run_dir=tmp_path / "run", export=False, profile=False, report=False, verbose=False)
    agent._log = logs.append
    with agent:
        for i in range(6):
            agent.step(samples=1e30 if i % 2 else 32, tokens=torch.tensor(64) if i == 0 else None)
    steps = rundir.RunDir(tmp_path / "run").steps(0)
    assert [s.samples for s in steps] == [32, None, 32, None, 32, None]
    assert steps[0].tokens == 64  # a tensor is read when the record is written
    said = [m for m in logs if "agent.step(samples=1e+30)" in m]
    assert len(said) == 1 and "left out" in said[0]


def test_the_reader_leaves_out_a_planted_count_and_notes_it(tmp_path):
    seg = tmp_path / "run" / "rank-00000" / "steps"
    seg.mkdir(parents=True)
    records = ({"step": 0, "duration_s": 0.1, "samples": 32}, {"step": 1, "duration_s": 0.1, "samples": 1e30},
               {"step": 2, "duration_s": 0.1, "samples": 32, "tokens": -5})
    (seg / "steps-000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = rundir.RunDir(tmp_path / "run")
    steps = run.steps(0)
    assert [s.samples for s in steps] == [32, None, 32] and steps[2].tokens is None
    assert any("1e+30 samples" in p for p in run.problems) and any("-5 tokens" in p for p in run.problems)
