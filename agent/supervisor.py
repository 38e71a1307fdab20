"""The collectors of one rank beside its step path: the device/host sampler, the scheduled
profiler windows with their background analysis, the Prometheus endpoint and the NCCL watch.

Each is started, polled and stopped here; each that fails is switched off and logged once,
and the training goes on. The agent hands each collector's output to its sinks through the
callbacks it passes in (`on_sample`, `on_window`, `on_profile`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from diag import calibrate, rundir
from diag.collectors import device_map
from diag.collectors.profiler_guard import ProfilerGuard
from diag.collectors.profiler_windows import ProfilerWindows, WindowSettings
from diag.nccl_watch import NcclWatch
from diag.window_analysis import WindowAnalysis

if TYPE_CHECKING:  # imported when started: each may be unavailable
    from diag.collectors.sampler import Sampler
    from diag.exporter.runtime import Handle


class Collectors:
    def __init__(self, config, log: Callable[[str], None], event: Callable[..., None]):
        self.config = config
        self._log = log
        self._event = event
        self.sampler: Sampler | None = None
        self.windows: ProfilerWindows | None = None
        self.exporter: Handle | None = None
        self.analysis: WindowAnalysis | None = None  # one analysis process for the whole run
        self.nccl_watch: NcclWatch | None = None  # this rank's NCCL log and `diag nccl` results, live
        self.host_peaks: dict | None = None  # the host's calibration, on CPU runs that have one
        self.peak_flops: float | None = None
        self._device_recorded: str | None = None  # the device uuid rank.json holds

    # -- start-up ---------------------------------------------------------------------------

    def start(self, launch, writer, tree_settings: dict | None, *, on_sample, on_window, on_profile) -> int | None:
        """Start every collector the config asks for; the device index the sampler watches."""
        device = device_index(self.config.sampling.device, launch)
        if device is None:
            # The host's calibration (`diag calibrate`), read here once and recorded in rank.json:
            # analyses of this run use the record, never the cache of whichever machine they run on.
            self.host_peaks = calibrate.load()
            if self.host_peaks:
                writer.update_info(host_peaks=self.host_peaks)
        if self.config.sampling.enabled:
            self._start_sampler(device, on_sample)
        if self.config.profiler.enabled and writer.enabled:
            self._start_profiler(writer, launch.rank, tree_settings, on_window)
        self._start_exporter(launch, writer, device, on_profile)
        self._device_facts(writer)
        return device

    def _start_sampler(self, device, on_sample) -> None:
        try:
            from diag.collectors.sampler import Sampler

            # The sampler finds DataLoader workers among our children (a few /proc reads);
            # the window analysis process is ours, not a worker.
            self.sampler = Sampler(device, exclude_pids=self.worker_pids, interval_s=self.config.sampling.interval_s,
                                   on_sample=on_sample, log=self._log)
            self.sampler.start()
        except Exception as exc:
            self.sampler = None
            self._log(f"sampler: switched off ({type(exc).__name__}: {exc})")

    def _start_profiler(self, writer, rank: int, tree_settings: dict | None, on_window) -> None:
        """Scheduled profiler windows behind the guard that lets the job's own profilers first,
        each window's trace analysed in the background."""
        s = self.config.profiler
        self.analysis = WindowAnalysis(writer.rank_path / rundir.WINDOWS, rank, tree_settings, self.host_peaks,
                                       on_done=on_window, log=self._log)
        guard = ProfilerGuard(self._log)
        try:
            guard.install()  # the job's own profilers come first
            self.windows = ProfilerWindows(
                writer.rank_path / rundir.TRACES,
                WindowSettings(skip_first=s.skip_first, warmup=s.warmup, active=s.active, every=s.every,
                               record_shapes=s.record_shapes, with_flops=s.with_flops,
                               profile_memory=s.profile_memory, stack_windows=s.stack_windows,
                               budget_bytes=s.trace_budget_bytes,
                               export_in_child=s.export_in_child),
                trigger_dir=writer.path, on_trace=self._on_trace, log=self._log,
                in_use=self.analysis.in_use, guard=guard,
            )
            self.windows.install_signal()
        except Exception as exc:
            guard.uninstall()
            self.windows = None
            self._log(f"profiler: switched off ({type(exc).__name__}: {exc})")

    def _start_exporter(self, launch, writer, device, on_profile) -> None:
        if not self.config.exporter.enabled:
            return
        try:
            from diag.exporter import runtime
        except Exception as exc:
            self._log(f"exporter: unavailable ({type(exc).__name__}: {exc})")
            return
        identity = {
            # The run's id, as rank.json records it: `diag export` of the same run labels it alike.
            "run": writer.run_id or "run",
            "rank": str(launch.rank),
            "local_rank": launch.local_rank,
            "host": launch.hostname,
            "gpu": "" if device is None else str(device),
        }
        try:
            self.exporter = runtime.start(
                identity, port_base=self.config.exporter.port, bind=self.config.exporter.bind,
                enabled=True, log=self._log, on_profile=on_profile,
            )
        except Exception as exc:
            self.exporter = None
            self._log(f"exporter: switched off ({type(exc).__name__}: {exc})")

    def _device_facts(self, writer) -> None:
        """Device facts for rank.json and the peak FLOP/s for MFU."""
        facts: dict | None = None
        if self.sampler is not None:
            try:
                facts = self.sampler.info(timeout=2.0)
            except Exception:
                facts = None
        writer.update_info(device=facts)
        self._device_recorded = (facts or {}).get("uuid")
        report = self.config.report
        if not (report.flops_per_sample or report.flops_per_token):
            return
        try:
            from diag.analyzers.trace import devices

            dev = None
            if facts and facts.get("name"):
                dev = devices.lookup({"name": facts["name"], "totalGlobalMem": facts.get("memory_total_bytes")})
            if dev is None and not (facts and facts.get("vendor")) and self.host_peaks:
                dev = devices.host_device(self.host_peaks)
            dtype = report.mfu_dtype or ("fp32" if dev is not None and dev.key == "cpu" else "bf16")
            self.peak_flops = dev.peak_flops(dtype) if dev is not None else None
            if self.peak_flops is None:
                self._log("mfu: device peak unknown (run `diag calibrate` on CPU hosts); MFU not reported")
        except Exception as exc:
            self._log(f"mfu: off ({type(exc).__name__}: {exc})")

    def identify_device(self) -> None:
        """Tell the sampler which device torch now uses (it was chosen by index at start, before
        CUDA or ROCm existed in this process); it reopens the right one if it must."""
        if self.sampler is None:
            return
        try:
            identity = device_map.torch_device_identity()
            if identity is not None:
                self.sampler.identify(identity)
        except Exception as exc:
            self._log(f"sampler: could not identify torch's device ({type(exc).__name__}: {exc})")

    # -- while the job runs -------------------------------------------------------------------

    def status(self, writer, verdicts_on: bool) -> dict:
        """Which collectors are on, for the heartbeat."""
        return {
            "writer": bool(writer and writer.enabled),
            "profiler": bool(self.windows and self.windows.enabled),
            "sampler": self.sampler is not None,
            "exporter": self.exporter is not None,
            "exporter_port": getattr(self.exporter, "port", None),
            "verdicts": verdicts_on,
        }

    def poll(self, writer, submit: bool) -> None:
        """Once a second: an on-demand window asked for by signal or file, finished window
        analyses, the NCCL log, and the exporter's view of the profiler."""
        if self.windows is not None:
            first = self.windows.poll_trigger()
            if first is not None:
                self._event("profiler", f"on-demand window requested at step {first}")
        self.poll_analysis(submit)
        if self.exporter is not None and writer is not None:
            if self.nccl_watch is None:
                self.nccl_watch = NcclWatch(writer.path, writer.rank_path, self.exporter, self._log)
            self.nccl_watch.poll()
        if self.exporter is not None and self.windows is not None:
            self.exporter.observe_profiler(self.windows.window_steps)

    def poll_analysis(self, submit: bool) -> None:
        """Collect finished window analyses and hand the next trace to the analysis process."""
        a = self.analysis
        if a is None:
            return
        a.poll(submit=submit)
        if self.windows is not None and a.idle:
            self.windows.enforce_budget()

    def _on_trace(self, first: int, last: int, path: Path) -> None:
        if self.analysis is not None:
            self.analysis.queue(first, last, path)
        self._event("profiler", f"window {first}-{last} saved to {path.name}")

    def worker_pids(self) -> list[int]:
        return self.analysis.pids() if self.analysis is not None else []

    # -- shutdown ---------------------------------------------------------------------------------

    def stop_sampling(self, writer, quick: bool) -> None:
        """Stop the profiler windows (waiting for their traces) and the sampler."""
        if self.windows is not None:
            self.windows.close()
            self.windows.guard.uninstall()
            self.windows.wait_exported(10.0 if quick else 60.0)
        if self.sampler is not None:
            try:
                self.sampler.stop()
                facts = self.sampler.info(timeout=0)
                if writer is not None and facts.get("uuid") != self._device_recorded:
                    writer.update_info(device=facts)  # the sampler moved to torch's device
            except Exception as exc:
                self._log(f"sampler: stop failed ({exc})")

    def finish_analysis(self, writer, timeout_s: float, beat: Callable[[], None] | None = None) -> None:
        """Give the analysis of the last windows up to timeout_s (calling `beat`, the rank's
        heartbeat, meanwhile), then end the analysis process; none where the run directory can
        no longer be written (a full disk): no summary could land, so waiting for one would only
        hold the process's exit."""
        if self.analysis is not None:
            self.analysis.finish(timeout_s if getattr(writer, "enabled", True) else 0.0, beat)
        if self.windows is not None:
            self.windows.enforce_budget()

    def close_exporter(self) -> None:
        if self.exporter is not None:
            try:
                self.exporter.close()
            except Exception:
                pass


def device_index(device_arg, launch) -> int | None:
    """The device the sampler watches: the configured index, or torch's current device (or the
    local rank's, where torch has not chosen yet); None on CPU."""
    if device_arg != "auto":
        return device_arg if isinstance(device_arg, int) else None
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
            n = torch.cuda.device_count()
            return launch.local_rank % n if n else None
    except Exception:
        pass
    return None
