"""Run-directory claims are atomic: ranks started at one instant never split a run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time

import pytest

from diag import atomic_io
from diag.collectors import run_writer
from diag.collectors.run_writer import CLAIM, resolve_run_dir

RANKS = 4
LAUNCHES = 50


def _rank(base, run_id, rank, barrier, out):
    barrier.wait()  # all ranks resolve at the same instant
    out.put((rank, str(resolve_run_dir(base, run_id, unique=True, rank=rank))))


def _launch(base, run_id) -> dict[int, str]:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(RANKS), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(base, run_id, r, barrier, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_ranks_started_at_one_instant_share_one_directory(tmp_path):
    split = []
    for i in range(LAUNCHES):
        base = tmp_path / f"launch{i}" / "runs" / "x"
        dirs = _launch(base, f"torchelastic:job{i}:0")
        if set(dirs.values()) != {str(base)}:
            split.append((i, dirs))
    assert split == [], f"{len(split)} of {LAUNCHES} launches split their ranks: {split[:3]}"
    # Nothing but the claim is left behind: no temporary files, no lock.
    assert sorted(os.listdir(tmp_path / "launch0" / "runs" / "x")) == [CLAIM]


def test_a_second_launch_goes_next_door_and_the_first_is_intact(tmp_path):
    base = tmp_path / "runs" / "x"
    first = _launch(base, "slurm:100.0")
    second = _launch(base, "slurm:101.0")
    assert set(first.values()) == {str(base)}
    assert set(second.values()) == {str(base.with_name("x-2"))}
    assert json.loads((base / CLAIM).read_text())["run_id"] == "slurm:100.0"


def test_create_exclusive_is_whole_or_nothing(tmp_path):
    target = tmp_path / "claim.json"
    assert atomic_io.create_exclusive(target, b'{"run_id": "a"}') is True
    assert atomic_io.create_exclusive(target, b'{"run_id": "b"}') is False
    assert json.loads(target.read_text()) == {"run_id": "a"}
    assert os.listdir(tmp_path) == ["claim.json"]


def test_without_hard_links_a_lock_directory_decides(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    target = tmp_path / "claim.json"
    assert atomic_io.create_exclusive(target, b"1") is True
    assert atomic_io.create_exclusive(target, b"2") is False
    assert target.read_bytes() == b"1"
    assert sorted(os.listdir(tmp_path)) == ["claim.json", "claim.json.lock"]
    assert run_writer._is_earlier_content(tmp_path) is True  # claim.json is not named CLAIM
    (tmp_path / "claim.json").rename(tmp_path / CLAIM)
    os.rmdir(tmp_path / "claim.json.lock")
    os.mkdir(tmp_path / (CLAIM + ".lock"))
    assert run_writer._is_earlier_content(tmp_path) is False


def test_a_claim_being_written_is_read_again_until_whole(tmp_path):
    (tmp_path / CLAIM).write_text("")  # as a foreign or older writer leaves it for a moment

    def finish():
        time.sleep(0.05)
        atomic_io.atomic_write_json(tmp_path / CLAIM, {"run_id": "r"})

    t = threading.Thread(target=finish)
    t.start()
    assert run_writer._read_claim(tmp_path) == {"run_id": "r"}
    t.join()


def test_a_claim_that_stays_unreadable_is_foreign(tmp_path, monkeypatch):
    monkeypatch.setattr(run_writer, "CLAIM_READ_PAUSE_S", 0.0)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / CLAIM).write_text("{not json")
    assert resolve_run_dir(tmp_path / "runs" / "x", "r", unique=True, rank=0) == tmp_path / "runs" / "x-2"


@pytest.mark.parametrize("ranks", [4])
def test_ranks_agree_on_a_triggered_window(tmp_path, ranks):
    """The profile trigger's start step is agreed the same way: one file, whole, first writer wins."""
    from diag.collectors.profiler_windows import ProfilerWindows

    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()

    def agree(rank):
        pw = ProfilerWindows.__new__(ProfilerWindows)
        pw.trigger_dir, pw.lead_steps, pw.current_step = tmp_path, 3, 10 + rank
        barrier.wait()
        out.put(pw._agreed_start(12345))

    procs = [ctx.Process(target=agree, args=(r,)) for r in range(ranks)]
    for p in procs:
        p.start()
    starts = {out.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(timeout=30)
    assert len(starts) == 1 and starts <= {13, 14, 15, 16}
    assert sorted(os.listdir(tmp_path)) == [".profile-trigger-12345.step"]
