"""Each of the five bounds, induced by a real CPU workload under torch.profiler, gets its verdict.

The committed fixtures come from tests/fixtures/make_cpu_traces.py; one bound is also
regenerated live here, so a change in torch's trace format cannot leave them stale.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from conftest import FIXTURES
from rank_documents import trace_rank

from diag.analyzers.diagnosis.decision_tree import CLASSES

CASES = [
    ("data", 0),
    ("comm", 0),
    ("comm", 1),
    ("compute", 0),
    ("memory", 0),
    ("host", 0),
]


def _fixture(bound: str, rank: int):
    return FIXTURES / f"cpu_{bound}_rank{rank}.pt.trace.json.gz"


def _check_rank(rank: dict, bound: str) -> None:
    assert rank["device"] is not None
    assert rank["steps"], "no steps analysed"
    for step in rank["steps"]:
        shares = step["shares"]
        assert set(shares) == set(CLASSES)
        assert all(0.0 <= v <= 1.0 for v in shares.values()), shares
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        assert step["path"], "each step carries its decision path"
    verdicts = [s["bound"] for s in rank["steps"]]
    assert rank["bound"] == bound, (rank["bound"], verdicts, [s["shares"] for s in rank["steps"]])
    # The verdict holds for most steps, not only on average.
    assert verdicts.count(bound) * 2 > len(verdicts), verdicts


@pytest.mark.parametrize(("bound", "rank"), CASES, ids=[f"{b}-rank{r}" for b, r in CASES])
def test_fixture_gives_intended_bound(bound, rank):
    path = _fixture(bound, rank)
    assert path.stat().st_size < 200_000
    result = trace_rank(str(path))
    assert result["rank"] == rank
    _check_rank(result, bound)


def test_fixtures_are_small_and_complete():
    for bound, rank in CASES:
        assert _fixture(bound, rank).stat().st_size < 200_000
    assert {p.name for p in FIXTURES.glob("cpu_*.pt.trace.json.gz")} >= {
        _fixture(b, r).name for b, r in CASES
    }


def test_cli_json_on_the_two_rank_gloo_job():
    paths = [_fixture("comm", 0), _fixture("comm", 1)]
    proc = subprocess.run(
        [sys.executable, "-m", "diag", "analyze", "--json", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "diag.analysis/1"
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]
    for rank in doc["ranks"]:
        assert rank["source"].endswith(paths[rank["rank"]].name)
        _check_rank(rank, "comm")
    # Equal ranks moving large gradients: the network, not a late rank, bounds the job.
    job = doc["job"]
    assert job["bound"] == "comm" and job["world_size"] == 2
    assert job["stragglers"] == []
    assert "slow_collectives" in [f["id"] for f in job["findings"]]


def test_live_compute_run_matches_fixture_verdict(tmp_path):
    """Regenerate the compute-bound trace with today's torch and check the verdict."""
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    gen = importlib.import_module("make_cpu_traces")
    (path,) = gen.profile_compute(tmp_path)
    result = trace_rank(str(path))
    assert len(result["steps"]) == gen.ACTIVE
    _check_rank(result, "compute")
