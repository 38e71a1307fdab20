"""A real Prometheus scrapes a live `diag demo` run; every dashboard and alert expression is checked.

Prometheus (Debian's package) runs on loopback with a temporary data directory, a 1 s scrape
and rule-evaluation interval, the scrape configuration written by `diag prometheus-config`,
and dashboards/alerts.yml as its rule file. Its targets:

- the two ranks of a live `diag demo` run (gloo DDP on CPU under the real agent), scraped
  while it trains and kept serving after it by `--linger`;
- one more endpoint in this process, fed GPU-shaped samples (the sample record: diag.collectors.sampler), profiler window
  summaries, NCCL documents (parsed from the real nccl-tests outputs and NCCL logs where
  the data exists) and an out-of-memory event, because this machine has no GPU and the
  demo runs no `diag nccl`.

Then every PromQL expression of every dashboard panel and every alert rule must return
data, except those naming a metric the table marks as appearing only on events (those
must be valid and known to Prometheus). Expressions over metrics that appear `always`
must return data from the demo's own ranks, not from the fed endpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from conftest import REPO, real_data_dir, require_executable

from diag.exporter import runtime
from diag.exporter.metrics_table import series_names
from diag.step_record import StepRecord

pytestmark = pytest.mark.slow

LOOP = "127.0.0.1"
DASH = REPO / "dashboards"
DEMO_STEPS = 60
DEMO_LINGER_S = 120  # ample: the demo is stopped once the checks are done
WAIT_S = 150  # upper bound for the demo to come up and be scraped


# ---------------------------------------------------------------------------- helpers
def free_block(n: int) -> int:
    """A port p with p..p+n-1 free on loopback."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((LOOP, 0))
            p = s.getsockname()[1]
        if p + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind((LOOP, p + i))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


class Prom:
    def __init__(self, port: int):
        self.base = f"http://{LOOP}:{port}"

    def get(self, path: str, **params):
        url = f"{self.base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400 for a bad expression: keep Prometheus' message
            return json.loads(exc.read())

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


def wait_for(cond, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for name, p in procs:
            if p.poll() is not None:
                pytest.fail(f"{name} exited with {p.returncode} while waiting for {what}:\n{tail(p)}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def tail(p) -> str:
    path = getattr(p, "log_path", None)
    if path and os.path.exists(path):
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-30:])
    return ""


def start(name, cmd, log_dir, env=None, cwd=None):
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    p.log_path, p.log_file = str(log_path), log
    return p


