"""Cause rules above and below their thresholds (the real runs that name them: tests/test_demo.py)."""

from __future__ import annotations

import types

import pytest

from diag.analyzers.diagnosis import causes as cs
from diag.analyzers.diagnosis import decision_tree as dt


def _ctx(ranks: dict, bound="host", shares=None):
    return types.SimpleNamespace(ranks=ranks, tree=dt.load_tree(), bound=bound,
                                 shares=shares or {"host": 0.6, "data": 0.05, "compute": 0.35})


def _rank(item_calls: int, traced: int = 2, loader=None):
    return {"analysis": {"steps": [{"step": k, "evidence": "trace"} for k in range(traced)]
                         + [{"step": 9, "evidence": "sampled"}],
                         "top_ops": [{"name": "aten::item", "count": item_calls, "time_ms": 1.0},
                                     {"name": "aten::addmm", "count": 40, "time_ms": 9.0}],
                         "loader": loader}}


@pytest.mark.parametrize("per_step,named", [(15, False), (16, True)])
def test_sync_points_are_named_from_the_threshold(per_step, named):
    assert dt.load_tree().thresholds["sync_points_per_step"] == 16
    found = cs.causes(_ctx({0: _rank(2 * per_step)}))  # two traced steps
    assert [c["id"] for c in found] == (["host_sync_points"] if named else [])
    if named:
        assert found[0]["evidence"]["per_step"] == per_step and "aten::item 16 times" in found[0]["text"]


LOADER = {"class": "DataLoader", "dataset": "Shards", "num_workers": 0, "batch_size": 8, "pin_memory": False,
          "prefetch_factor": None, "persistent_workers": False, "cpus": 16, "local_ranks": 4}


@pytest.mark.parametrize("data_share,named", [(0.09, False), (0.10, True)])
def test_a_cause_is_named_only_for_a_phase_that_matters(data_share, named):
    assert dt.load_tree().thresholds["recommendation_min_share"] == 0.10
    ctx = _ctx({0: _rank(0, loader=LOADER)}, bound="compute",
               shares={"data": data_share, "compute": 1 - data_share})
    found = cs.causes(ctx)
    assert [c["id"] for c in found] == (["data_loader_no_workers"] if named else [])
    if named:
        # 16 CPUs for 4 local ranks: 4 per rank, one left to the training process.
        assert "start at num_workers=3 (16 CPUs for 4 local ranks" in found[0]["action"]
        assert "DataLoader over Shards" in found[0]["text"]


def test_a_loader_with_workers_is_no_cause():
    ctx = _ctx({0: _rank(0, loader={**LOADER, "num_workers": 4})}, bound="data", shares={"data": 0.9})
    assert cs.causes(ctx) == []
