"""The optimizer's step as a cause: which optimizer, how it is implemented (fused, foreach,
for-loop) and what it costs, on real traces and real CPU profiler runs; and chains of
elementwise ops that compute a softmax or a normalisation by hand."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from rank_documents import ranks_of
from torch.profiler import profile, schedule

from diag.analyzers.analyze import analyze_paths
from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.trace.analysis import trace_facts
from tests.test_causes import _ctx

# What the analysis measures by under the default tree.
FACTS = load_tree().facts

RESNET = "v100_resnet50_workers0_oldschema.json.gz"


def _events(path):
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def test_a_for_loop_sgd_is_named_on_a_real_v100_resnet_trace(real_data):
    """The 2021 ResNet-50 trace steps SGD one parameter at a time: its ops and their kernels
    inside the Optimizer.step spans are the file's own."""
    path = real_data / "traces" / RESNET
    doc = analyze_paths([str(path)], jobs=1)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "optimizer_step"]
    events = _events(path)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    spans = [e for e in events if e["name"] == "Optimizer.step#SGD.step" and any(lo <= e["ts"] < hi for lo, hi in steps)]
    ops = [e for e in events if e.get("cat") == "Operator" and e["name"] != "Optimizer.step#SGD.step"
           and any(s["tid"] == e["tid"] and s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in spans)]
    ext = {e["args"]["External id"] for e in ops}
    kernels = [e for e in events if e.get("cat") == "Kernel" and e["args"].get("external id") in ext]
    ev = cause["evidence"]
    assert ev["name"] == "SGD" and ev["implementation"] == "for-loop"
    assert ev["ops_per_step"] == pytest.approx(len(ops) / len(steps))
    assert ev["kernels_per_step"] == pytest.approx(len(kernels) / len(steps))
    assert ev["ms_per_step"] == pytest.approx(sum(s["dur"] for s in spans) / 1e3 / len(steps), rel=1e-3)
    assert "torch.optim.SGD(params, ..., fused=True)" in cause["action"] and "foreach=True" in cause["action"]


def test_a_foreach_sgd_on_a_real_a100_trace_is_told_to_fuse(real_data):
    doc = analyze_paths([str(real_data / "traces" / "a100_2rank_nccl.json.gz")], jobs=1)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "optimizer_step"]
    assert cause["evidence"]["implementation"] == "foreach" and "foreach=True" not in cause["action"]


def test_a_cheap_optimizer_is_no_cause_on_a_real_v100_trace(real_data):
    doc = analyze_paths([str(real_data / "traces" / "v100_1rank_compute.json.gz")], jobs=1)
    opt = ranks_of(doc)[0]["optimizer"]
    assert opt["name"] == "SGD" and opt["implementation"] == "foreach"
    assert "optimizer_step" not in {c["id"] for c in doc.diagnosis.causes}


def _opt_rank(ms, name="AdamW", impl="for-loop", ops=400.0):
    opt = {"name": name, "implementation": impl, "calls_per_step": 1.0, "ms_per_step": ms, "ops_per_step": ops,
           "kernels_per_step": 400.0, "kernel_ms_per_step": ms / 2}
    return {"analysis": {"steps": [{"step": 0, "evidence": "trace", "duration_ms": 100.0}], "optimizer": opt}}


@pytest.mark.parametrize("ms,named", [(4.9, False), (5.1, True)])
def test_an_optimizer_from_five_percent_of_the_step(ms, named):
    assert dt.load_tree().thresholds["optimizer_step_share"] == 0.05
    found = cs.causes(_ctx({0: _opt_rank(ms)}))
    assert [c["id"] for c in found] == (["optimizer_step"] if named else [])


@pytest.mark.parametrize("ops,named", [(7.0, False), (8.0, True)])
def test_a_for_loop_over_a_few_tensors_has_nothing_to_fuse(ops, named):
    """The host demo's SGD loops over 2 tensors for 5% of its step: its cost is the update itself."""
    assert dt.load_tree().thresholds["optimizer_min_loop_ops"] == 8
    found = cs.causes(_ctx({0: _opt_rank(50.0, impl="for-loop", ops=ops)}))
    assert [c["id"] for c in found] == (["optimizer_step"] if named else [])
    assert [c["id"] for c in cs.causes(_ctx({0: _opt_rank(50.0, impl="foreach", ops=1.0)}))] == ["optimizer_step"]


def test_a_fused_optimizer_is_never_named_and_others_are_compiled():
    assert cs.causes(_ctx({0: _opt_rank(50.0, impl="fused")})) == []
    (cause,) = cs.causes(_ctx({0: _opt_rank(50.0, name="Shampoo", impl="foreach")}))
    assert "torch.compile(optimizer.step)" in cause["action"] and "fused=True" not in cause["action"]


def _sgd_trace(tmp_path, **kwargs):
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **kwargs)
    x = torch.randn(8, 16)
    path = tmp_path / f"sgd-{'-'.join(kwargs)}.json"
    with profile(schedule=schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return trace_facts(str(path), FACTS).causes.optimizer


@pytest.mark.parametrize("kwargs,impl", [({"foreach": False}, "for-loop"), ({"foreach": True}, "foreach"),
                                          ({"fused": True}, "fused")])
def test_the_implementation_is_read_from_a_real_cpu_run(tmp_path, kwargs, impl):
    opt = _sgd_trace(tmp_path, **kwargs)
    assert opt["name"] == "SGD" and opt["implementation"] == impl and opt["calls_per_step"] == 1.0


def test_a_hand_written_softmax_chain_is_told_its_fused_op(tmp_path):
    """A real CPU run whose step is a softmax written out op by op."""
    x = torch.randn(256, 4096)
    path = tmp_path / "softmax.json"
    with profile(schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            for _ in range(4):
                e = torch.exp(x - x.amax(dim=-1, keepdim=True))
                y = e / e.sum(dim=-1, keepdim=True)
            y.sum()
            prof.step()
    doc = analyze_paths([str(path)], jobs=1)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "elementwise_chain"]
    assert {"aten::exp", "aten::sum", "aten::div"} <= set(cause["evidence"]["ops"])
    assert "compute a softmax by hand: torch.softmax(x, dim) does it in one kernel" in cause["action"]
