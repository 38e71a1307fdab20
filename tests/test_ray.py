"""`diag analyze --ray`: the per-trace analyses as tasks on a local Ray cluster of 2 workers.

Each test starts Ray in its own process (diag's amdsmi guard changes that process's
imports), so the rest of the suite is untouched.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

# Found, not imported: importing Ray here would run its accelerator probes in the test process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="Ray is not installed (pip install 'diag[ray]'; the test extra has it)")

HERE = Path(__file__).parent


def _diag(*args, cwd):
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A real A100 trace and generated gloo CPU traces: none states a world size other than the
    gloo job's 2 (diag analyze refuses traces of jobs that differ in it)."""
    d = tmp_path_factory.mktemp("ray") / "traces"
    d.mkdir()
    for f in ("cpu_comm_rank0.pt.trace.json.gz", "cpu_comm_rank1.pt.trace.json.gz", "cpu_compute_rank0.pt.trace.json.gz",
              "cpu_data_rank0.pt.trace.json.gz", "real/a100_alexnet_benchmark_allocator.json.gz"):
        shutil.copy(FIXTURES / f, d / Path(f).name)
    return d


def test_ray_gives_the_local_pool_s_document_byte_for_byte(traces):
    local = _diag("analyze", "traces", "--json", cwd=traces.parent)
    on_ray = _diag("analyze", "traces", "--ray", "--jobs", "2", "--json", cwd=traces.parent)
    assert local.returncode == on_ray.returncode == 0, on_ray.stderr[-3000:]
    doc = json.loads(on_ray.stdout)
    assert len(doc["ranks"]) == 5 and not doc["errors"]
    assert on_ray.stdout == local.stdout  # the analysis holds no timings: nothing to leave out


def test_a_killed_worker_is_retried_once_then_its_rank_is_missing(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for r in (0, 1):
        shutil.copy(FIXTURES / f"cpu_comm_rank{r}.pt.trace.json.gz", traces / f"cpu_comm_rank{r}.pt.trace.json.gz")
    markers = tmp_path / "attempts"
    markers.mkdir()
    proc = subprocess.run([sys.executable, str(HERE / "ray_kill_job.py"), str(traces), str(markers)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    # Rank 0's worker died once: Ray ran the task again and it was analysed.
    assert [r["rank"] for r in doc["ranks"]] == [0]
    # Rank 1's died twice: an error naming its file, and the merge names the rank missing.
    (err,) = doc["errors"]
    assert err["source"].endswith("cpu_comm_rank1.pt.trace.json.gz") and "lost 2 times" in err["error"]
    assert doc["job"]["missing_ranks"] == [1]


def test_an_unreachable_cluster_is_a_one_line_error(tmp_path):
    proc = _diag("analyze", str(FIXTURES / "cpu_data_rank0.pt.trace.json.gz"), "--ray", "127.0.0.1:9", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Ray: cannot reach the cluster at 127.0.0.1:9" in proc.stderr
