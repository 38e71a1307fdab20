"""Advice that rests on lower precision is withheld where the ranks compute on a CPU without
bf16 matrix units, in every part of the diagnosis (analyzers/diagnosis/precision.py); kept on
a CPU with them and on a device. The default demo's views: tests/test_readme.py."""

from __future__ import annotations

import pytest
from merged_ranks import merged

from diag.analyzers.analysis_types import Job
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.precision import cpu_without_bf16_units, withhold_half_precision

TREE = dt.load_tree()
JOB = Job(what_if=[
    {"change": "compute_2x", "baseline_step_ms": 100.0, "predicted_step_ms": 60.0, "speedup": 1.67, "fixes": "compute"},
    {"change": "half_precision_matrix_ops", "baseline_step_ms": 100.0, "predicted_step_ms": 70.0, "speedup": 1.43,
     "fixes": "compute"},
    {"change": "no_data_wait", "baseline_step_ms": 100.0, "predicted_step_ms": 90.0, "speedup": 1.11, "fixes": "data"},
])


def _rank(bf16_units, vendor=None, timeline=None):
    return {"analysis": {"timeline": timeline} if timeline else {},
            "info": {"cpu": {"isa": "AVX2", "bf16_units": bf16_units}, "device": {"vendor": vendor}}}


@pytest.mark.parametrize("ranks,isa", [
    ({0: _rank(False), 1: _rank(False)}, "AVX2"),
    ({0: _rank(True)}, None),  # AMX or AVX512-BF16: bf16 pays
    ({0: _rank(None)}, None),  # not known: nothing withheld
    ({0: _rank(False, vendor="NVIDIA")}, None),  # the matrix math runs on the device
    ({0: _rank(False, timeline="device")}, None),
])
def test_which_jobs_lack_bf16_units(ranks, isa):
    assert cpu_without_bf16_units(merged(ranks)) == isa


def test_the_precision_changes_and_fixes_are_withheld_with_the_reason():
    job, tree = withhold_half_precision(JOB, TREE, "AVX2")
    by_id = {e["change"]: e for e in job.what_if}
    for change in ("compute_2x", "half_precision_matrix_ops"):
        assert by_id[change]["predicted_step_ms"] is None and by_id[change]["speedup"] is None
        assert by_id[change]["note"].startswith("withheld: this CPU (AVX2) has no bf16 matrix units")
    assert by_id["no_data_wait"]["predicted_step_ms"] == 90.0  # not a precision change
    fixes = [f for v in tree.verdicts.values() for f in v["fixes"]]
    assert not [f for f in fixes if f.startswith(("Use lower precision", "Keep matrix dimensions", "Train in bf16"))]
    assert "Fuse elementwise chains with torch.compile." in tree.verdicts["memory"]["fixes"]
    assert JOB.what_if[0]["predicted_step_ms"] == 60.0 and "Use lower precision" in \
        TREE.verdicts["compute"]["fixes"][0]  # inputs unchanged


def test_nothing_is_withheld_where_bf16_pays():
    assert withhold_half_precision(JOB, TREE, None) == (JOB, TREE)


def test_the_tree_names_only_changes_it_has():
    known = {c["id"] for c in TREE.what_if}
    assert set(TREE.needs_half_precision["what_if"]) <= known
    starts = tuple(TREE.needs_half_precision["fixes"])
    # Each start matches a fix of some verdict: a renamed fix would slip through otherwise.
    assert all(any(f.startswith(s) for v in TREE.verdicts.values() for f in v["fixes"]) for s in starts)
