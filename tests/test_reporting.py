"""The one rule on ranks missing from a job and ranks that stopped reporting before it ended
(analyzers/diagnosis/reporting.py), above and below its threshold, on the facts the run
analysis gives (job.reports)."""

from __future__ import annotations

import pytest

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.reporting import missing_finding, stopped_ranks

TREE = load_tree()
SILENT = TREE.thresholds["rank_silent_s"]


def _reports(*rows, run_closed=False, ended_unix=None):
    full = [{"rank": i, "readable": True, "status": "running", "closed": False, "last_heartbeat_unix": 1000.0,
             "last_step": 10, "host": "n1", **row} for i, row in enumerate(rows)]
    return {"run_closed": run_closed, "ended_unix": ended_unix, "ranks": full}


@pytest.mark.parametrize("older_by,stopped", [(SILENT - 1, []), (SILENT + 1, [1])])
def test_a_running_rank_stops_when_its_heartbeat_is_older_than_the_newest_by_the_threshold(older_by, stopped):
    reports = _reports({"last_heartbeat_unix": 1000.0 + older_by}, {"last_heartbeat_unix": 1000.0})
    assert [x["rank"] for x in stopped_ranks(reports, TREE)] == stopped


def test_once_the_job_is_over_a_rank_that_never_closed_stopped():
    closed_peer = _reports({"status": "completed", "closed": True}, {})
    (x,) = stopped_ranks(closed_peer, TREE)
    assert (x["rank"], x["reason"], x["last_step"], x["host"]) == (1, "stopped reporting", 10, "n1")
    assert [x["rank"] for x in stopped_ranks(_reports({}, {}, run_closed=True), TREE)] == [0, 1]
    # The job's end counts as its newest report.
    assert [x["rank"] for x in stopped_ranks(_reports({}, ended_unix=1000.0 + SILENT + 1), TREE)] == [0]


def test_a_closed_rank_never_stopped_and_an_unreadable_one_did():
    reports = _reports({"status": "failed", "closed": True, "last_heartbeat_unix": 0.0},
                       {"readable": False, "status": None, "last_heartbeat_unix": None})
    assert [(x["rank"], x["reason"]) for x in stopped_ranks(reports, TREE)] == [(1, "no rank.json")]
    assert stopped_ranks(None, TREE) == [] and stopped_ranks({"ranks": "x"}, TREE) == []


def test_ranks_that_left_no_data_are_one_warning():
    assert missing_finding([], 8) is None
    f = missing_finding([2, 3, 4, 7], 8)
    assert f["id"] == "missing_ranks" and f["severity"] == "warning"
    assert f["message"].startswith("4 of 8 ranks left no data (ranks 2-4, 7)")
