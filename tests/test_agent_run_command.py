"""`diag run -- <command>`: NCCL logging routed into the run directory for unchanged jobs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    print(json.dumps({k: os.environ.get(k) for k in
                      ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "DIAG_RUN_DIR", "DIAG_RUN_ID")}))
    if len(sys.argv) > 1:  # play NCCL: write its log where NCCL_DEBUG_FILE says
        path = os.environ["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
        with open(sys.argv[1]) as src, open(path, "w") as dst:
            dst.write(src.read())
    sys.exit(int(os.environ.get("CHILD_EXIT", "0")))
    """
)


def _diag(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ))


def test_run_sets_nccl_env_and_returns_exit_code(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    env = dict(os.environ, CHILD_EXIT="3")
    for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "DIAG_RUN_DIR"):
        env.pop(k, None)
    proc = _diag(["run", "--run-dir", str(tmp_path / "job"), "--", sys.executable, str(child)], env=env)
    assert proc.returncode == 3, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["NCCL_DEBUG"] == "INFO" and seen["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,NET,GRAPH"
    assert seen["NCCL_DEBUG_FILE"] == str(tmp_path / "job" / "nccl" / "nccl.%h.%p.log")
    assert seen["DIAG_RUN_DIR"] == str(tmp_path / "job") and seen["DIAG_RUN_ID"]
    manifest = json.loads((tmp_path / "job" / "manifest.json").read_text())
    assert manifest["launch"]["exit_code"] == 3 and manifest["status"] == "failed"
    # A second launch into the same folder does not overwrite the first.
    env["CHILD_EXIT"] = "0"
    env["NCCL_DEBUG"] = "WARN"
    proc2 = _diag(["run", "--run-dir", str(tmp_path / "job"), "--nccl-coll", "--", sys.executable, str(child)], env=env)
    assert proc2.returncode == 0, proc2.stderr
    seen2 = json.loads(proc2.stdout.strip().splitlines()[-1])
    assert seen2["NCCL_DEBUG"] == "WARN"  # the user's setting wins
    assert seen2["NCCL_DEBUG_SUBSYS"].endswith(",COLL") and seen2["NCCL_DEBUG_FILE"] is None
    assert seen2["DIAG_RUN_DIR"] == str(tmp_path / "job-2")


def test_run_without_command_is_a_one_line_error(tmp_path):
    proc = _diag(["run", "--run-dir", str(tmp_path / "x")])
    assert proc.returncode == 2 and proc.stderr.startswith("diag: error:") and "Traceback" not in proc.stderr


def test_run_parses_nccl_logs(tmp_path, real_nccl):
    logs = sorted(p for p in real_nccl.glob("nccllog_*") if p.is_file())
    if not logs:
        pytest.skip("no NCCL log in the real data")
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    sample = tmp_path / "sample.log"
    shutil.copy(logs[0], sample)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    proc = _diag(["run", "--run-dir", str(tmp_path / "job"), "--", sys.executable, str(child), str(sample)], env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "job" / "nccl_log.json").read_text())
    # Facts only: the signals the findings are made from, and no findings.
    assert doc["schema"] == "diag.nccl_log/2" and "signals" in doc and "findings" not in doc
    assert "parsed 1 NCCL log file" in proc.stderr


def test_the_agent_under_diag_run_reads_its_own_process_log_from_the_job_folder(tmp_path, real_nccl, monkeypatch):
    """`diag run` sends every process's NCCL log to the job's nccl/ folder, named by host and
    pid: the agent's live view reads its own process's file there, and no other's."""
    from diag import nccl_watch, rundir

    monkeypatch.setattr(nccl_watch, "NCCL_LOG_SETTLE_S", 0.0)
    run, rank = tmp_path / "job", tmp_path / "job" / "rank-00001"
    (run / rundir.NCCL).mkdir(parents=True)
    (rank / rundir.NCCL).mkdir(parents=True)
    logs = sorted(real_nccl.glob("nccllog_*.txt"))
    host = socket.gethostname().split(".")[0]
    (run / rundir.NCCL / f"nccl.{host}.{os.getpid()}.log").write_text(logs[0].read_text())
    (run / rundir.NCCL / f"nccl.{host}.{os.getpid() + 1}.log").write_text(logs[1].read_text())
    handed = []

    class Exporter:
        def observe_nccl(self, doc):
            handed.append(doc)

    watch = nccl_watch.NcclWatch(run, rank, Exporter(), log=lambda m: None)
    watch.poll()
    watch.poll()
    assert len(handed) == 1 and handed[0]["sources"] == [
        str(run / rundir.NCCL / f"nccl.{host}.{os.getpid()}.log")]
