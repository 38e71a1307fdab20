"""Micro-batches per optimizer step under DDP, from a real profiler run of a gloo DDP loop:
the forward passes and optimizer steps the trace holds, and the replay of no_sync() on all
but the last micro-batch taking exactly the all-reduces it leaves out off the step."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.profiler import profile

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.trace.analysis import trace_facts
from tests.conftest import free_port_pair

# What the analysis measures by under the default tree.
FACTS = load_tree().facts


def _ddp_trace(path, micro: int, no_sync: bool) -> None:
    """Three optimizer steps of a one-rank gloo DDP loop, each over `micro` micro-batches."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256)
        with profile() as prof:
            for step in range(3):
                with torch.autograd.profiler.record_function(f"ProfilerStep#{step}"):
                    for k in range(micro):
                        quiet = no_sync and k < micro - 1
                        with model.no_sync() if quiet else torch.autograd.profiler.record_function("pass"):
                            model(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
        prof.export_chrome_trace(str(path))
    finally:
        dist.destroy_process_group()


def _events(path) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _count(path, pred) -> int:
    return sum(1 for e in _events(path) if pred(str(e.get("name"))))


def _sum_dur(path, name: str) -> float:
    """The µs of the trace's spans of this name (gloo records each collective as one)."""
    return sum(float(e["dur"]) for e in _events(path) if e.get("name") == name)


@pytest.mark.parametrize("micro", [1, 3])
def test_forward_passes_per_optimizer_step_are_the_traces_own(tmp_path, micro):
    path = tmp_path / "ddp.json"
    _ddp_trace(path, micro, no_sync=False)
    facts = trace_facts(str(path), FACTS)
    forwards = _count(path, lambda n: n == "DistributedDataParallel.forward")
    steps = _count(path, lambda n: n.startswith("Optimizer.step#"))
    assert (forwards, steps) == (3 * micro, 3)
    assert facts.causes.accumulation == {"forwards_per_step": forwards / 3, "optimizer_steps_per_step": steps / 3}
    entry = next(e for e in facts.what_if if e["change"] == "ddp_no_sync_accumulation")
    # Only a loop that all-reduces more often than it steps has all-reduces to leave out.
    assert (entry["predicted_step_ms"] is not None) is (micro > 1)


def test_the_no_sync_replay_takes_off_the_all_reduces_it_leaves_out(tmp_path):
    """Three micro-batches a step: no_sync() on the first two leaves out two of every three
    gradient all-reduces; the replayed step (a median over steps) is shorter, by at most two
    thirds of the all-reduce time of the step that spent the most in them."""
    path = tmp_path / "ddp.json"
    _ddp_trace(path, 3, no_sync=False)
    facts = trace_facts(str(path), FACTS)
    entry = next(e for e in facts.what_if if e["change"] == "ddp_no_sync_accumulation")
    per_step: dict[int, float] = {}
    for c in facts.causes.collectives:
        if "all_reduce" in c["name"] and isinstance(c.get("step"), int):
            per_step[c["step"]] = per_step.get(c["step"], 0.0) + c["dur_us"]
    assert len(per_step) == 3 and sum(per_step.values()) == pytest.approx(_sum_dur(path, "gloo:all_reduce"))
    saved_ms = entry["baseline_step_ms"] - entry["predicted_step_ms"]
    assert 0 < saved_ms <= 2 / 3 * max(per_step.values()) / 1e3 * 1.001
