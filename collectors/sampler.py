"""Background sampling of device and host metrics: one daemon thread, 1 Hz by default.

    sampler = Sampler(device_index=local_rank, on_sample=handle.observe_sample, log=events.log)
    sampler.start()          # returns at once; the thread opens NVML/amdsmi and probes
    sampler.info()           # static facts of the device (waits, bounded, for the probe)
    sampler.latest()         # the newest sample, or None before the first one
    sampler.stop()           # joins the thread (bounded) and shuts the libraries down

Each sample follows the metric sample contract (``diag.rundir`` samples stream):
``{"t": unix seconds, "gpu": {...} | None, "host": {...}}`` in base units, with keys absent
when the metric is unsupported. The GPU vendor is NVIDIA when NVML initialises and has
devices, else AMD when amdsmi does, else none (``gpu`` is null and host metrics go on).

The libraries are opened in the sampling thread, so a slow or hanging driver never
delays the training loop; all their calls happen on that one thread. Samples are taken
on a fixed schedule (no drift); when one overruns, the missed ticks are skipped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from diag.collectors.metric_set import describe_error

if TYPE_CHECKING:  # imported when sampling starts
    from diag.collectors.host_metrics import HostMetrics

Log = Callable[[str], None]

INFO_WAIT_S = 5.0  # longest info() waits for the thread to open the device
STOP_JOIN_S = 5.0  # longest stop() waits for a sample in progress (a stuck driver call)

_NO_GPU_INFO = {
    "vendor": None,
    "name": None,
    "uuid": None,
    "memory_total_bytes": None,
    "driver_version": None,
    "physical_index": None,
    "index": None,
}


class Sampler:
    """Samples the rank's device (``device_index``: logical index as torch sees it, None for
    a CPU-only rank) and the host every ``interval_s`` seconds, passing each sample to
    ``on_sample`` on the sampling thread. ``log`` receives one line per notable event
    (a library missing, a metric switched off), never one per sample."""

    def __init__(
        self,
        device_index: int | None,
        interval_s: float = 1.0,
        on_sample: Callable[[dict], None] | None = None,
        log: Log | None = None,
        dataloader_pids: Callable[[], list[int]] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        vendors: tuple[str, ...] = ("nvidia", "amd"),
        exclude_pids: Callable[[], Iterable[int]] | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.device_index = device_index
        self.interval_s = float(interval_s)
        self.on_sample = on_sample
        self.log: Log = log or (lambda _msg: None)
        self.dataloader_pids = dataloader_pids
        self.exclude_pids = exclude_pids
        self.env = os.environ if env is None else env
        self.vendors = vendors
        self.samples_taken = 0
        self.open_cpu_s = 0.0  # CPU time the thread spent opening and probing (once)
        self.thread_cpu_s = 0.0  # CPU time of the sampling thread since, for the overhead budget
        self._gpu = None
        self._host: HostMetrics | None = None
        self._info: dict = {**_NO_GPU_INFO, "logical_index": device_index, "state": "not started"}
        self._latest: dict | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._callback_failed = False
        self._identity = None  # torch's device, handed over by the training thread

    # ---- public API -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._info["state"] = "starting"
        self._thread = threading.Thread(target=self._run, name="diag-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(STOP_JOIN_S + self.interval_s)
        if thread.is_alive():
            self.log(f"sampler: thread still busy {STOP_JOIN_S + self.interval_s:.0f} s after stop; left as daemon")

    def identify(self, identity) -> None:
        """torch's device (a device_map.DeviceIdentity), from the training thread once torch has
        initialised it: at its next sample the sampling thread makes sure it samples that one."""
        self._identity = identity

    def latest(self) -> dict | None:
        return self._latest

    def info(self, timeout: float = INFO_WAIT_S) -> dict:
        """Static facts: vendor, name, uuid, memory_total_bytes, driver_version, physical_index, ..."""
        if self._thread is not None:
            self._ready.wait(timeout)
        return dict(self._info)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._open()
        except Exception as e:  # never let a collector bug escape into the process
            self.log(f"sampler: opening collectors failed ({describe_error(e)})")
        finally:
            self._ready.set()
        self.open_cpu_s = time.thread_time() - cpu0
        cpu0 = time.thread_time()
        try:
            next_t = time.monotonic()
            while not self._stop.is_set():
                self._sample_once()
                self.thread_cpu_s = time.thread_time() - cpu0
                next_t += self.interval_s
                now = time.monotonic()
                if next_t <= now:  # overran: skip missed ticks instead of bursting
                    next_t = now + self.interval_s - ((now - next_t) % self.interval_s)
                self._stop.wait(next_t - now)
        except Exception as e:
            self.log(f"sampler: stopped after an unexpected error ({describe_error(e)})")
        finally:
            self._close()
            self.thread_cpu_s = time.thread_time() - cpu0
            self._info["state"] = "stopped"

    def _open(self) -> None:
        from diag.collectors.host_metrics import HostMetrics

        try:
            self._host = HostMetrics(self.log, self.dataloader_pids, exclude_pids=self.exclude_pids)
        except Exception as e:
            self.log(f"host: metrics unavailable ({describe_error(e)})")
        # No device index means the rank computes on the CPU: its GPU record stays null.
        if self.device_index is None:
            self._gpu = None
            self._info["gpu_unavailable"] = "no device index: the rank runs on the CPU"
        else:
            self._gpu = self._open_gpu()
        if self._gpu is not None:
            self._info = {**_NO_GPU_INFO, **self._gpu.info(), "logical_index": self.device_index}
        host_state = self._host.state() if self._host is not None else {"metrics": [], "unsupported": {}}
        self._info["host_metrics"] = host_state["metrics"]
        self._info["interval_s"] = self.interval_s
        self._info["state"] = "running"

    def _open_gpu(self, identity=None):
        reasons: list[str] = []

        def log(message: str) -> None:
            reasons.append(message)
            self.log(message)

        vendors = self.vendors
        if identity is not None:
            vendors = [v for v in vendors if v == ("amd" if identity.runtime == "rocm" else "nvidia")]
        for vendor in vendors:
            if vendor == "nvidia":
                from diag.collectors.gpu_nvml import NvmlGpu

                device = NvmlGpu.open(self.device_index, log, self.env, identity=identity)
            elif vendor == "amd":
                from diag.collectors.gpu_amdsmi import AmdSmiGpu

                device = AmdSmiGpu.open(self.device_index, log, self.env, identity=identity)
            else:
                continue
            if device is not None:
                return device
        # Why there is no GPU record, for rank.json and the report.
        self._info["gpu_unavailable"] = "; ".join(reasons) or "no GPU vendor enabled"
        return None

    def _reidentify(self, identity) -> None:
        """Reopen the device torch uses when the one opened at start (by index) is another."""
        gpu = self._gpu
        if self.device_index is None or (gpu is not None and gpu.matches(identity)):
            return
        was = gpu.info().get("selected_by") if gpu is not None else None
        self._close_gpu()
        self._gpu = self._open_gpu(identity)
        if self._gpu is None:  # _open_gpu said why in gpu_unavailable
            self._info = {**self._info, **_NO_GPU_INFO}
            return
        self._info = {k: v for k, v in {**self._info, **self._gpu.info()}.items() if k != "gpu_unavailable"}
        self.log(f"sampler: torch's device is {identity.describe()}: sampling it"
                 + (f" instead of {was}" if was else ""))

    def _sample_once(self) -> None:
        identity, self._identity = self._identity, None
        if identity is not None:
            try:
                self._reidentify(identity)
            except Exception as e:
                self.log(f"sampler: re-identifying the device failed ({describe_error(e)})")
        sample: dict = {"t": time.time(), "gpu": None, "host": {}}
        if self._gpu is not None:
            try:
                sample["gpu"] = self._gpu.read()
            except Exception as e:  # read_into already contains metric failures; this is a bug guard
                self.log(f"sampler: GPU sampling switched off ({describe_error(e)})")
                self._close_gpu()
        if self._host is not None:
            try:
                sample["host"] = self._host.read()
            except Exception as e:
                self.log(f"sampler: host sampling switched off ({describe_error(e)})")
                self._host = None
        self._latest = sample
        self.samples_taken += 1
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception as e:
                if not self._callback_failed:
                    self._callback_failed = True
                    self.log(f"sampler: on_sample raised ({describe_error(e)}); further errors not logged")

    def _close_gpu(self) -> None:
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            try:
                gpu.close()
            except Exception:
                pass

    def _close(self) -> None:
        if self._gpu is not None:
            self._info.update(self._gpu.info())
        self._close_gpu()
