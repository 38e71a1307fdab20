"""The job's own call sites of ops, from real torch.profiler traces recorded with Python stacks."""

from __future__ import annotations

import numpy as np
import torch
from torch.profiler import profile, schedule

from diag.analyzers.analysis_types import SYNC_OP_NAMES
from diag.analyzers.trace.analysis import step_windows
from diag.analyzers.trace.call_sites import call_sites
from diag.analyzers.trace.load import load_trace

STEPS = 3


def log_metrics(values: torch.Tensor) -> float:
    return sum(v.item() for v in values)  # one value to the host per element


def _trace(tmp_path, with_stack: bool):
    path = tmp_path / f"stack-{with_stack}.json"
    values = torch.arange(6.0)
    with profile(with_stack=with_stack, schedule=schedule(wait=0, warmup=1, active=STEPS),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(STEPS + 1):
            log_metrics(values)
            torch.ones(4).nonzero()  # from this test function itself
            prof.step()
    trace = load_trace(str(path))
    win = np.array([[lo, hi] for _, lo, hi in step_windows(trace)])
    return call_sites(trace, win, SYNC_OP_NAMES)


def test_the_calls_are_named_by_the_jobs_own_function(tmp_path):
    sites = _trace(tmp_path, with_stack=True)
    by_function = {s["function"]: s for s in sites}
    # Six .item() calls per step from log_metrics (its generator expression is its own frame),
    # at the line where Python says the function starts.
    item = by_function.get("<genexpr>") or by_function["log_metrics"]
    assert item["calls_per_step"] == 6 and item["file"].endswith("test_call_sites.py")
    assert item["line"] in range(log_metrics.__code__.co_firstlineno, log_metrics.__code__.co_firstlineno + 2)
    # A frame already running when the window starts is named at the line it was on then.
    nonzero = by_function["_trace"]
    first = _trace.__code__.co_firstlineno
    assert nonzero["calls_per_step"] == 1 and first <= nonzero["line"] <= first + 12
    # Neither torch's frames nor the standard library's are the job's.
    assert not any(s["file"].startswith(("torch/", "<")) for s in sites)


def test_a_trace_without_stacks_has_no_call_sites(tmp_path):
    assert _trace(tmp_path, with_stack=False) == []