def stop(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    p.log_file.close()


# ---------------------------------------------------------------------------- what trains
def start_demo(tmp_path, base: int, env: dict):
    """(process, run directory, description). The run label is the run's id, which the ranks
    record in rank.json (`run_label`).

    With `--linger`, the demo keeps its endpoints up after training and the report, so the
    checks need not race the training.
    """
    run_dir = tmp_path / "demo-run"
    cmd = [sys.executable, "-m", "diag", "demo", "--run-dir", str(run_dir), "--port-base", str(base),
           "--steps", str(DEMO_STEPS), "--linger", str(DEMO_LINGER_S)]
    return start("demo", cmd, tmp_path, env=env), run_dir, "diag demo --linger"


def run_label(run_dir) -> str | None:
    """The `run` label the ranks' endpoints carry: the run id rank 0 recorded, once it has."""
    try:
        return json.loads((run_dir / "rank-00000" / "rank.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------- GPU-shaped feeder
def nccl_documents() -> list[dict]:
    """diag.nccl_bench/1 and diag.nccl_log/2 documents parsed from the real files; hand-written
    ones only where the real data is absent. A parser that fails on the real files fails here."""
    data = real_data_dir()
    if data is None:
        return [
            {"schema": "diag.nccl_bench/1", "tests": [{"collective": "all_reduce", "world_size": 8,
                                                        "backend": "nccl", "rows": [], "avg_busbw_gbps": 182.4,
                                                        "status": "ok", "errors": []}]},
            {"schema": "diag.nccl_log/1", "findings": [{"id": "nccl_socket_transport", "severity": "warning",
                                                         "message": "NET/Socket", "evidence": ""}]},
        ]
    from diag.analyzers.diagnosis.nccl_log import findings
    from diag.analyzers.nccl import log as nccl_log
    from diag.analyzers.nccl import nccl_tests

    bench = next(doc for doc in (nccl_tests.parse_file(p) for p in sorted((data / "nccl").glob("nccltests_*.txt")))
                 if any(t.get("avg_busbw_gbps") for t in doc.get("tests") or []))
    log = next(doc for doc in (nccl_log.parse_files([p]) for p in sorted((data / "nccl").glob("nccllog_*.txt")))
               if findings(doc))
    return [bench, log]


class GpuFeeder:
    """A rank endpoint in this process, fed what an agent on a GPU node hands its exporter."""

    RUN = "gpu-shaped"

    def __init__(self):
        self.handle = runtime.start({"run": self.RUN, "rank": "0", "local_rank": 0, "host": "gpu-node-1",
                                     "gpu": "0"}, port_base=0, bind=LOOP, log=lambda m: None)
        assert self.handle is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._xid = 2  # errors from before the job: not new

    def start(self):
        h = self.handle
        h.observe_window({
            "mfu": 0.38, "gpu_time": {"idle_pct": 5.0, "compute_pct": 80.0, "non_compute_pct": 15.0,
                                      "comm_compute_overlap_pct": 55.0},
            "findings": [{"id": "low_mfu", "severity": "info", "message": "", "advice": "", "evidence": ""}]})
        for doc in nccl_documents():
            h.observe_nccl(doc)
        self._thread.start()

    def faults(self):
        """A new XID error and an out-of-memory error, after Prometheus has seen the healthy state."""
        self._xid += 1
        self.handle.observe_event({"t": time.time(), "level": "error", "source": "agent",
                                   "message": "training loop raised OutOfMemoryError: CUDA out of memory"})

    def _run(self):
        i, energy = 0, 1.0e6
        while not self._stop.wait(0.5):
            now = time.time()
            energy += 150.0
            xid = self._xid
            self.handle.observe_sample({"t": now, "gpu": {
                "index": 0, "uuid": "GPU-0000", "name": "NVIDIA H100 80GB HBM3", "utilization_ratio": 0.9,
                "memory_used_bytes": 70e9, "memory_total_bytes": 80e9, "sm_clock_hz": 1.98e9,
                "power_watts": 600.0, "energy_joules_total": energy, "temperature_celsius": 80.0,
                "clock_events": ["sw_thermal"] if i % 2 else [], "pcie_tx_bytes_per_second": 1e9,
                "pcie_rx_bytes_per_second": 2e9, "nvlink_tx_bytes_total": 1e12 + i * 1e9,
                "nvlink_rx_bytes_total": 1e12 + i * 1e9, "ecc_errors_total": 0, "xid_errors_total": xid},
                "host": {"cpu_ratio": 0.3, "memory_used_bytes": 2e11, "memory_total_bytes": 1e12,
                         "disk_read_bytes_total": 1e9 + i, "disk_write_bytes_total": 1e9 + i,
                         "net_rx_bytes_total": 1e10 + i * 1e6, "net_tx_bytes_total": 1e10 + i * 1e6,
                         "process_cpu_ratio": 1.0, "process_rss_bytes": 8e9, "dataloader_workers": 8,
                         "dataloader_workers_cpu_ratio": 3.0}})
            self.handle.observe_step(StepRecord(
                step=i, start_unix=now - 0.45, duration_s=0.45, device_s=0.43, data_wait_s=0.02, samples=256,
                tokens=256 * 2048, peak_mem_bytes=66e9, mfu=0.4,
                shares={"data": 0.05, "host": 0.05, "comm": 0.15, "memory": 0.15, "compute": 0.6}), "compute")
            i += 1

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.handle.close()


# ---------------------------------------------------------------------------- the test
def substitute(expr: str, run: str) -> str:
    for var, value in (("$__rate_interval", "10s"), ("$run", run), ("$host", ".*"), ("$rank", ".*"),
                       ("$job", ".*")):
        expr = expr.replace(var, value)
    return expr


def dashboard_expressions() -> list[tuple[str, str]]:
    out = []
    for path in sorted(DASH.glob("*.json")):
        for p in json.loads(path.read_text())["panels"]:
            for t in p.get("targets", []):
                out.append((f"{path.name}: {p['title']}", t["expr"]))
    return out


def alert_quantities() -> list[tuple[str, str, str]]:
    """(alert, full expression, the compared quantity) from the committed rules."""
    sys.path.insert(0, str(DASH))
    try:
        import generate
    finally:
        sys.path.remove(str(DASH))
    quantities = {a.name: a.quantity for a in generate.alerts()}
    rules = yaml.safe_load((DASH / "alerts.yml").read_text())["groups"][0]["rules"]
    return [(r["alert"], r["expr"], quantities[r["alert"]]) for r in rules]


def classify(expr: str) -> str:
    """always | fed | event | prometheus, from the table's `appears` of the metrics named."""
    table = series_names()
    metrics = [table[n] for n in re.findall(r"\b(diag_[a-z0-9_]+)", expr)]
    if not metrics:
        return "prometheus"
    if any(m.event_only for m in metrics):
        return "event"
    return "always" if all(m.appears == "always" for m in metrics) else "fed"


def test_real_prometheus_scrapes_a_live_demo(tmp_path):
    prometheus = require_executable("prometheus", "Debian package prometheus")
    promtool = require_executable("promtool", "Debian package prometheus")
    base = free_block(2)
    prom_port = free_block(1)
    env = dict(os.environ, DIAG_EXPORTER_BIND=LOOP, DIAG_EXPORTER_PORT=str(base), PYTHONUNBUFFERED="1")
    env.pop("DIAG_EXPORTER", None)

    feeder = GpuFeeder()
    # The scrape configuration comes from diag prometheus-config, as a user would write it.
    scrape = subprocess.run([sys.executable, "-m", "diag", "prometheus-config", "--hosts", LOOP,
                             "--ranks-per-node", "2", "--port-base", str(base), "--scrape-interval", "1s"],
                            capture_output=True, text=True, timeout=60)
    assert scrape.returncode == 0, scrape.stderr
    config = yaml.safe_load(scrape.stdout)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DASH / "alerts.yml")]
    config["scrape_configs"].append({"job_name": "diag-gpu-shaped", "scrape_interval": "1s", "honor_labels": True,
                                     "static_configs": [{"targets": [f"{LOOP}:{feeder.handle.port}"]}]})
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    procs = []
    try:
        prom_proc = start("prometheus", [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                         f"--web.listen-address={LOOP}:{prom_port}", "--log.level=warn"],
                          tmp_path)
        procs.append(("prometheus", prom_proc))
        prom = Prom(prom_port)
        # Prometheus scrapes before the demo starts: a short demo on a quiet machine trains in
        # a few seconds, and the training must be seen (the linger keeps the endpoints after it).
        wait_for(prom.ready, 60, "Prometheus to be ready", procs)
        feeder.start()
        demo, demo_dir, how = start_demo(tmp_path, base, env)
        procs.append(("diag demo", demo))

        # Both ranks scraped while training, several times (the counter moved between scrapes).
        # Over the whole test's span, not the last seconds: a short demo on a loaded machine
        # can finish training before this loop's next query.
        def training_seen():
            label = run_label(demo_dir)
            if label is None:
                return False
            r = prom.query(f'count(increase(diag_steps_total{{run="{label}"}}[10m]) > 0)')
            return r.get("status") == "success" and r["data"]["result"] and r["data"]["result"][0]["value"][1] == "2"

        wait_for(training_seen, WAIT_S, f"both ranks of {how} to be scraped while training", procs)
        run = run_label(demo_dir)
        feeder.faults()
        time.sleep(4)  # a few more scrapes, and rule evaluations over them
        assert demo.poll() is None, f"diag demo stopped serving before the checks:\n{tail(demo)}"

        # Every target up: the two training ranks and the fed endpoint.
        targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
        assert len(targets) == 3 and all(t["health"] == "up" for t in targets), targets

        # Once rank 0 has written the report, it serves the diagnosis's job verdict.
        def verdict_served():
            with urllib.request.urlopen(f"http://{LOOP}:{base}/metrics", timeout=10) as r:
                text = r.read().decode()
            return re.search(r'diag_job_bound\{[^}]*bound="compute"[^}]*\} 1(\.0)?$', text, re.M)

        wait_for(verdict_served, WAIT_S, "rank 0 to serve the job verdict of its report", procs)

        # promtool check metrics is clean on what the training ranks serve.
        for i in range(2):
            with urllib.request.urlopen(f"http://{LOOP}:{base + i}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert f'run="{run}"' in text
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                  timeout=60)
            assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr
            series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
            assert len(series) < 200, len(series)

        problems = []

        def expect_data(where, expr, category):
            r = prom.query(substitute(expr, ".*"))
            if r.get("status") != "success":
                problems.append(f"{where}: invalid ({r.get('error')}): {expr}")
                return
            if category == "event":
                # May be empty; the metric must still be known to Prometheus from the scrapes.
                for name in set(re.findall(r"\b(diag_[a-z0-9_]+)", expr)):
                    family = series_names()[name].name
                    # Scraped as OpenMetrics, a counter's metadata is under its name without _total.
                    known = [prom.get("/api/v1/targets/metadata", metric=n).get("data")
                             for n in {family, family.removesuffix("_total")}]
                    if not any(known):
                        problems.append(f"{where}: {name} unknown to Prometheus")
                return
            if not r["data"]["result"]:
                problems.append(f"{where}: no data: {expr}")
            if category == "always":
                own = prom.query(substitute(expr, run))
                if not own["data"]["result"]:
                    problems.append(f"{where}: no data from the {how} run itself: {expr}")

        exprs = dashboard_expressions()
        assert len(exprs) > 40
        for where, expr in exprs:
            expect_data(where, expr, classify(expr))
        for name, full, quantity in alert_quantities():
            valid = prom.query(full)
            if valid.get("status") != "success":
                problems.append(f"alerts.yml {name}: invalid ({valid.get('error')})")
            expect_data(f"alerts.yml {name} (quantity)", quantity, classify(quantity))
        assert demo.poll() is None, f"diag demo ended during the checks; raise DEMO_LINGER_S:\n{tail(demo)}"
        assert not problems, "\n".join(problems)

        # The rules Prometheus evaluates itself: all loaded and healthy.
        groups = prom.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert {r["name"] for r in rules} == {a for a, _, _ in alert_quantities()}
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        # The fed GPU's new XID error and OOM event fire their alerts (for: 0m).
        firing = {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["data"]["alerts"]}
        assert {"DiagGpuXidError", "DiagOutOfMemory"} <= firing, firing

        # The dashboards' template variables find the run, hosts and ranks.
        runs = prom.get("/api/v1/label/run/values", **{"match[]": "diag_build_info"})["data"]
        assert run in runs and GpuFeeder.RUN in runs
        ranks = prom.get("/api/v1/label/rank/values", **{"match[]": f'diag_build_info{{run="{run}"}}'})["data"]
        assert sorted(ranks) == ["0", "1"]
    finally:
        for _, p in reversed(procs):
            stop(p)
        feeder.close()
