"""A real 2-process gloo job under the agent, with one rank killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
from rank_documents import ranks_of

from diag import rundir
from diag.analyzers.analyze import analyze_run_dir as analyze_run

SCRIPT = textwrap.dedent(
    """
    import datetime, os, signal, sys, time
    import torch, torch.distributed as dist
    import diag

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    kill_at = int(sys.argv[2])
    with diag.Agent(run_dir=sys.argv[1], export=False, skip_first=2, every=100, active=2,
                    heartbeat_s=0.5, flush_s=0.5, report_wait_s=30, verbose=True) as agent:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step, x in enumerate(agent.loader(torch.randn(16, 64) for _ in range(40))):
            if rank == 1 and step == kill_at:
                time.sleep(1.5)  # let the heartbeat record the last finished step
                os.kill(os.getpid(), signal.SIGKILL)
            loss = model(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
            agent.step(samples=16)
            time.sleep(0.02)
    print("rank", rank, "finished")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_killed_rank_is_named_by_the_survivors(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    port = _free_port()
    run_id = uuid.uuid4().hex
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DIAG_RUN_ID=run_id)
            procs.append(subprocess.Popen([sys.executable, str(script), str(run_dir), "8"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    # Rank 0's next collective fails; its exception propagates and the run is closed as failed.
    assert procs[0].returncode != 0, outs[0]
    assert "finished" not in outs[0][0]

    rd = rundir.RunDir(run_dir)
    assert rd.rank_info(0)["status"] == "failed"
    assert rd.rank_info(1)["status"] == "running"  # it never closed
    manifest = rd.manifest()
    assert manifest["lost_ranks"] == [1] and manifest["status"] == "failed"

    # The analysis holds facts: no rank is absent, and rank 1 never closed.
    doc = analyze_run(run_dir)
    assert doc.job.missing_ranks == []
    assert {r["rank"]: (r["status"], r["closed"]) for r in doc.job.reports["ranks"]} == {
        0: ("failed", True), 1: ("running", False)}
    assert {r["rank"]: r["status"] for r in ranks_of(doc)} == {0: "failed", 1: "running"}
    assert len(ranks_of(doc)[1]["steps"]) == 8

    # Rank 0 wrote the job report at exit; the diagnosis names the rank that was killed.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diagnosis"]["stopped_ranks"] == [1] and summary["diagnosis"]["missing_ranks"] == []
    assert not [f for f in summary["diagnosis"]["findings"] if f["id"] == "missing_ranks"]
    # The headline counts only the rank that lived to the end, and the survivor's own error is
    # quoted beside the rank that stopped reporting.
    text = summary["diagnosis"]["headline"]["text"]
    assert "on both ranks" not in text and "rank 1 stopped before the job ended" in text, text
    ended = next(f for f in summary["diagnosis"]["findings"] if f["id"] == "ranks_ended_abnormally")
    error = rd.rank_info(0)["error"]
    assert f"rank 0 failed: {error.splitlines()[0][:300]}" in ended["message"], ended
    assert "rank 1 on " in ended["message"] and "stopped reporting after step 7" in ended["message"], ended
    assert "rank 0 failed: " in (run_dir / "report.md").read_text()
