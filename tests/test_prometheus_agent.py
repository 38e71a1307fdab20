"""Prometheus in agent mode, as at thousands of ranks: `diag prometheus-config --remote-write`
configures a real Prometheus agent that scrapes a rank endpoint (`diag export` of a run
directory) and remote-writes to a second real Prometheus, the central store, where the
series arrive with their identity labels."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import require_executable
from report_helpers import write_run
from test_prometheus_live import LOOP, Prom, free_block, start, stop, wait_for

pytestmark = pytest.mark.slow


def test_an_agent_mode_prometheus_remote_writes_the_ranks_series(tmp_path):
    prometheus = require_executable("prometheus", "Debian package prometheus")
    promtool = require_executable("promtool", "Debian package prometheus")
    run = write_run(tmp_path / "run", ranks=2, steps=20, bound="compute", gpu=True)
    port = free_block(3)
    export_port, store_port, agent_port = port, port + 1, port + 2
    cfg = subprocess.run([sys.executable, "-m", "diag", "prometheus-config", "--hosts", LOOP, "--ranks-per-node", "1",
                          "--port-base", str(export_port), "--scrape-interval", "1s", "--remote-write",
                          f"http://{LOOP}:{store_port}/api/v1/write", "--out", str(tmp_path / "agent.yml")],
                         capture_output=True, text=True, timeout=60)
    assert cfg.returncode == 0, cfg.stderr
    doc = yaml.safe_load((tmp_path / "agent.yml").read_text())
    assert doc["remote_write"] == [{"url": f"http://{LOOP}:{store_port}/api/v1/write"}]
    check = subprocess.run([promtool, "check", "config", "--agent", str(tmp_path / "agent.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "store.yml").write_text("global:\n  scrape_interval: 1s\n")
    procs = []
    try:
        procs.append(("diag export", start("export", [sys.executable, "-m", "diag", "export", str(run), "--port",
                                                      str(export_port), "--bind", LOOP], tmp_path)))
        procs.append(("store", start("store", [prometheus, f"--config.file={tmp_path / 'store.yml'}",
                                               f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                               f"--web.listen-address={LOOP}:{store_port}",
                                               "--web.enable-remote-write-receiver"], tmp_path)))
        procs.append(("agent", start("agent", [prometheus, "--enable-feature=agent",
                                               f"--config.file={tmp_path / 'agent.yml'}",
                                               f"--storage.agent.path={tmp_path / 'wal'}",
                                               f"--web.listen-address={LOOP}:{agent_port}"], tmp_path)))
        store = Prom(store_port)
        wait_for(store.ready, 60, "the central Prometheus to be ready", procs)

        def arrived():
            res = store.query('diag_steps_total{diag_job="diag"}').get("data", {}).get("result", [])
            return {r["metric"].get("rank") for r in res} == {"0", "1"}

        wait_for(arrived, 90, "both ranks' series to be remote-written to the store", procs)
        res = store.query('diag_steps_total{diag_job="diag"}')["data"]["result"]
        # The identity labels survive the agent (honor_labels), and the store has the node target label.
        assert {r["metric"]["run"] for r in res} == {r["metric"]["run"] for r in res[:1]}
        assert all(r["metric"]["node"] == LOOP and float(r["value"][1]) == 20 for r in res)
    finally:
        for _, p in procs:
            stop(p)
