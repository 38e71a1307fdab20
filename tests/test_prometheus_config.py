"""`diag prometheus-config` and `diag export`: real CLI runs, configs checked by promtool."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from conftest import require_executable

from diag import atomic_io, rundir, segments
from diag.cli import main


def value(text: str, name: str, **labels) -> float | None:
    """The value of one sample in an exposition, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {k: str(v) for k, v in labels.items()}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                return s.value
    return None


R0 = {"run": "exp1", "rank": 0, "local_rank": 0, "host": "n1", "gpu": ""}
R1 = {**R0, "rank": 1, "local_rank": 1}


def cli(*args, capsys=None):
    rc = main(list(args))
    out = capsys.readouterr() if capsys else None
    return rc, out


def test_static_config_for_a_slurm_nodelist(capsys, tmp_path):
    out = tmp_path / "prometheus.yml"
    rc, _ = cli("prometheus-config", "--slurm-nodelist", "gpu[01-03],login7", "--ranks-per-node", "4",
                "--port-base", "9500", "--out", str(out), capsys=capsys)
    assert rc == 0
    doc = yaml.safe_load(out.read_text())
    job = doc["scrape_configs"][0]
    assert job["job_name"] == "diag" and job["honor_labels"] is True
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert len(targets) == 16
    assert targets[:4] == ["gpu01:9500", "gpu01:9501", "gpu01:9502", "gpu01:9503"]
    assert targets[-1] == "login7:9503"
    assert [g["labels"]["node"] for g in job["static_configs"]] == ["gpu01", "gpu02", "gpu03", "login7"]
    promtool = require_executable("promtool", "Debian package prometheus")
    check = subprocess.run([promtool, "check", "config", str(out)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_file_sd_targets_and_the_scrape_block_that_reads_them(capsys, tmp_path):
    targets_file = tmp_path / "diag_targets.json"
    rc, out = cli("prometheus-config", "--hosts", "10.0.0.1,node-b", "--ranks-per-node", "2",
                  "--format", "file_sd", "--out", str(targets_file), capsys=capsys)
    assert rc == 0
    groups = json.loads(targets_file.read_text())
    assert groups == [{"targets": ["10.0.0.1:9870", "10.0.0.1:9871"], "labels": {"node": "10.0.0.1"}},
                      {"targets": ["node-b:9870", "node-b:9871"], "labels": {"node": "node-b"}}]
    # The hint on stderr is a working prometheus.yml that reads the file.
    hint = out.err.split("\n", 1)[1]
    config = tmp_path / "prometheus.yml"
    config.write_text(hint)
    assert yaml.safe_load(hint)["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(targets_file)]
    promtool = require_executable("promtool", "Debian package prometheus")
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_slurm_environment_is_the_default(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[7-8]")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("DIAG_EXPORTER_PORT", "9600")
    rc, out = cli("prometheus-config", capsys=capsys)
    assert rc == 0
    targets = [t for g in yaml.safe_load(out.out)["scrape_configs"][0]["static_configs"] for t in g["targets"]]
    assert targets == ["n7:9600", "n7:9601", "n8:9600", "n8:9601"]


@pytest.mark.parametrize("args, message", [
    (["--hosts", ""], "no hosts"),
    (["--hosts", "good,bad host"], "not a host name"),
    (["--hosts", "h1", "--ranks-per-node", "0"], "at least 1"),
    (["--hosts", "h1", "--port-base", "65535", "--ranks-per-node", "2"], "outside"),
    (["--hosts", "h1", "--scrape-interval", "often"], "not a duration"),
])
def test_bad_input_is_one_line_exit_2(capsys, monkeypatch, args, message):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    rc, out = cli("prometheus-config", *args, capsys=capsys)
    assert rc == 2
    assert out.err.startswith("diag: error:") and message in out.err and out.err.count("\n") == 1


def _write_run(path, ranks=2, steps=6, bound: str | None = "data"):
    """A run directory; its step records carry a verdict as diag.run/2 wrote them (a reader
    ignores it), or with bound=None only facts, as diag.run/3 writes them."""
    for r in range(ranks):
        rd = path / rundir.rank_dir_name(r)
        atomic_io.atomic_write_json(rd / rundir.RANK_FILE, {"schema": rundir.RANK_SCHEMA, "run_id": "exp1",
                                                         "rank": r, "local_rank": r, "host": "n1",
                                                         "device": None, "started_unix": 1000.0})
        w = segments.SegmentWriter(rd / "steps", "steps", flush_records=3)
        for i in range(steps):
            rec = {"step": i, "start_unix": 1000.0 + i, "duration_s": 0.5 + r, "data_wait_s": 0.1,
                   "samples": 8, "tokens": None, "peak_mem_bytes": None, "profiled": False,
                   "evidence": "sampled", "shares": None}
            w.write({**rec, "bound": bound} if bound else rec)
        w.flush()
        s = segments.SegmentWriter(rd / "samples", "samples")
        s.write({"t": 1001.0, "gpu": None, "host": {"cpu_ratio": 0.5, "memory_used_bytes": 1e9}})
        s.flush()
    atomic_io.atomic_write_json(path / "nccl_bench.json", {"schema": "diag.nccl_bench/1", "tests": [
        {"collective": "all_reduce", "world_size": 2, "rows": [], "avg_busbw_gbps": 1.5, "status": "ok"}]})


def test_export_serves_a_run_directory_and_follows_new_segments(tmp_path, capsys):
    from prometheus_client import generate_latest

    from diag.commands.export import RunDirExport
    from diag.exporter.registry import make_registry

    _write_run(tmp_path)
    exp = RunDirExport(tmp_path)
    registry = make_registry(exp.refresh)
    text = generate_latest(registry).decode()
    assert value(text, "diag_steps_total", **R0) == 6
    assert value(text, "diag_step_duration_seconds_sum", **R1) == 9.0
    # The verdicts a diag.run/2 record carried are not read: its steps are judged as facts,
    # as a diag.run/3 run's are (below), so rank 1's "data" is not counted.
    assert value(text, "diag_step_bound_total", bound="data", **R0) == 6
    assert not value(text, "diag_step_bound_total", bound="data", **R1)
    assert value(text, "diag_nccl_bus_bandwidth_bytes_per_second", collective="all_reduce", **R0) == 1.5e9
    assert value(text, "diag_last_step_timestamp_seconds", **R0) == 1005.5
    # A running job adds a segment: the next scrape counts it, and nothing twice.
    w = segments.SegmentWriter(tmp_path / "rank-00000" / "steps", "steps")
    w.write({"step": 6, "start_unix": 1006.0, "duration_s": 0.5, "data_wait_s": 0.1, "bound": "data"})
    w.flush()
    text = generate_latest(registry).decode()
    assert value(text, "diag_steps_total", **R0) == 7
    assert value(text, "diag_steps_total", **R1) == 6
    # The same through the command line.
    rc = main(["export", str(tmp_path), "--once"])
    out = capsys.readouterr().out
    assert rc == 0 and value(out, "diag_steps_total", **R0) == 7
    promtool = require_executable("promtool", "Debian package prometheus")
    check = subprocess.run([promtool, "check", "metrics"], input=out, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def test_export_judges_a_facts_only_run_as_its_agents_did_live(tmp_path):
    """A diag.run/3 step record holds no verdict: the export judges each step with the live
    verdict's own functions (a data wait of 0.1 s in a 0.5 s step is data-bound; in 1.5 s it
    is not)."""
    from prometheus_client import generate_latest

    from diag.commands.export import RunDirExport
    from diag.exporter.registry import make_registry

    _write_run(tmp_path, bound=None)
    text = generate_latest(make_registry(RunDirExport(tmp_path).refresh)).decode()
    assert value(text, "diag_step_bound_total", bound="data", **R0) == 6
    assert not value(text, "diag_step_bound_total", bound="data", **R1)


def test_export_rejects_what_is_not_a_run_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["export", str(tmp_path), "--once"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diag: error:") and "not a diag run directory" in err
    assert main(["export", str(tmp_path / "missing")]) == 2


def test_export_serves_over_http(tmp_path):
    import socket
    import urllib.request

    _write_run(tmp_path, ranks=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "diag", "export", str(tmp_path), "--port", str(port),
                             "--bind", "127.0.0.1"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "diag export did not start"
                time.sleep(0.2)
        assert value(text, "diag_steps_total", **R0) == 6
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_live_endpoint_and_diag_export_label_a_run_alike(tmp_path):
    """One run, one `run` label: what a dashboard shows of it live and from `diag export` later."""
    import re
    import urllib.request

    from prometheus_client import generate_latest

    import diag
    from diag.commands.export import RunDirExport
    from diag.exporter.registry import make_registry

    with diag.Agent(run_dir=tmp_path / "run", export=True, export_port_base=0, report=False, sampling=False,
                    profile=False, verbose=False) as agent:
        for _ in range(3):
            agent.step(samples=8)
        time.sleep(1.5)  # the agent thread publishes the steps
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.exporter.port}/metrics", timeout=10) as resp:
            live = resp.read().decode()
    exported = generate_latest(make_registry(RunDirExport(tmp_path / "run").refresh)).decode()

    def runs(text: str) -> set[str]:
        return set(re.findall(r'^diag_steps_total\{[^}]*\brun="([^"]*)"', text, re.M))

    assert runs(live) and runs(live) == runs(exported), (runs(live), runs(exported))
