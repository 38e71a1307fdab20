"""The one rule on the pace-setting rank (diagnosis/pace.py), at its threshold, and the two
judgements that use it: the job verdict's measurement set and `diag top`'s pace rank."""

from __future__ import annotations

import pytest

from diag.analyzers.analysis_types import Job, document_ranks
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.pace import pace_setter
from diag.analyzers.diagnosis.verdict import job_verdict


@pytest.mark.parametrize("lead,named", [(3.0, False), (3.001, True)])
def test_the_longest_pace_sets_it_only_beyond_both_noise_bands(lead, named):
    """Rank 2 leads the others' median (100 ms) by `lead`; its band is 1 ms and theirs 2 ms."""
    paces = {0: 100.0, 1: 100.0, 2: 100.0 + lead}
    bands = {0: 2.0, 1: 2.0, 2: 1.0}
    assert pace_setter(paces, bands) == (2 if named else None)


def test_one_rank_or_equal_paces_set_no_pace_and_ties_go_to_the_lower_rank():
    assert pace_setter({0: 100.0}, {}) is None
    assert pace_setter({0: 100.0, 1: 100.0}, {}) is None
    assert pace_setter({3: 120.0, 1: 120.0, 0: 100.0, 2: 100.0}, {}) == 1


def _rank(rank: int, step_ms: list[float], wait: float, bound: str) -> dict:
    shares = {"data": 0.0, "host": 0.1, "comm": 0.2 - wait, "wait": wait, "memory": 0.1, "compute": 0.6}
    return {"rank": rank, "bound": bound, "shares": shares, "device": "cpu",
            "measurements": {f"{c}_share": v for c, v in shares.items()} | {"memory_to_compute": 1 / 6},
            "steps": [{"step": k, "duration_ms": d, "shares": shares, "evidence": "trace"}
                      for k, d in enumerate(step_ms)]}


def _waits(*ranks: int) -> list[dict]:
    return [{"rank": r, "collectives": 4, "wait_ms": 1.0} for r in ranks]


@pytest.mark.parametrize("wait_0,paced", [(0.02, [0]), (0.0, [0, 1])])
def test_the_job_verdict_is_measured_on_the_pace_setting_rank(wait_0, paced):
    """Both ranks' steps last 100 ms (a synchronised job); rank 1 waits 10% of it for rank 0.
    Rank 0, waiting 2%, works 8 ms more per step, far beyond the steps' scatter: it sets the
    pace and the verdict is measured on it alone. Waiting as long as rank 1, it leads by
    nothing: both ranks count."""
    steps = [100.0, 100.5, 99.5, 100.2, 99.8, 100.1]
    ranks = [_rank(0, steps, wait_0 if wait_0 else 0.1, "compute"), _rank(1, steps, 0.1, "compute")]
    job = job_verdict(document_ranks({"ranks": ranks}), Job(rank_waits=_waits(0, 1)), dt.load_tree())
    assert job.measurements["ranks"] == paced
    assert ("pace" in job.measurements) == (len(paced) == 1)


def test_without_measured_waits_every_rank_counts():
    steps = [100.0, 100.5, 99.5, 100.2]
    ranks = [_rank(0, steps, 0.02, "compute"), _rank(1, steps, 0.1, "compute")]
    job = job_verdict(document_ranks({"ranks": ranks}), Job(), dt.load_tree())
    assert job.measurements["ranks"] == [0, 1]
