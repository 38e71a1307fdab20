"""`diag compare` grades the prediction made on BEFORE: the DataLoader worker count AFTER ran,
read from both runs' recorded settings, against the range the loader model gave; nothing is
inferred without such a record, and runs that train different jobs are not graded."""

from __future__ import annotations

import pytest
from merged_ranks import merged

from diag.analyzers.analysis_types import Analysis, analysis_from_json, rank_document
from diag.analyzers.diagnosis import change, run_figures
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.gate import graded_prediction
from diag.diagnosis_document import Diagnosis

TREE = dt.load_tree()
LOADER = {"class": "DataLoader", "dataset": "Shards", "num_workers": 0, "batch_size": 8, "cpus": 8, "local_ranks": 1}


def _doc(workers: int, wait: float, rest: float = 10.0, n: int = 30, model_params: int = 1000) -> Analysis:
    steps = [{"step": k, "duration_ms": wait + rest, "data_wait_ms": wait, "cpu_ms": rest + 0.5, "data_cpu_ms": 0.5,
              "evidence": "sampled", "samples": 8} for k in range(n)]
    return analysis_from_json({"ranks": [{"rank": 0, "steps": steps, "loader": {**LOADER, "num_workers": workers},
                                          "model": {"class": "Net", "params": model_params}}]})


def test_the_worker_count_after_ran_is_graded_against_the_range():
    before = _doc(0, wait=100.0)
    c = change.loader_check(before, _doc(8, wait=2.5), TREE)
    # 8 workers make a 100 ms batch every 12.5 ms, above the 10 ms rest of the step.
    assert c["change"] == "num_workers 0 -> 8" and c["kind"] == "action" and not c["inferred"]
    assert c["expected_step_ms"] == pytest.approx(12.5) and c["measured_step_ms"] == pytest.approx(12.5)
    assert c["error"] == pytest.approx(0.0) and c["within_range"]
    far = change.loader_check(before, _doc(8, wait=40.0), TREE)
    assert far["error"] == pytest.approx(12.5 / 50.0 - 1) and not far["within_range"]
    assert "outside the predicted range" in far["text"]


def test_no_change_is_inferred_without_a_record():
    same = change.loader_check(_doc(0, wait=100.0), _doc(0, wait=20.0), TREE)
    assert same is None  # the data wait fell, but no setting changed
    model = Diagnosis(what_if={"changes": [{"change": "no_data_wait", "description": "d", "baseline_step_ms": 110.0,
                                            "predicted_step_ms": 10.0, "speedup": 11.0, "fixes": "data"}]})
    # The data wait fell by 80 ms a step, with nothing recorded that changed: nothing is graded.
    assert graded_prediction(_doc(0, 100.0), model, _doc(0, 20.0), model, None, TREE) is None
    named = graded_prediction(_doc(0, 100.0), model, _doc(0, 20.0), model, "no_data_wait", TREE)
    assert named["change"] == "no_data_wait" and named["kind"] == "ceiling"


def _diagnosis(doc: Analysis) -> Diagnosis:
    """The diagnosis's run figures of a document: what identifies the run."""
    ranks = merged({r.rank: {"analysis": rank_document(r)} for r in doc.ranks})
    return Diagnosis(run_figures={"identity": run_figures.identity(ranks, len(ranks))})


def test_runs_that_train_different_jobs_are_not_graded():
    before, after = _doc(0, 100.0), _doc(8, 2.5, model_params=2000)
    c = graded_prediction(before, _diagnosis(before), after, _diagnosis(after), None, TREE)
    assert c["kind"] == "refused" and c["error"] is None
    assert "model: Net with 1,000 parameters before, Net with 2,000 parameters after" in c["text"]
