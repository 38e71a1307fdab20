"""One diagnosis per run: built once by the facade, on the run's own records and its own
recorded thresholds, and the same bytes in `diag analyze --json`, summary.json and report.html."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port_pair, wait_for_line
from report_helpers import write_run

from diag import atomic_io, rundir


def _diag(*args, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or dict(os.environ, DIAG_EXPORTER="off"))


def _canonical(diagnosis: dict) -> str:
    return json.dumps(diagnosis, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _three_diagnoses(run: Path) -> tuple[dict, dict, dict]:
    """(diag analyze RUN --json, summary.json, report.html's embedded data)'s diagnosis."""
    proc = _diag("analyze", str(run), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    analysed = json.loads(proc.stdout)["diagnosis"]
    summary = json.loads((run / "summary.json").read_text())["diagnosis"]
    page = (run / "report.html").read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="diag-diagnosis">(.*?)</script>', page, re.S).group(1)
    return analysed, summary, json.loads(block)


def test_one_diagnosis_for_a_run_with_nccl_logs_and_samples(tmp_path, real_nccl):
    """Samples, step records, a real NCCL log and real nccl-tests results: `diag analyze` once
    said "0 device/host metric sample(s)" where the report counted them."""
    from diag.analyzers.nccl import expected as nccl_expected
    from diag.analyzers.nccl import nccl_tests

    run = write_run(tmp_path / "run", ranks=2, steps=20, bound="comm", strength=0.4, gpu=True)
    (run / "rank-00000" / "nccl").mkdir()
    shutil.copy(real_nccl / "nccllog_NVIDIA-nccl_1232.txt", run / "rank-00000" / "nccl" / "nccl.log")
    bench = nccl_tests.parse_file(real_nccl / "nccltests_NVIDIA-nccl_1453.txt")
    bench["topology"] = nccl_expected.topology_from_flags("nvlink3", "roce_200")
    atomic_io.atomic_write_json(run / "nccl_bench.json", bench)
    proc = _diag("report", str(run), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    analysed, summary, page = _three_diagnoses(run)
    assert _canonical(analysed) == _canonical(summary) == _canonical(page)
    # The records are in it: the NCCL log's finding and the benchmark against its expected bandwidth.
    assert any(f["id"] == "net_socket_fallback" for f in analysed["nccl"]["log_findings"])
    assert analysed["nccl"]["busbw_fraction"] is not None
    samples = sum(len(list(rundir.RunDir(run).samples(r))) for r in (0, 1))
    coverage = next(e["text"] for e in analysed["evidence"] if e["id"] == "ev-sources")
    assert samples > 0 and f"{samples} device/host metric sample(s)" in coverage, coverage


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.slow
def test_thresholds_set_on_the_agent_reach_every_view(tmp_path):
    """A data-bound demo whose agent was given thresholds under which it is not data-bound:
    the live endpoint, summary.json, the report and `diag analyze RUN --json` say the same.

    The demo's data wait is about 96% of the step, so data_wait = 0.99 answers "no"; the
    device is then idle, and data_of_idle = 1.0 hands the idle time to the host."""
    base = free_port_pair()
    env = dict(os.environ, DIAG_EXPORTER_BIND="127.0.0.1")
    env.pop("DIAG_EXPORTER", None)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "diag", "demo", "--bottleneck", "data", "--steps", "16",
                             "--threshold", "data_wait=0.99", "--threshold", "data_of_idle=1.0",
                             "--linger", "120", "--port-base", str(base), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        wait_for_line(err, "Serving Prometheus metrics", proc)
        live = _scrape(base)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    recorded = json.loads((run / rundir.TREE_SETTINGS).read_text())
    assert recorded["thresholds"]["data_wait"] == 0.99 and recorded["thresholds"]["data_of_idle"] == 1.0
    analysed, summary, page = _three_diagnoses(run)
    assert _canonical(analysed) == _canonical(summary) == _canonical(page)
    assert analysed["bound"] == "host", analysed["headline"]
    first = analysed["decision_path"]["nodes"][0]
    assert (first["metric"], first["threshold"], first["answer"]) == ("data_share", 0.99, "no")
    assert first["value"] > 0.5  # the run does wait for data: only the threshold moved
    job_bound = {m.group(1): float(m.group(2))
                 for m in re.finditer(r'^diag_job_bound\{[^}]*bound="(\w+)"\} (\S+)$', live, re.M)}
    assert job_bound and job_bound["host"] == 1.0 and job_bound["data"] == 0.0, job_bound
    # Told otherwise on the command line, a later analysis judges by the defaults' data_wait.
    told = json.loads(_diag("analyze", str(run), "--json", "--threshold", "data_wait=0.2").stdout)["diagnosis"]
    assert told["bound"] == "data"


def _calibration(path: Path) -> Path:
    """A calibration as `diag calibrate` writes it, with peaks low enough that a CPU trace's
    ops land on the roofline."""
    from diag import calibrate

    doc = {"schema": calibrate.SCHEMA, "cpu": "test CPU", "flops": {"fp32": 2e9, "bf16": 2e9}, "mem_bw": 1e9}
    calibrate.save(doc, path)
    return path


def test_a_cpu_trace_gives_the_same_json_whatever_the_cache_holds(tmp_path):
    """The analysis reads no calibration from the machine's cache; it takes one only when given."""
    from conftest import FIXTURES

    trace = FIXTURES / "cpu_memory_rank0.pt.trace.json.gz"
    cache = tmp_path / "cache"
    env = dict(os.environ, DIAG_EXPORTER="off", XDG_CACHE_HOME=str(cache))
    plain = _diag("analyze", str(trace), "--json", "--jobs", "1", env=env)
    _calibration(cache / "diag" / "cpu_peaks.json")
    cached = _diag("analyze", str(trace), "--json", "--jobs", "1", env=env)
    assert plain.returncode == cached.returncode == 0, cached.stderr
    assert plain.stdout == cached.stdout
    given = _diag("analyze", str(trace), "--json", "--jobs", "1", "--calibration",
                  str(cache / "diag" / "cpu_peaks.json"), env=env)
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["ranks"][0]["device"] != json.loads(plain.stdout)["ranks"][0]["device"]
    bad = _diag("analyze", str(trace), "--calibration", str(trace), env=env)
    assert bad.returncode != 0 and bad.stderr.count("diag: error:") == 1 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_a_run_is_analysed_with_the_calibration_its_agent_recorded(tmp_path):
    """The agent reads the host's calibration once and records it; the window analyses and a
    later `diag analyze` on a machine with another cache use the record."""
    calibrated = tmp_path / "calibrated"
    _calibration(calibrated / "diag" / "cpu_peaks.json")
    run = tmp_path / "run"
    env = dict(os.environ, DIAG_EXPORTER="off", XDG_CACHE_HOME=str(calibrated))
    proc = _diag("demo", "--steps", "16", "--no-export", "--run-dir", str(run), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "rank-00000" / rundir.RANK_FILE).read_text())["host_peaks"]["cpu"] == "test CPU"
    windows = [json.loads(p.read_text()) for p in sorted((run / "rank-00000" / rundir.WINDOWS).glob("*.json"))]
    assert windows and all(w["analysis"]["device"] == "test CPU" for w in windows)
    elsewhere = dict(os.environ, DIAG_EXPORTER="off", XDG_CACHE_HOME=str(tmp_path / "empty"))
    analysed = json.loads(_diag("analyze", str(run), "--json", env=elsewhere).stdout)
    assert [r["device"] for r in analysed["ranks"]] == ["test CPU", "test CPU"]


@pytest.mark.parametrize("content", ["[" * 100_000, '{"schema": "diag.tree_settings/1", "thresholds": {"data_wait": "x"}}',
                                     '{"schema": "something else"}'])
def test_damaged_recorded_thresholds_are_one_error_line(tmp_path, content):
    run = write_run(tmp_path / "run", ranks=1, steps=10, bound="data")
    (run / rundir.TREE_SETTINGS).write_text(content)
    proc = _diag("analyze", str(run), "--json")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("diag: error:") == 1 and rundir.TREE_SETTINGS in proc.stderr, proc.stderr
