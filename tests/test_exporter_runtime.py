"""The per-rank endpoint: real HTTP servers on loopback, real scrapes, real promtool."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import require_executable
from prometheus_client.parser import text_string_to_metric_families

from diag.diagnosis_document import Diagnosis, diagnosis_from_json
from diag.exporter import runtime
from diag.exporter.metrics_table import CLOCK_EVENT_REASONS, MAX_DYNAMIC_VALUES
from diag.step_record import StepRecord

IDENTITY = {"run": "run-a", "rank": 1, "local_rank": 1, "host": "node1", "gpu": 0}
LOOP = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


def free_pair() -> int:
    """A port p with p and p+1 both free (for base + LOCAL_RANK)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((LOOP, p))
                b.bind((LOOP, p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def fetch(handle) -> str:
    with urllib.request.urlopen(handle.url, timeout=5) as r:
        return r.read().decode()


def parse(text: str) -> dict:
    """{(sample name, frozenset of non-identity labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in IDENTITY}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def val(series: dict, metric: str, **labels) -> float:
    return series[(metric, frozenset({k: str(v) for k, v in labels.items()}.items()))]


@pytest.fixture
def handle():
    h = runtime.start(IDENTITY, port_base=0, bind=LOOP, log=lambda m: None)
    assert h is not None and h.port
    yield h
    h.close()


def step(i, duration=0.04, wait=0.01, shares=None, bound="compute", **extra) -> tuple[StepRecord, str | None]:
    """A step record and its live verdict, as the agent hands them to the exporter."""
    rec = {"step": i, "start_unix": 1_700_000_000.0 + i, "duration_s": duration, "data_wait_s": wait,
           "samples": 16, "tokens": 2048, "peak_mem_bytes": None, "profiled": False,
           "evidence": "sampled", "shares": shares, **extra}
    return StepRecord(**rec), bound


def gpu_sample(t, **over):
    gpu = {"index": 0, "uuid": "GPU-1234", "name": "NVIDIA A100-SXM4-80GB", "utilization_ratio": 0.93,
           "memory_used_bytes": 60e9, "memory_total_bytes": 80e9, "sm_clock_hz": 1.41e9, "power_watts": 312.5,
           "energy_joules_total": 1.5e6, "temperature_celsius": 71.0, "clock_events": ["sw_thermal"],
           "pcie_tx_bytes_per_second": 2e9, "pcie_rx_bytes_per_second": 1e9, "nvlink_tx_bytes_total": 5e12,
           "nvlink_rx_bytes_total": 4e12, "ecc_errors_total": 0, "xid_errors_total": 2}
    gpu.update(over)
    host = {"cpu_ratio": 0.4, "memory_used_bytes": 100e9, "memory_total_bytes": 512e9,
            "disk_read_bytes_total": 7e9, "disk_write_bytes_total": 3e9, "net_rx_bytes_total": 9e9,
            "net_tx_bytes_total": 8e9, "process_cpu_ratio": 1.3, "process_rss_bytes": 6e9,
            "dataloader_workers": 4, "dataloader_workers_cpu_ratio": 2.5}
    return {"t": t, "gpu": gpu, "host": host}


def test_steps_fill_training_metrics(handle):
    shares = {"data": 0.25, "host": 0.05, "comm": 0.2, "memory": 0.1, "compute": 0.4}
    handle.observe_step(*step(0, duration=0.04, wait=0.01, shares=shares, bound="compute"))
    handle.observe_step(*step(1, duration=0.2, wait=0.05, shares=None, bound="data", device_s=0.18))
    handle.observe_step(*step(2, duration=3.0, wait=None, shares=None, bound=None, samples=None, tokens=None))
    s = parse(fetch(handle))
    assert val(s, "diag_steps_total") == 3
    assert val(s, "diag_step_duration_seconds_count") == 3
    assert val(s, "diag_step_duration_seconds_sum") == pytest.approx(3.24)
    assert val(s, "diag_step_duration_seconds_bucket", le="0.05") == 1
    assert val(s, "diag_step_duration_seconds_bucket", le="0.25") == 2
    assert val(s, "diag_step_duration_seconds_bucket", le="2.5") == 2
    assert val(s, "diag_step_duration_seconds_bucket", le="+Inf") == 3
    assert val(s, "diag_step_device_seconds_count") == 1 and val(s, "diag_step_device_seconds_sum") == 0.18
    # Phases: step 0 by its shares, step 1 data wait + unattributed, step 2 all unattributed.
    assert val(s, "diag_step_phase_seconds_total", phase="data") == pytest.approx(0.01 + 0.05)
    assert val(s, "diag_step_phase_seconds_total", phase="comm") == pytest.approx(0.008)
    assert val(s, "diag_step_phase_seconds_total", phase="unattributed") == pytest.approx(0.15 + 3.0)
    phases = sum(v for (n, _), v in s.items() if n == "diag_step_phase_seconds_total")
    assert phases == pytest.approx(3.24)
    assert val(s, "diag_step_bound_total", bound="compute") == 1
    assert val(s, "diag_step_bound_total", bound="data") == 1
    assert val(s, "diag_step_bound_total", bound="comm") == 0
    assert val(s, "diag_data_wait_seconds_total") == pytest.approx(0.06)
    assert val(s, "diag_samples_total") == 32 and val(s, "diag_tokens_total") == 4096
    assert val(s, "diag_last_step_timestamp_seconds") == pytest.approx(1_700_000_002.0 + 3.0)
    assert val(s, "diag_exporter_observations_total", kind="step") == 3
    assert val(s, "diag_exporter_errors_total", stage="step") == 0


def test_before_the_first_step_the_stall_timer_counts_from_start(handle):
    s = parse(fetch(handle))
    assert abs(val(s, "diag_last_step_timestamp_seconds") - time.time()) < 30
    assert val(s, "diag_steps_total") == 0
    # Sampled device metrics are absent (not zero) until a sample says otherwise.
    assert not any(n.startswith("diag_gpu_") for n, _ in s)


def test_samples_fill_device_and_host_metrics(handle):
    handle.observe_sample(gpu_sample(1000.0))
    handle.observe_sample(gpu_sample(1002.0, clock_events=["hw_thermal", "other_0x800"], xid_errors_total=3))
    s = parse(fetch(handle))
    assert val(s, "diag_gpu_info", name="NVIDIA A100-SXM4-80GB", uuid="GPU-1234") == 1
    assert val(s, "diag_gpu_utilization_ratio") == 0.93
    assert val(s, "diag_gpu_memory_total_bytes") == 80e9
    assert val(s, "diag_gpu_sm_clock_hertz") == 1.41e9
    assert val(s, "diag_gpu_energy_joules_total") == 1.5e6
    assert val(s, "diag_gpu_xid_errors_total") == 3
    # Throughput integrated over the 2 s between samples.
    assert val(s, "diag_gpu_pcie_bytes_total", direction="tx") == pytest.approx(4e9)
    assert val(s, "diag_gpu_pcie_bytes_total", direction="rx") == pytest.approx(2e9)
    assert val(s, "diag_gpu_nvlink_bytes_total", direction="tx") == 5e12
    # Every known reason is exported; only the current ones are 1; unknown bits fold into "other".
    for reason in CLOCK_EVENT_REASONS:
        assert val(s, "diag_gpu_clock_event_active", reason=reason) == float(reason == "hw_thermal")
    assert val(s, "diag_gpu_clock_event_active", reason="other") == 1
    assert val(s, "diag_host_cpu_ratio") == 0.4
    assert val(s, "diag_host_disk_bytes_total", direction="write") == 3e9
    assert val(s, "diag_host_network_bytes_total", direction="rx") == 9e9
    assert val(s, "diag_process_resident_memory_bytes") == 6e9
    assert val(s, "diag_dataloader_workers") == 4


def test_windows_nccl_and_events(handle):
    handle.observe_window({
        "mfu": 0.41, "gpu_time": {"idle_pct": 10, "compute_pct": 80, "non_compute_pct": 10,
                                  "comm_compute_overlap_pct": 62.5},
        "findings": [{"id": "low_mfu"}, {"id": "exposed_comm"}, {"id": "exposed_comm"}]})
    handle.observe_nccl({"schema": "diag.nccl_bench/1", "tests": [
        {"collective": "all_reduce", "world_size": 2, "rows": [], "avg_busbw_gbps": 180.5, "status": "ok"},
        {"collective": "all_gather", "world_size": 2, "rows": [], "avg_busbw_gbps": None, "status": "failed"}]})
    handle.observe_nccl({"schema": "diag.nccl_log/1", "findings": [
        {"id": "nccl_socket_transport", "severity": "warning"}, {"id": "nccl_p2p_disabled"}]})
    handle.observe_event({"kind": "fault", "error": "torch.OutOfMemoryError: CUDA out of memory."})
    handle.observe_event({"kind": "collector_off", "message": "nvml: not available"})
    s = parse(fetch(handle))
    assert val(s, "diag_mfu_ratio") == 0.41
    assert val(s, "diag_comm_compute_overlap_ratio") == 0.625
    assert val(s, "diag_analysis_findings", id="exposed_comm") == 2
    assert val(s, "diag_nccl_bus_bandwidth_bytes_per_second", collective="all_reduce") == pytest.approx(180.5e9)
    assert ("diag_nccl_bus_bandwidth_bytes_per_second", frozenset({("collective", "all_gather")})) not in s
    assert val(s, "diag_nccl_findings", id="nccl_p2p_disabled") == 1
    assert val(s, "diag_oom_errors_total") == 1
    # A newer window replaces the findings of the previous one.
    handle.observe_window({"mfu": 0.5, "findings": []})
    s = parse(fetch(handle))
    assert not any(n == "diag_analysis_findings" for n, _ in s)


def test_job_verdict_comes_from_the_diagnosis(tmp_path, handle):
    """The job's verdict metrics are the report's diagnosis, as written to summary.json, both
    on a live endpoint and from `diag export` of the run directory."""
    import json
    from pathlib import Path

    from report_helpers import write_run

    from diag.commands.export import RunDirExport
    from diag.exporter.registry import render_text
    from diag.report import write_report

    run = write_run(tmp_path / "run", ranks=2, steps=30, bound="data", strength=0.45)
    summary = json.loads(Path(write_report(run)["summary"]).read_text())["diagnosis"]
    assert summary["bound"] == "data"
    handle.observe_diagnosis(diagnosis_from_json(summary))
    exported = RunDirExport(run)
    states = exported.refresh()
    for text in (fetch(handle), render_text(lambda: states).decode()):
        s = parse(text)
        assert {b: val(s, "diag_job_bound", bound=b) for b in ("data", "host", "comm", "memory", "compute")} == {
            "data": 1.0, "host": 0.0, "comm": 0.0, "memory": 0.0, "compute": 0.0}
        for phase, share in summary["phase_shares"].items():
            assert val(s, "diag_job_phase_ratio", phase=phase) == pytest.approx(share)
    # Only the lowest rank carries the job's verdict, as rank 0's agent does.
    assert len(states) == 2
    per_rank = [parse(render_text(lambda st=st: [st]).decode()) for st in states]
    assert ("diag_job_bound", frozenset({("bound", "data")})) in per_rank[0]
    assert not any(n == "diag_job_bound" for n, _ in per_rank[1])
    # A document without a known verdict is an error the exporter counts, never raises.
    handle.observe_diagnosis(Diagnosis(bound="sideways"))
    assert val(parse(fetch(handle)), "diag_exporter_errors_total", stage="diagnosis") == 1


def test_bad_records_are_counted_never_raised(handle):
    handle.observe_step(None)
    handle.observe_step({"step": 1, "duration_s": "slow"})
    handle.observe_sample({"t": "x", "gpu": "not a dict", "host": {"cpu_ratio": float("nan")}})
    handle.observe_nccl({"schema": "something/else"})
    handle.observe_window([1, 2])
    s = parse(fetch(handle))
    assert val(s, "diag_exporter_errors_total", stage="step") == 2
    assert val(s, "diag_exporter_errors_total", stage="nccl") == 1
    assert val(s, "diag_exporter_errors_total", stage="window") == 1
    assert val(s, "diag_steps_total") == 0
    assert ("diag_host_cpu_ratio", frozenset()) not in s  # NaN is not a value


def test_dynamic_labels_are_capped_and_series_stay_under_200(handle):
    # Everything populated at once, with a flood of finding ids and collectives.
    for i in range(50):
        handle.observe_step(*step(i, shares={"data": 0.1, "host": 0.1, "comm": 0.1, "memory": 0.1,
                                            "compute": 0.6}, peak_mem_bytes=1e9, mfu=0.3))
    handle.observe_sample(gpu_sample(1.0))
    handle.observe_sample(gpu_sample(2.0, clock_events=[f"other_0x{b:x}" for b in range(3)]))
    many = [{"id": f"finding_{i}"} for i in range(100)]
    handle.observe_window({"mfu": 0.3, "gpu_time": {"comm_compute_overlap_pct": 50}, "findings": many})
    handle.observe_nccl({"schema": "diag.nccl_log/1", "findings": many})
    handle.observe_nccl({"schema": "diag.nccl_bench/1", "tests": [
        {"collective": f"coll_{i}", "avg_busbw_gbps": 1.0} for i in range(100)]})
    handle.observe_event({"kind": "oom"})
    s = parse(fetch(handle))
    ids = {dict(lbl)["id"] for n, lbl in s if n == "diag_nccl_findings"}
    assert len(ids) == MAX_DYNAMIC_VALUES + 1 and "other" in ids
    assert val(s, "diag_nccl_findings", id="other") == 100 - MAX_DYNAMIC_VALUES
    colls = {dict(lbl)["collective"] for n, lbl in s if n == "diag_nccl_bus_bandwidth_bytes_per_second"}
    assert len(colls) == MAX_DYNAMIC_VALUES + 1
    assert len(s) < 200, len(s)


def test_promtool_check_metrics_is_clean(handle):
    promtool = require_executable("promtool", "Debian package prometheus")
    handle.observe_step(*step(0, shares={"data": 0.1, "host": 0.1, "comm": 0.1, "memory": 0.1, "compute": 0.6}))
    handle.observe_sample(gpu_sample(1.0))
    handle.observe_window({"mfu": 0.3, "findings": [{"id": "low_mfu"}]})
    handle.observe_nccl({"schema": "diag.nccl_bench/1", "tests": [{"collective": "all_reduce",
                                                                    "avg_busbw_gbps": 10}]})
    text = fetch(handle)
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_port_base_plus_local_rank_from_the_environment(monkeypatch):
    base = free_pair()
    monkeypatch.setenv("DIAG_EXPORTER_PORT", str(base))
    monkeypatch.setenv("DIAG_EXPORTER_BIND", LOOP)
    h = runtime.start(IDENTITY, log=lambda m: None)  # local_rank 1
    try:
        assert h.port == base + 1 and h.bind == LOOP
        assert "diag_steps_total" in fetch(h)
    finally:
        h.close()


def test_port_in_use_warns_and_takes_the_next_free_port():
    base = free_pair()
    messages = []
    with socket.socket() as taken:
        taken.bind((LOOP, base))
        taken.listen()
        h = runtime.start({**IDENTITY, "local_rank": 0}, port_base=base, bind=LOOP, log=messages.append)
        try:
            assert h is not None and h.port == base + 1
            assert len(messages) == 1 and "in use" in messages[0] and str(base + 1) in messages[0]
            h.observe_step(*step(0))
            assert "diag_steps_total" in fetch(h)
        finally:
            h.close()


def test_turned_off_or_unbindable_gives_none_and_training_goes_on(monkeypatch):
    assert runtime.start(IDENTITY, enabled=False, log=lambda m: None) is None
    monkeypatch.setenv("DIAG_EXPORTER", "0")
    assert runtime.start(IDENTITY, port_base=0, bind=LOOP, log=lambda m: None) is None
    monkeypatch.delenv("DIAG_EXPORTER")
    messages = []
    # 192.0.2.1 (TEST-NET-1) is not an address of this machine: bind fails with EADDRNOTAVAIL.
    assert runtime.start(IDENTITY, port_base=0, bind="192.0.2.1", log=messages.append) is None
    assert messages and "cannot listen" in messages[0]
    # A log callable that raises does not escape either.
    assert runtime.start(IDENTITY, port_base=0, bind="192.0.2.1", log=lambda m: 1 / 0) is None


def test_close_frees_the_port():
    h = runtime.start(IDENTITY, port_base=0, bind=LOOP, log=lambda m: None)
    port = h.port
    h.close()
    h.close()  # idempotent
    with socket.socket() as s:
        s.bind((LOOP, port))


def test_observers_stay_consistent_under_concurrent_scrapes(handle):
    stop = threading.Event()
    scraped = []

    def scraper():
        while not stop.is_set():
            scraped.append(parse(fetch(handle)))

    t = threading.Thread(target=scraper)
    t.start()
    # Observe until the scraper has overlapped several scrapes with the updates (at least
    # 3000 steps), so the test does not depend on how the two threads get scheduled.
    observed = 0
    deadline = time.monotonic() + 60
    try:
        while (observed < 3000 or len(scraped) < 3) and time.monotonic() < deadline:
            handle.observe_step(*step(observed, duration=0.01, wait=0.0, shares=None))
            observed += 1
    finally:
        stop.set()
        t.join(10)
    s = parse(fetch(handle))
    assert val(s, "diag_steps_total") == observed
    assert val(s, "diag_step_duration_seconds_count") == observed
    assert len(scraped) >= 3
    # Every scrape saw a consistent snapshot: histogram count equals the step counter.
    for snap in scraped:
        assert val(snap, "diag_steps_total") == val(snap, "diag_step_duration_seconds_count")


def test_http_paths(handle):
    base = handle.url.rsplit("/", 1)[0]
    with urllib.request.urlopen(base + "/", timeout=5) as r:
        assert b"/metrics" in r.read()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/other", timeout=5)
    assert err.value.code == 404
    req = urllib.request.Request(handle.url, method="HEAD")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4") and r.read() == b""
    # Scrapes are counted and timed.
    fetch(handle)
    s = parse(fetch(handle))
    assert val(s, "diag_exporter_scrapes_total") >= 2
    assert 0 < val(s, "diag_exporter_collect_duration_seconds") < 1


def test_keep_alive_connection_serves_repeated_scrapes(handle):
    import http.client

    conn = http.client.HTTPConnection(LOOP, handle.port, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and not resp.will_close
            assert b"diag_steps_total" in resp.read()
    finally:
        conn.close()
