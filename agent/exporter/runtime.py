"""The exporter inside a training process: one Prometheus endpoint per rank, serving the metrics of
diag.exporter.metrics_table.

    handle = start({"run": ..., "rank": 0, "local_rank": 0, "host": ..., "gpu": "0"})
    handle.observe_step(step_record)      # from the agent's step path
    handle.observe_sample(sample)         # from the sampling thread
    handle.observe_window(rank_dict)      # after a profiler window was analysed
    handle.observe_nccl(document)         # diag.nccl_bench/1 or diag.nccl_log/2 (or /1)
    handle.close()

The endpoint listens on port base + LOCAL_RANK (default base 9870, all interfaces), so
ranks on one host never collide. Environment: DIAG_EXPORTER=0 turns it off,
DIAG_EXPORTER_PORT sets the base (0 = any free port), DIAG_EXPORTER_BIND the address.
A port in use gives a warning and the next free port; a server that cannot start at
all gives a warning and no exporter, and the training goes on either way.

The observe_* methods never raise and never block on the network: they do their
arithmetic first, then apply it to plain dictionaries under a lock that a scrape holds
only while copying them. A record the exporter cannot use is counted in
diag_exporter_errors_total{stage} and otherwise ignored.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from typing import Any

from diag.analyzers.diagnosis import nccl_log
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import finite as _num
from diag.diagnosis_document import Diagnosis
from diag.exporter.metrics_table import BOUNDS, CLASSES, CLOCK_EVENT_REASONS, STRAGGLER_KINDS
from diag.exporter.registry import MetricState, make_registry, render_text
from diag.exporter.server import MetricsServer
from diag.step_record import StepRecord

DEFAULT_PORT_BASE = 9870
DEFAULT_BIND = "0.0.0.0"
# How far past a taken port we look; 8 GPUs per host plus a few strays fit easily.
PORT_SEARCH = 64
# Throughput is integrated between samples; a gap longer than this (a paused sampler,
# a suspended job) is not filled with an assumed constant rate.
MAX_INTEGRATION_GAP_S = 30.0

_OFF = ("0", "false", "no", "off")


class Handle:
    """One rank's metrics, and the HTTP server that serves them when it runs."""

    def __init__(self, identity: dict, port: int | None = None, bind: str = "", start_time: float | None = None):
        self.identity = dict(identity)
        self.state = MetricState(identity, start_time=start_time)
        self.registry = make_registry([self.state])
        self.port = port
        self.bind = bind
        self._server = None
        self._last_sample_t: float | None = None
        self._closed = False

    @property
    def url(self) -> str | None:
        if self.port is None:
            return None
        host = "127.0.0.1" if self.bind in ("", "0.0.0.0", "::") else self.bind
        return f"http://{host}:{self.port}/metrics"

    # ---------------------------------------------------------------- observers
    def observe_step(self, record: StepRecord, bound: str | None = None) -> None:
        """A step record, with its live verdict (the record holds facts only)."""
        self._guard("step", lambda rec: self._step(rec, bound), record, StepRecord)

    def observe_sample(self, sample: dict) -> None:
        self._guard("sample", self._sample, sample)

    def observe_window(self, rank_dict: Mapping[str, Any]) -> None:
        self._guard("window", self._window, rank_dict)

    def observe_nccl(self, doc: dict) -> None:
        self._guard("nccl", self._nccl, doc)

    def observe_diagnosis(self, diagnosis: Diagnosis) -> None:
        """The job's verdict, phase shares and straggler episodes from its diagnosis."""
        self._guard("diagnosis", self._diagnosis, diagnosis, Diagnosis)

    def observe_event(self, event: dict) -> None:
        """An agent event record (collector switched off, fault, ...); OOM errors are counted."""
        self._guard("event", self._event, event)

    def observe_profiler(self, window_steps) -> None:
        """Whether a profiler window records steps now (`ProfilerWindows.window_steps`)."""
        with self.state.lock:
            self.state.set("diag_profiler_window_active", 1.0 if window_steps else 0.0)

    def _guard(self, kind: str, fn, obj, expected: type = dict) -> None:
        try:
            if not isinstance(obj, expected):
                raise TypeError(f"{kind} record is not a {expected.__name__}")
            fn(obj)
            ok = True
        except Exception:
            ok = False
        try:
            with self.state.lock:
                self.state.inc("diag_exporter_observations_total", 1.0, (kind,))
                if not ok:
                    self.state.inc("diag_exporter_errors_total", 1.0, (kind,))
        except Exception:
            pass

    # ---------------------------------------------------------------- record -> metrics
    def _step(self, rec: StepRecord, bound: str | None) -> None:
        duration = rec.duration_s
        if duration is None:
            raise ValueError("step record without a duration")
        wait = min(rec.data_wait_s, duration) if rec.data_wait_s is not None else None
        shares = rec.shares
        fractions = [f for f in (shares.get(b) for b in BOUNDS) if f is not None] if shares is not None else []
        if shares is not None and len(fractions) == len(BOUNDS):
            phases = [(b, duration * f if f > 0 else 0.0) for b, f in zip(BOUNDS, fractions)]
            wait_f = shares.get("wait")
            if wait_f is not None and wait_f > 0:
                phases.append(("wait", duration * wait_f))
        else:
            phases = [("data", wait or 0.0), ("unattributed", duration - (wait or 0.0))]
        end = rec.start_unix + duration if rec.start_unix is not None else time.time()
        samples, tokens, peak, mfu, device = rec.samples, rec.tokens, rec.peak_mem_bytes, rec.mfu, rec.device_s
        s = self.state
        with s.lock:
            s.inc("diag_steps_total", 1.0)
            s.observe("diag_step_duration_seconds", duration)
            if device is not None:
                s.observe("diag_step_device_seconds", device)
            for phase, seconds in phases:
                s.inc("diag_step_phase_seconds_total", seconds, (phase,))
            if bound in BOUNDS:
                s.inc("diag_step_bound_total", 1.0, (bound,))
            if wait is not None:
                s.inc("diag_data_wait_seconds_total", wait)
            s.set("diag_last_step_timestamp_seconds", end)
            if samples is not None and samples > 0:
                s.inc("diag_samples_total", samples)
            if tokens is not None and tokens > 0:
                s.inc("diag_tokens_total", tokens)
            if peak is not None:
                s.set("diag_step_peak_memory_bytes", peak)
            if mfu is not None:
                s.set("diag_mfu_ratio", mfu)

    _GPU_GAUGES = (
        ("utilization_ratio", "diag_gpu_utilization_ratio"),
        ("memory_used_bytes", "diag_gpu_memory_used_bytes"),
        ("memory_total_bytes", "diag_gpu_memory_total_bytes"),
        ("power_watts", "diag_gpu_power_watts"),
        ("energy_joules_total", "diag_gpu_energy_joules_total"),
        ("temperature_celsius", "diag_gpu_temperature_celsius"),
        ("sm_clock_hz", "diag_gpu_sm_clock_hertz"),
        ("xid_errors_total", "diag_gpu_xid_errors_total"),
        ("ecc_errors_total", "diag_gpu_ecc_errors_total"),
    )
    _HOST_GAUGES = (
        ("cpu_ratio", "diag_host_cpu_ratio", ()),
        ("memory_used_bytes", "diag_host_memory_used_bytes", ()),
        ("memory_total_bytes", "diag_host_memory_total_bytes", ()),
        ("disk_read_bytes_total", "diag_host_disk_bytes_total", ("read",)),
        ("disk_write_bytes_total", "diag_host_disk_bytes_total", ("write",)),
        ("net_rx_bytes_total", "diag_host_network_bytes_total", ("rx",)),
        ("net_tx_bytes_total", "diag_host_network_bytes_total", ("tx",)),
        ("process_cpu_ratio", "diag_process_cpu_ratio", ()),
        ("process_rss_bytes", "diag_process_resident_memory_bytes", ()),
        ("dataloader_workers", "diag_dataloader_workers", ()),
        ("dataloader_workers_cpu_ratio", "diag_dataloader_workers_cpu_ratio", ()),
        ("cpu_iowait_ratio", "diag_host_cpu_iowait_ratio", ()),
        ("process_read_bytes_per_second", "diag_process_read_bytes_per_second", ()),
        ("dataloader_workers_read_bytes_per_second", "diag_dataloader_workers_read_bytes_per_second", ()),
    )

    def _sample(self, sample: dict) -> None:
        t = _num(sample.get("t")) or time.time()
        dt = None
        if self._last_sample_t is not None and 0 < t - self._last_sample_t <= MAX_INTEGRATION_GAP_S:
            dt = t - self._last_sample_t
        self._last_sample_t = t
        updates: list[tuple] = []  # (method, name, value, labels)
        gpu = sample.get("gpu")
        if isinstance(gpu, dict):
            if isinstance(gpu.get("name"), str) or isinstance(gpu.get("uuid"), str):
                updates.append(("replace", "diag_gpu_info",
                                {(str(gpu.get("name") or ""), str(gpu.get("uuid") or "")): 1.0}, None))
            for key, name in self._GPU_GAUGES:
                v = _num(gpu.get(key))
                if v is not None:
                    updates.append(("set", name, v, ()))
            events = gpu.get("clock_events")
            if isinstance(events, (list, tuple)):
                active = {str(e) if str(e) in CLOCK_EVENT_REASONS else "other" for e in events}
                series = {(r,): float(r in active) for r in CLOCK_EVENT_REASONS}
                series.update({(r,): 1.0 for r in sorted(active) if (r,) not in series})
                updates.append(("replace", "diag_gpu_clock_event_active", series, None))
            for direction in ("tx", "rx"):
                rate = _num(gpu.get(f"pcie_{direction}_bytes_per_second"))
                if rate is not None:
                    updates.append(("inc", "diag_gpu_pcie_bytes_total", rate * dt if dt else 0.0, (direction,)))
                total = _num(gpu.get(f"nvlink_{direction}_bytes_total"))
                if total is not None:
                    updates.append(("set", "diag_gpu_nvlink_bytes_total", total, (direction,)))
        host = sample.get("host")
        if isinstance(host, dict):
            for key, name, labels in self._HOST_GAUGES:
                v = _num(host.get(key))
                if v is not None:
                    updates.append(("set", name, v, labels))
        s = self.state
        with s.lock:
            for method, name, value, labels in updates:
                if method == "replace":
                    s.replace(name, value)
                else:
                    getattr(s, method)(name, value, labels)

    def _window(self, rank: dict) -> None:
        mfu = _num(rank.get("mfu"))
        gpu_time = dict_at(rank, "gpu_time")
        overlap = _num(gpu_time.get("comm_compute_overlap_pct"))
        findings = _count_ids(rank.get("findings"))
        s = self.state
        with s.lock:
            if mfu is not None:
                s.set("diag_mfu_ratio", mfu)
            if overlap is not None:
                s.set("diag_comm_compute_overlap_ratio", overlap / 100.0)
            s.replace("diag_analysis_findings", findings)

    def _nccl(self, doc: dict) -> None:
        schema = str(doc.get("schema", ""))
        if schema.startswith("diag.nccl_bench/"):
            bw = {}
            for test in doc.get("tests") or []:
                gbps = _num(test.get("avg_busbw_gbps")) if isinstance(test, dict) else None
                if gbps is not None and test.get("collective"):
                    # nccl-tests reports GB/s with GB = 1e9 bytes.
                    bw[(str(test["collective"]),)] = gbps * 1e9
            with self.state.lock:
                for labels, value in bw.items():
                    self.state.set("diag_nccl_bus_bandwidth_bytes_per_second", value, labels)
        elif schema.startswith("diag.nccl_log/"):
            findings = _count_ids(nccl_log.findings(doc))
            with self.state.lock:
                self.state.replace("diag_nccl_findings", findings)
        else:
            raise ValueError(f"unknown NCCL document schema {schema!r}")

    def _diagnosis(self, doc: Diagnosis) -> None:
        bound = doc.bound
        if bound is not None and bound not in BOUNDS:
            raise ValueError(f"unknown bound {bound!r}")
        shares = doc.phase_shares or {}
        ratios: dict[tuple[str, ...], float] = {(b,): v for b, v in ((b, _num(shares.get(b))) for b in CLASSES)
                                                  if v is not None}
        with self.state.lock:
            bounds: dict[tuple[str, ...], float] = {(b,): float(b == bound) for b in BOUNDS} if bound else {}
            self.state.replace("diag_job_bound", bounds)
            self.state.replace("diag_job_phase_ratio", ratios)
            episodes = doc.straggler_episodes
            if episodes is not None and isinstance(episodes.get("episodes"), list):
                eps = [e for e in episodes["episodes"] if isinstance(e, dict) and e.get("kind") in STRAGGLER_KINDS]
                self.state.replace("diag_job_straggler_episode_active",
                                   {(k,): float(any(e["kind"] == k and e.get("ongoing") is True for e in eps))
                                    for k in STRAGGLER_KINDS})
                self.state.replace("diag_job_straggler_lost_seconds",
                                   {(k,): sum(_num(e.get("cost_ms")) or 0.0 for e in eps if e["kind"] == k) / 1000.0
                                    for k in STRAGGLER_KINDS})

    def _event(self, event: dict) -> None:
        if _is_oom(event):
            with self.state.lock:
                self.state.inc("diag_oom_errors_total", 1.0)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        server, self._server = self._server, None
        if server is not None:
            try:
                server.stop()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _count_ids(findings) -> dict[tuple[str, ...], float]:
    counts: dict[tuple[str, ...], float] = {}
    for f in findings or []:
        if isinstance(f, dict) and f.get("id"):
            key = (str(f["id"]),)
            counts[key] = counts.get(key, 0.0) + 1.0
    return counts


