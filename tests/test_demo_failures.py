"""A demo rank that dies ends the demo with one line naming the rank and how it ended, and
the other ranks are stopped: never a multiprocessing traceback."""

from __future__ import annotations

import os
import signal
import time

import pytest

from diag import cli, demo
from diag.errors import DiagRunError


def _killed_rank(rank, cfg, done):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # rank 0 would wait for its peer at the first collective


def _raising_rank(rank, cfg, done):
    if rank == 1:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    time.sleep(60)


@pytest.mark.parametrize("rank_main,how", [(_killed_rank, "rank 1 of the demo was killed by SIGKILL"),
                                           (_raising_rank, "rank 1 of the demo failed: RuntimeError: Connection "
                                                           "closed by peer")])
def test_a_dead_rank_ends_the_demo_in_one_line(tmp_path, monkeypatch, capsys, rank_main, how):
    monkeypatch.setattr(demo, "_rank_main", rank_main)
    t0 = time.monotonic()
    with pytest.raises(DiagRunError) as err:
        demo.run_demo(demo.DemoSettings(ranks=2, run_dir=str(tmp_path), export=False))
    assert how in str(err.value) and "the other ranks were stopped" in str(err.value)
    assert time.monotonic() - t0 < 45  # rank 0 was stopped, not waited for
    # Through the command line: one line, exit status 1.
    assert cli.main(["demo", "--ranks", "2", "--run-dir", str(tmp_path / "cli"), "--no-export"]) == 1
    err_lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("diag: error:")]
    assert len(err_lines) == 1 and how in err_lines[0]
