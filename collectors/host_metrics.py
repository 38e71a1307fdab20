"""Host metrics through psutil: CPU, memory, disk and network I/O, this process, DataLoader workers.

Ratios are computed from our own previous reading (not psutil's shared
``cpu_percent`` state, which any other caller in the process would disturb):

- ``cpu_ratio``: busy share of all cores, 0-1, and ``cpu_count``, how many cores that is (the
  host's, which may be more than the process may use);
- ``process_cpu_ratio`` and ``dataloader_workers_cpu_ratio``: CPU seconds per wall second
  (1.0 = one core busy; a process may exceed 1). A worker seen for the first time is
  averaged over its life so far, so a freshly started worker is not reported idle;
- ``cpu_iowait_ratio``: share of all cores' time idle with I/O outstanding (Linux);
- ``process_read_bytes_per_second`` and ``dataloader_workers_read_bytes_per_second``:
  bytes read from storage (not the page cache) per second, where the OS accounts them;
- ``dataloader_workers_runqueue_ratio``: seconds per wall second the workers were ready to
  run but waited for a CPU (Linux, ``/proc/<pid>/schedstat``; absent elsewhere; a worker seen
  for the first time has no rate yet). A worker short of CPUs uses little of one, as a worker
  waiting on reads does; this tells them apart.

Network totals leave out loopback: a single-node job's gloo traffic is not the network.

DataLoader workers are the pids the agent passes (``dataloader_pids``), or else this
process's children, minus multiprocessing's helper processes. Children are listed from
``/proc/<pid>/task/<tid>/children`` (a few tiny reads) instead of psutil's scan of every
process on the node; psutil is the fallback where that file does not exist.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import psutil

from diag.collectors.metric_set import Log, Metric, MetricSet, NotAvailable, describe_error

# Command-line markers of multiprocessing's own helper processes (not data workers).
_HELPER_MARKERS = ("resource_tracker", "semaphore_tracker", "forkserver", "multiprocessing.popen_forkserver")


def dataloader_worker_pids(iterator) -> list[int]:
    """Worker pids of a live DataLoader iterator (torch's multiprocessing iterator keeps them)."""
    workers = getattr(iterator, "_workers", None) or []
    pids = []
    for w in workers:
        pid = getattr(w, "pid", None)
        if isinstance(pid, int):
            pids.append(pid)
    return pids


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``; from /proc task files when the kernel has them."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        tids = None
    if tids:
        out: list[int] = []
        try:
            for tid in tids:
                try:
                    with open(f"{task_dir}/{tid}/children", "rb") as f:
                        out.extend(int(x) for x in f.read().split())
                except FileNotFoundError:  # thread exited since the listing
                    if not os.path.exists(f"{task_dir}/{tid}"):
                        continue
                    raise
            return out
        except OSError:
            pass  # CONFIG_PROC_CHILDREN off: fall back to psutil
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _cpu_busy_total(t) -> tuple[float, float]:
    """(busy, total) seconds from psutil.cpu_times(); guest time is already inside user time."""
    total = sum(t)
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


class _Proc:
    """One watched process: psutil handle and the previous CPU reading."""

    __slots__ = ("proc", "cpu_s", "t", "helper", "read", "read_t", "io", "runq_ns", "runq_t", "schedstat")

    def __init__(self, proc: psutil.Process, helper: bool):
        self.proc = proc
        self.helper = helper
        self.cpu_s: float | None = None
        self.t = 0.0
        self.read: int | None = None
        self.read_t = 0.0
        self.io = hasattr(proc, "io_counters")  # not on macOS
        self.runq_ns: int | None = None
        self.runq_t = 0.0
        self.schedstat = f"/proc/{proc.pid}/schedstat"

    def runqueue_ratio(self, now_mono: float) -> float | None:
        """Seconds per second spent ready to run, waiting for a CPU, since the previous call
        (None: first call, or no scheduler statistics here)."""
        if not self.schedstat:
            return None
        try:
            with open(self.schedstat, "rb") as f:
                # "<ns on a CPU> <ns waiting on a run queue> <time slices>"
                waited = int(f.read(256).split()[1])
        except (OSError, ValueError, IndexError):
            self.schedstat = ""  # not Linux, or the kernel keeps no such statistics
            return None
        prev, prev_t = self.runq_ns, self.runq_t
        self.runq_ns, self.runq_t = waited, now_mono
        return max(waited - prev, 0) / 1e9 / max(now_mono - prev_t, 1e-6) if prev is not None else None

    def read_rate(self, now_mono: float) -> float | None:
        """Bytes per second read from storage since the previous call (None: first call, or
        no I/O accounting here)."""
        if not self.io:
            return None
        try:
            n = int(self.proc.io_counters().read_bytes)
        except (psutil.AccessDenied, NotImplementedError, AttributeError):
            self.io = False
            return None
        prev, prev_t = self.read, self.read_t
        self.read, self.read_t = n, now_mono
        return max(n - prev, 0) / max(now_mono - prev_t, 1e-6) if prev is not None else None

    def cpu_ratio(self, now_mono: float) -> float:
        times = self.proc.cpu_times()
        cpu_s = times.user + times.system
        if self.cpu_s is None:
            # First sight: average over the process's life so far.
            age = max(time.time() - self.proc.create_time(), 1e-3)
            ratio = cpu_s / age
        else:
            ratio = (cpu_s - self.cpu_s) / max(now_mono - self.t, 1e-6)
        self.cpu_s, self.t = cpu_s, now_mono
        return max(ratio, 0.0)


class HostMetrics(MetricSet):
    source = "host"

    def __init__(
        self,
        log: Log,
        dataloader_pids: Callable[[], list[int]] | None = None,
        pid: int | None = None,
        exclude_pids: Callable[[], Iterable[int]] | None = None,
    ):
        super().__init__(log)
        self.pid = os.getpid() if pid is None else pid
        self.dataloader_pids = dataloader_pids
        self.exclude_pids = exclude_pids  # the agent's own helper processes, never workers
        self._self = _Proc(psutil.Process(self.pid), helper=False)
        self._workers: dict[int, _Proc] = {}
        self._cpu_prev: tuple[float, float, float | None] | None = None
        self._cpu_count = psutil.cpu_count() or 0
        self._pids_failed = False
        # Linux keeps each process's run-queue wait (the workers' wait for a CPU) here.
        self._schedstat = os.path.exists(f"/proc/{self.pid}/schedstat")
        self.probe()

    def table(self) -> list[Metric]:
        return [
            Metric("cpu", self._read_cpu),
            Metric("memory", self._read_memory),
            Metric("disk", self._read_disk),
            Metric("network", self._read_network),
            Metric("process", self._read_process),
            Metric("dataloader", self._read_workers),
        ]

    def read(self) -> dict:
        host: dict = {}
        self.read_into(host)
        return host

    # ---- readers -----------------------------------------------------------------------

    def _read_cpu(self, host: dict) -> None:
        t = psutil.cpu_times()
        busy, total = _cpu_busy_total(t)
        iowait = getattr(t, "iowait", None)  # Linux only
        prev, self._cpu_prev = self._cpu_prev, (busy, total, iowait)
        if prev is None:  # the probe primes the baseline
            return
        d_total = total - prev[1]
        host["cpu_ratio"] = min(max((busy - prev[0]) / d_total, 0.0), 1.0) if d_total > 0 else 0.0
        if self._cpu_count:
            host["cpu_count"] = self._cpu_count
        if iowait is not None and prev[2] is not None:
            # Idle time with I/O outstanding: CPUs that would work if reads came back sooner.
            host["cpu_iowait_ratio"] = min(max((iowait - prev[2]) / d_total, 0.0), 1.0) if d_total > 0 else 0.0

    def _read_memory(self, host: dict) -> None:
        vm = psutil.virtual_memory()
        # total - available, as node_exporter-based dashboards compute "used".
        host["memory_used_bytes"] = int(vm.total - vm.available)
        host["memory_total_bytes"] = int(vm.total)

    def _read_disk(self, host: dict) -> None:
        io = psutil.disk_io_counters(perdisk=False)
        if io is None:
            raise NotAvailable("no disks in /proc/diskstats")
        host["disk_read_bytes_total"] = int(io.read_bytes)
        host["disk_write_bytes_total"] = int(io.write_bytes)

    def _read_network(self, host: dict) -> None:
        rx = tx = 0
        for nic, io in psutil.net_io_counters(pernic=True).items():
            if nic == "lo" or nic.startswith("lo:"):
                continue
            rx += io.bytes_recv
            tx += io.bytes_sent
        host["net_rx_bytes_total"] = rx
        host["net_tx_bytes_total"] = tx

    def _read_process(self, host: dict) -> None:
        proc = self._self.proc
        now = time.monotonic()
        with proc.oneshot():
            ratio = self._self.cpu_ratio(now)
            rss = proc.memory_info().rss
            read = self._self.read_rate(now)
        host["process_cpu_ratio"] = ratio
        host["process_rss_bytes"] = int(rss)
        if read is not None:
            host["process_read_bytes_per_second"] = read

    def _worker_pids(self) -> list[int]:
        if self.dataloader_pids is not None and not self._pids_failed:
            try:
                return [int(p) for p in self.dataloader_pids() or ()]
            except Exception as e:
                self._pids_failed = True
                self.log(f"host: dataloader_pids() failed ({describe_error(e)}); using child processes instead")
        pids = child_pids(self.pid)
        if self.exclude_pids is not None and pids:
            try:
                excluded = set(self.exclude_pids())
            except Exception as e:
                self.exclude_pids = None
                self.log(f"host: exclude_pids() failed ({describe_error(e)}); ignored from now on")
                excluded = set()
            pids = [p for p in pids if p not in excluded]
        return pids

    def _read_workers(self, host: dict) -> None:
        now = time.monotonic()
        pids = self._worker_pids()
        seen = set()
        count = 0
        cpu = read = waited = 0.0
        for pid in pids:
            if pid in seen or pid == self.pid:
                continue
            seen.add(pid)
            entry = self._workers.get(pid)
            try:
                if entry is None:
                    proc = psutil.Process(pid)
                    # Listed children (no callback, or a failed one) include multiprocessing's helpers.
                    from_children = self.dataloader_pids is None or self._pids_failed
                    entry = _Proc(proc, helper=from_children and _is_helper(proc))
                    self._workers[pid] = entry
                elif not entry.proc.is_running():  # pid reused by another process
                    del self._workers[pid]
                    continue
                if entry.helper:
                    continue
                cpu += entry.cpu_ratio(now)
                rate = entry.read_rate(now)
                read = read + rate if rate is not None else read
                runq = entry.runqueue_ratio(now)
                waited = waited + runq if runq is not None else waited
                count += 1
            except psutil.Error:  # exited between listing and reading
                self._workers.pop(pid, None)
        # Forget processes that are gone, so the cache stays as small as the worker pool.
        for pid in [p for p in self._workers if p not in seen]:
            del self._workers[pid]
        host["dataloader_workers"] = count
        host["dataloader_workers_cpu_ratio"] = cpu
        # Storage reads of the workers seen twice or more (a new worker has no rate yet).
        host["dataloader_workers_read_bytes_per_second"] = read
        if self._schedstat:
            # Run-queue wait of the workers seen twice or more, as for the reads.
            host["dataloader_workers_runqueue_ratio"] = waited


def _is_helper(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in _HELPER_MARKERS)