def _is_oom(event: dict) -> bool:
    for key in ("kind", "type", "event", "name"):
        if str(event.get(key, "")).lower() in ("oom", "out_of_memory", "outofmemoryerror"):
            return True
    text = " ".join(str(event.get(k, "")) for k in ("error", "message", "exception")).lower()
    return "outofmemoryerror" in text or "out of memory" in text


def _env_port() -> int | None:
    raw = os.environ.get("DIAG_EXPORTER_PORT", "").strip()
    return int(raw) if raw.isdigit() else None


def start(identity: dict, port_base: int | None = None, bind: str | None = None, enabled: bool = True,
          log=print, on_profile=None) -> Handle | None:
    """Start this rank's endpoint. None when turned off or when no server could start.
    `on_profile(first_step or None)` answers POST /profile (a profiler window on request)."""
    try:
        if not enabled or os.environ.get("DIAG_EXPORTER", "").strip().lower() in _OFF:
            return None
        base = port_base if port_base is not None else _env_port()
        base = DEFAULT_PORT_BASE if base is None else int(base)
        bind = bind or os.environ.get("DIAG_EXPORTER_BIND", "").strip() or DEFAULT_BIND
        local = identity.get("local_rank") if isinstance(identity, dict) else 0
        local = int(local) if isinstance(local, int) and local >= 0 else 0
        wanted = 0 if base == 0 else base + local
        handle = Handle(identity, bind=bind)
        server = _serve(handle, wanted, bind, log, on_profile)
        if server is None:
            return None
        handle._server, handle.port = server, server.port
        return handle
    except Exception as exc:  # the exporter must never take the training down
        _say(log, f"diag: exporter: not started ({exc})")
        return None


def _serve(handle: Handle, wanted: int, bind: str, log, on_profile=None):
    state = handle.state

    def on_error():
        with state.lock:
            state.inc("diag_exporter_errors_total", 1.0, ("collect",))

    tries = 1 if wanted == 0 else PORT_SEARCH
    for i in range(tries):
        port = wanted + i if wanted else 0
        if port > 65535:
            break
        try:
            server = MetricsServer((bind, port), lambda: render_text([state]), on_error, on_profile,
                                   log=lambda message: _say(log, f"diag: {message}"))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and wanted:
                continue
            _say(log, f"diag: exporter: cannot listen on {bind}:{port} ({exc.strerror or exc}); "
                      "metrics endpoint off, training goes on")
            return None
        if wanted and server.port != wanted:
            _say(log, f"diag: exporter: port {wanted} in use; rank {handle.identity.get('rank')} serves "
                      f"metrics on {bind}:{server.port} instead")
        return server.start()
    _say(log, f"diag: exporter: no free port in {wanted}-{wanted + tries - 1}; metrics endpoint off")
    return None


def _say(log, message: str) -> None:
    try:
        log(message)
    except Exception:
        pass

