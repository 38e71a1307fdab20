"""Nothing a fault leaves behind outlives the run: a forked trace writer dies with its rank,
partial traces left by a killed rank are removed when the rank starts again, and a trace
being written counts toward the trace budget (collectors/profiler_windows.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diag.collectors.profiler_windows import ProfilerWindows, WindowSettings
from diag.collectors.trace_export import partial_traces

FORKING_PARENT = textwrap.dedent("""
    import os, sys, time
    from diag.collectors.trace_export import _die_with_parent
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _die_with_parent(parent)
        time.sleep(60)  # a trace writer still writing
        os._exit(0)
    print(pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_writer_dies_with_its_rank():
    rank = subprocess.Popen([sys.executable, "-c", FORKING_PARENT], stdout=subprocess.PIPE, text=True)
    child = int(rank.stdout.readline())
    os.kill(rank.pid, signal.SIGKILL)  # the rank is killed mid-window
    rank.wait(timeout=10)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie of init's is gone as a process
            if f.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the forked writer outlived its rank")


def test_partial_traces_left_by_a_killed_rank_are_removed_at_start(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    kept = traces / "window-000004.pt.trace.json.gz"
    kept.write_bytes(b"x")
    for name in (".window-000008.tmp", ".window-000008.tmp.tmp"):  # diag's partial, and Kineto's of it
        (traces / name).write_bytes(b"x" * 1000)
    logged = []
    ProfilerWindows(traces, WindowSettings(), log=logged.append)
    assert sorted(p.name for p in traces.iterdir()) == [kept.name]
    assert logged and "removed partial traces" in logged[0]


def test_a_trace_being_written_counts_toward_the_budget(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    w = ProfilerWindows(traces, WindowSettings(budget_bytes=3000))
    for k in (4, 8, 12):
        (traces / f"window-{k:06d}.pt.trace.json.gz").write_bytes(b"x" * 900)
    assert w.enforce_budget() == []  # 2,700 bytes: within the budget
    (traces / ".window-000016.tmp.tmp").write_bytes(b"x" * 1000)  # Kineto writing the next one
    removed = w.enforce_budget()
    assert [p.name for p in removed] == ["window-000004.pt.trace.json.gz"]
    assert partial_traces(traces)  # the one being written is never deleted


def test_a_report_removes_the_partial_files_of_ranks_whose_writers_are_gone(tmp_path):
    """A rank killed mid-write leaves its temporary files; the report of the run removes those
    of ranks that closed or whose process is gone from this host, and keeps a live rank's."""
    import json
    import socket

    from report_helpers import write_run

    from diag.report import write_report

    run = write_run(tmp_path / "run", ranks=3, steps=20)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owners = {0: {"status": "completed"}, 1: {"status": "running", "pid": dead.pid},
              2: {"status": "running", "pid": os.getpid()}}
    for rank, owner in owners.items():
        rank_dir = run / f"rank-{rank:05d}"
        info = json.loads((rank_dir / "rank.json").read_text())
        (rank_dir / "rank.json").write_text(json.dumps({**info, **owner, "host": socket.gethostname()}))
        (rank_dir / "traces").mkdir(exist_ok=True)
        for name in ("traces/.window-000004.tmp", "traces/.window-000004.tmp.tmp", ".live.json.k3j2.tmp"):
            (rank_dir / name).write_bytes(b"{")
    write_report(run)
    left = sorted(str(p.relative_to(run)) for p in run.rglob(".*.tmp"))
    assert left == ["rank-00002/.live.json.k3j2.tmp", "rank-00002/traces/.window-000004.tmp",
                    "rank-00002/traces/.window-000004.tmp.tmp"]
