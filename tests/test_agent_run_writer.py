"""The run directory as the agent writes it: claims, no overwriting, ranks of one launch agree."""

from __future__ import annotations

import json
import os

import pytest

from diag import atomic_io, rundir
from diag.collectors import nccl_env
from diag.collectors.launch_env import detect
from diag.collectors.run_writer import CLAIM, RunWriter, launcher_run_id, resolve_run_dir


def _launch(rank=0, world=1, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", **extra}
    return detect(env)


@pytest.mark.parametrize(
    "env, expected, unique",
    [
        ({"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}, "torchelastic:job7:1", True),
        ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}, "slurm:4242.3", True),
        ({"OMPI_MCA_ess_base_jobid": "81920001"}, "mpi:81920001", True),
        ({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
         "master:node1:29500:0", False),
        ({"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, "master:node1:29500", False),
        ({"DIAG_RUN_ID": "abc", "SLURM_JOB_ID": "1"}, "diag:abc", True),
        ({}, None, True),
    ],
)
def test_launcher_run_id(env, expected, unique):
    assert launcher_run_id(env) == (expected, unique)


def test_earlier_run_is_never_overwritten(tmp_path):
    base = tmp_path / "exp"
    first = resolve_run_dir(base, "slurm:1.0", True, rank=0)
    (first / "rank-00000").mkdir()
    second = resolve_run_dir(base, "slurm:2.0", True, rank=0)
    third = resolve_run_dir(base, "slurm:3.0", True, rank=1)
    assert (first, second, third) == (base, tmp_path / "exp-2", tmp_path / "exp-3")
    assert json.loads((base / CLAIM).read_text())["run_id"] == "slurm:1.0"


def test_ranks_of_one_launch_join_the_same_directory(tmp_path):
    base = tmp_path / "exp"
    resolve_run_dir(base, "slurm:1.0", True, rank=0)  # an earlier job
    got = {resolve_run_dir(base, "slurm:9.0", True, rank=r) for r in (1, 0, 3, 2)}
    assert got == {tmp_path / "exp-2"}


def test_master_port_fallback_does_not_join_a_finished_run(tmp_path):
    base = tmp_path / "exp"
    a0 = resolve_run_dir(base, "master:h:29500", False, rank=0)
    (a0 / "rank-00000").mkdir()
    (a0 / "rank-00001").mkdir()
    # The same port, later: the rank folders exist, so this is another launch.
    b1 = resolve_run_dir(base, "master:h:29500", False, rank=1)
    (b1 / "rank-00001").mkdir()
    b0 = resolve_run_dir(base, "master:h:29500", False, rank=0)
    assert a0 == base and b1 == b0 == tmp_path / "exp-2"


def test_foreign_folder_is_not_used(tmp_path):
    base = tmp_path / "exp"
    base.mkdir()
    (base / "notes.txt").write_text("mine")
    assert resolve_run_dir(base, "slurm:1.0", True, rank=0) == tmp_path / "exp-2"
    assert (base / "notes.txt").read_text() == "mine"


def test_overwrite_clears_only_stale_data(tmp_path):
    base = tmp_path / "exp"
    old = RunWriter(resolve_run_dir(base, "slurm:1.0", True, rank=0), _launch(), "slurm:1.0")
    old.write_record("steps", {"step": 0})
    old.close("completed")
    path = resolve_run_dir(base, "slurm:2.0", True, rank=0, overwrite=True)
    assert path == base
    assert not (base / "rank-00000").exists() and not (base / "manifest.json").exists()
    w = RunWriter(path, _launch(), "slurm:2.0")
    w.close("completed")
    assert rundir.RunDir(base).manifest()["run_id"] == "slurm:2.0"


def test_writer_layout_and_manifest(tmp_path):
    w = RunWriter(tmp_path / "r", _launch(0, 2), "slurm:5.0", config={"profile": True})
    w.update_info(device={"name": "cpu"})
    for i in range(3):
        w.write_record("steps", {"step": i, "duration_s": 0.1})
    w.close("completed")
    peer = tmp_path / "r" / "rank-00001"
    peer.mkdir()
    atomic_io.atomic_write_json(peer / "rank.json", {"rank": 1, "host": "other", "status": "completed"})
    peers = w.wait_for_peers(timeout_s=2, stale_s=5)
    w.write_manifest("completed", peers)
    rd = rundir.RunDir(tmp_path / "r")
    m = rd.manifest()
    assert m["schema"] == rundir.RUN_SCHEMA and m["status"] == "completed"
    assert m["hosts"] == sorted({"other", w.launch.hostname})
    assert m["lost_ranks"] == [] and m["versions"]["python"] and m["config"] == {"profile": True}
    assert [r.step for r in rd.steps(0)] == [0, 1, 2]
    assert rd.rank_info(0)["status"] == "completed" and rd.rank_info(0)["ended_unix"]


def test_wait_for_peers_gives_up_on_a_silent_rank(tmp_path):
    w = RunWriter(tmp_path / "r", _launch(0, 2), "slurm:5.0")
    peer = tmp_path / "r" / "rank-00001"
    peer.mkdir()
    atomic_io.atomic_write_json(peer / "rank.json", {"rank": 1, "status": "running", "updated_unix": 1.0})
    import time

    w.close("failed", "RuntimeError: peer went away")

    t0 = time.monotonic()
    peers = w.wait_for_peers(timeout_s=30, stale_s=1.0, poll_s=0.1)
    assert time.monotonic() - t0 < 20  # gave up on the stale peer, well before timeout_s
    w.write_manifest("completed", peers)
    assert rundir.RunDir(tmp_path / "r").manifest()["lost_ranks"] == [1]


def test_a_rank_busy_with_its_last_windows_is_waited_for(tmp_path):
    """A rank analysing its last profiler windows at exit beats its heartbeat meanwhile, so rank
    0, waiting for every rank's final status, does not take it for a rank that died."""
    import threading
    from pathlib import Path

    from diag.window_analysis import WindowAnalysis

    run = tmp_path / "r"
    rank0 = RunWriter(run, _launch(0, 2), "slurm:6.0")
    rank1 = RunWriter(run, _launch(1, 2), "slurm:6.0")
    rank1.heartbeat(status="running")
    rank0.close("completed")
    waited: dict = {}
    waiter = threading.Thread(target=lambda: waited.update(rank0.wait_for_peers(timeout_s=120, stale_s=0.5,
                                                                                poll_s=0.05)))
    waiter.start()
    done: list[int] = []
    beats: list[float] = []
    analysis = WindowAnalysis(rank1.rank_path / rundir.WINDOWS, 1, None, None,
                              on_done=lambda first, _last, _doc: done.append(first), log=lambda _line: None)
    trace = Path(__file__).parent / "fixtures" / "cpu_compute_rank0.pt.trace.json.gz"
    analysis.queue(3, 4, trace)
    # A new process that imports the analysis and reads a trace takes well over the 0.5 s after
    # which rank 0 gives up on a heartbeat that stands still.
    analysis.finish(120, beat=lambda: (beats.append(1.0), rank1.heartbeat()), beat_s=0.1)
    rank1.close("completed")
    waiter.join(60)
    assert done == [3]
    assert len(beats) >= 3
    assert waited[1]["status"] == "completed"


def test_unwritable_location_switches_writing_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory's parent should be")
    logs = []
    w = RunWriter.open(blocker / "run", _launch(), run_id="x", log=logs.append)
    assert not w.enabled and logs and "cannot create" in logs[0]
    w.write_record("steps", {"step": 0})  # no exception
    w.close("completed")


def test_nccl_env_keeps_user_settings(tmp_path):
    env, logged = {"NCCL_DEBUG": "WARN"}, []
    applied = nccl_env.configure(tmp_path / "nccl", env=env, coll=True, check_process_group=False, log=logged.append)
    assert env["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG" not in applied
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,NET,GRAPH,COLL"
    # The user's NCCL messages stay where the user reads them (stderr, the scheduler's log).
    assert "NCCL_DEBUG_FILE" not in env and len(logged) == 1 and "NCCL_DEBUG=WARN is the user's" in logged[0]
    env3 = {}
    nccl_env.configure("relative/nccl", env=env3, check_process_group=False)
    assert env3["NCCL_DEBUG_FILE"] == os.path.join(os.getcwd(), "relative", "nccl", "nccl.%h.%p.log")
    os.rmdir("relative/nccl")
    os.rmdir("relative")
    env2 = {"NCCL_DEBUG_FILE": "/elsewhere/%h.log"}
    nccl_env.configure(tmp_path / "n2", env=env2, check_process_group=False)
    assert env2["NCCL_DEBUG_FILE"] == "/elsewhere/%h.log" and env2["NCCL_DEBUG"] == "INFO"
    assert env2["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,NET,GRAPH"


@pytest.mark.parametrize("backend,warned", [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)])
def test_nccl_env_warns_when_an_nccl_process_group_exists(tmp_path, monkeypatch, backend, warned):
    """Only a group on NCCL has a communicator whose logging the variables come too late for."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    logs = []
    nccl_env.configure(tmp_path / "nccl", env={}, log=logs.append)
    assert bool(logs and "before init_process_group" in logs[0]) == warned
