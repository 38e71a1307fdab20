"""Host metrics against real psutil on this machine, with a real multi-worker DataLoader."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from diag.collectors.host_metrics import HostMetrics, child_pids, dataloader_worker_pids

HOST_KEYS = {
    "cpu_ratio", "cpu_count", "memory_used_bytes", "memory_total_bytes", "disk_read_bytes_total", "disk_write_bytes_total",
    "net_rx_bytes_total", "net_tx_bytes_total", "process_cpu_ratio", "process_rss_bytes",
    "dataloader_workers", "dataloader_workers_cpu_ratio", "dataloader_workers_read_bytes_per_second",
    # Linux: psutil's iowait, per-process storage reads and the workers' run-queue wait.
    "cpu_iowait_ratio", "process_read_bytes_per_second", "dataloader_workers_runqueue_ratio",
}


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


class BusyDataset:
    """Each item costs real CPU time in the worker, like decoding and augmentation do."""

    def __init__(self, n: int, cost_s: float):
        self.n, self.cost_s = n, cost_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        _burn(self.cost_s)
        return i


def _cpu_of(pids) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


@pytest.fixture
def logs():
    return []


def test_host_record_has_every_key_in_base_units(logs):
    cpu0, wall0 = time.process_time(), time.monotonic()
    host = HostMetrics(logs.append)
    _burn(0.3)  # this process works between two readings
    rec = host.read()
    expected = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert set(rec) == HOST_KEYS, host.unsupported
    assert logs == []
    assert 0.0 <= rec["cpu_ratio"] <= 1.0 and rec["cpu_ratio"] > 0.0 and rec["cpu_count"] == psutil.cpu_count()
    assert rec["memory_total_bytes"] == psutil.virtual_memory().total
    assert 0 < rec["memory_used_bytes"] < rec["memory_total_bytes"]
    assert rec["process_rss_bytes"] == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)
    # CPU seconds per wall second, as this process itself measured them around the readings
    # (the cores are shared with other jobs, so the absolute value varies from run to run).
    assert rec["process_cpu_ratio"] > 0.05
    assert rec["process_cpu_ratio"] == pytest.approx(expected, rel=0.3, abs=0.1)
    io = psutil.disk_io_counters()
    assert rec["disk_read_bytes_total"] <= io.read_bytes
    later = host.read()
    for key in ("disk_read_bytes_total", "disk_write_bytes_total", "net_rx_bytes_total", "net_tx_bytes_total"):
        assert later[key] >= rec[key], key
    assert rec["dataloader_workers"] == 0 and rec["dataloader_workers_cpu_ratio"] == 0.0
    assert rec["dataloader_workers_runqueue_ratio"] == 0.0
    assert 0.0 <= rec["cpu_iowait_ratio"] <= 1.0 and rec["process_read_bytes_per_second"] >= 0.0


def test_storage_reads_are_left_out_where_the_os_refuses_them(logs, monkeypatch):
    """psutil raises AccessDenied for another user's process (and where /proc/<pid>/io is
    hidden): the read rate is then absent, the rest of the record as before, nothing logged."""
    def refused(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "io_counters", refused)
    host = HostMetrics(logs.append)
    rec = host.read()
    assert "process_read_bytes_per_second" not in rec and "process_cpu_ratio" in rec
    assert rec["dataloader_workers_read_bytes_per_second"] == 0.0 and logs == []


def test_loopback_traffic_is_not_counted_as_network(logs):
    import socket

    host = HostMetrics(logs.append)
    before = host.read()
    lo_before = psutil.net_io_counters(pernic=True)["lo"].bytes_sent
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    payload = b"x" * (4 << 20)
    cli.sendall(payload[: 1 << 20])
    got = 0
    while got < (1 << 20):
        got += len(conn.recv(1 << 20))
    for s in (cli, conn, srv):
        s.close()
    after = host.read()
    assert psutil.net_io_counters(pernic=True)["lo"].bytes_sent - lo_before >= 1 << 20
    assert after["net_tx_bytes_total"] - before["net_tx_bytes_total"] < 1 << 20


@pytest.mark.slow  # importing torch takes seconds on a shared machine
def test_dataloader_workers_are_found_with_their_cpu(logs):
    torch_data = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(BusyDataset(16, 0.15), batch_size=1, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    live = [it]  # the agent's view of the current iterator; emptied when it ends
    try:
        worker_pids = dataloader_worker_pids(it)
        assert len(worker_pids) == 2
        assert set(worker_pids) <= set(child_pids(os.getpid()))
        # A process of multiprocessing's own machinery is a child too, but not a worker.
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # resource_tracker"])
        # And a process the agent started for itself (its trace analysis, say).
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            # Default: this process's children, minus helpers and the agent's own processes.
            by_children = HostMetrics(logs.append, exclude_pids=lambda: [own.pid])
            by_pids = HostMetrics(logs.append, dataloader_pids=lambda: [p for i in live for p in dataloader_worker_pids(i)])
            cpu0, wall0 = _cpu_of(worker_pids), time.monotonic()
            time.sleep(0.6)  # both workers burn CPU on their prefetched items meanwhile
            a, b = by_children.read(), by_pids.read()
            expected = (_cpu_of(worker_pids) - cpu0) / (time.monotonic() - wall0)
        finally:
            for p in (helper, own):
                p.kill()
                p.wait(5)
        assert a["dataloader_workers"] == 2 and b["dataloader_workers"] == 2
        # The workers' CPU seconds per wall second, as measured around the readings (the
        # cores are shared with other jobs, so only the agreement is fixed, not the value).
        assert expected > 0.02
        for rec in (a, b):
            assert rec["dataloader_workers_cpu_ratio"] == pytest.approx(expected, rel=0.35, abs=0.05), (rec, expected)
        assert next(it) is not None
    finally:
        live.clear()
        del it
    # Workers gone: nothing counted, nothing cached.
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in worker_pids):
        assert time.monotonic() < deadline, "DataLoader workers did not exit"
        time.sleep(0.05)
    rec = by_children.read()
    # (multiprocessing's resource tracker, started by an earlier test, may stay cached as a helper)
    assert rec["dataloader_workers"] == 0 and {p for p, e in by_children._workers.items() if not e.helper} == set()
    assert logs == []


def test_failing_pid_callback_falls_back_to_children_and_logs_once(logs):
    def broken():
        raise RuntimeError("iterator gone")

    host = HostMetrics(logs.append, dataloader_pids=broken)
    for _ in range(3):
        rec = host.read()
    assert rec["dataloader_workers"] == 0
    assert len(logs) == 1 and "dataloader_pids() failed" in logs[0] and "RuntimeError" in logs[0]
    assert "dataloader" in [m.name for m in host.enabled]


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no scheduler statistics here (not Linux)")
def test_workers_waiting_for_a_cpu_are_told_from_workers_waiting_on_reads(logs):
    """Two spinning workers pinned to one CPU each run about half the time and wait the other
    half for it: their CPU and their wait for a CPU add up to their wall time, however busy
    the machine is. A sleeping worker (one that waits on a read) waits for no CPU."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    spin = [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    procs = [subprocess.Popen(spin), subprocess.Popen(spin), subprocess.Popen(sleeper)]
    try:
        spinners = HostMetrics(logs.append, dataloader_pids=lambda: [p.pid for p in procs[:2]])
        sleeping = HostMetrics(logs.append, dataloader_pids=lambda: [procs[2].pid])
        time.sleep(0.3)  # both spinners pinned and running
        for m in (spinners, sleeping):
            m.read()
        time.sleep(1.0)
        busy, idle = spinners.read(), sleeping.read()
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
    assert logs == []
    assert busy["dataloader_workers"] == 2
    # Two always-runnable processes: 2 s of CPU and wait per second between them, one CPU's worth run.
    assert busy["dataloader_workers_cpu_ratio"] + busy["dataloader_workers_runqueue_ratio"] == pytest.approx(2.0, rel=0.15)
    assert busy["dataloader_workers_runqueue_ratio"] >= 0.8
    assert idle["dataloader_workers_runqueue_ratio"] < 0.05 and idle["dataloader_workers_cpu_ratio"] < 0.05
