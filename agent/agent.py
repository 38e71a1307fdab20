"""`diag.Agent`: wrap a training loop on every rank; rank 0 writes the job's report at exit.

    with diag.Agent(run_dir="runs/exp1") as agent:
        for batch in agent.loader(train_loader):   # times the wait for each batch
            loss = train_step(batch)
            agent.step(samples=len(batch))         # marks the end of a training step

The step path does only host-side bookkeeping: a monotonic clock read, an append to a
queue and, inside profiler windows, the profiler's step markers. Everything else (the
per-step verdict, writing records, the exporter, trace analysis) happens on one
background thread or in a background process. Each part that fails is switched off
and logged once (to stderr and to the rank's events stream); the training goes on.
Exceptions from the user's loop propagate unchanged.
"""

from __future__ import annotations

import atexit
import collections
import copy
import numbers
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from diag import calibrate, rundir
from diag.batches import count_samples
from diag.batches import parts as batch_parts
from diag.collectors import device_map, launch_env, nccl_env
from diag.collectors.device_clock import DeviceClock, HeldSteps
from diag.collectors.live_state import LiveState
from diag.collectors.loader_facts import loader_facts, time_collate
from diag.collectors.profiler_guard import ProfilerGuard
from diag.collectors.profiler_windows import ProfilerWindows, WindowSettings
from diag.collectors.run_writer import RunWriter
from diag.collectors.step_timer import PeakMemory, StepTimer
from diag.config import FLAT, AgentConfig
from diag.errors import DiagInputError
from diag.live_verdict import LiveVerdicts
from diag.nccl_watch import NcclWatch
from diag.window_analysis import WindowAnalysis

_DATA_WAIT_NAME = "enumerate(DataLoader)#diag.Agent.loader"
_EXCEPTION_TEXT = re.compile(r"\A([A-Za-z_][\w.]*)(?:: (.*))?\Z", re.S)  # "OutOfMemoryError: CUDA out of memory"


class Terminated(SystemExit):
    """Raised in the training thread when the process is told to stop (SIGTERM) and the job has
    no handler of its own: the loop unwinds as for Ctrl-C, the agent records the end, and the
    process then ends by the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return (f"{signal.Signals(self.signum).name}: the process was told to stop (a scheduler's time limit, "
                "torchrun or Kubernetes)")


def _plausible(value, field: str) -> bool:
    """A step's count as the job passed it: a plain number is checked here (rundir.plausible_count);
    a tensor or NumPy scalar is read only when the record is written, off the training thread
    (reading a device tensor waits for the device), and checked when the run is read."""
    return rundir.plausible_count(value, field) or (not isinstance(value, numbers.Real) and hasattr(value, "item"))


class Agent:
    """The diagnostics agent of one rank. Use as a context manager, or start()/close().

    Every setting is a field of `diag.AgentConfig` (grouped: profiler, sampling, exporter,
    nccl, report, run), set by keyword argument under its flat name, by a `DIAG_*`
    environment variable, or in the config file's `[agent.<section>]` tables; `diag config
    --show` lists them all with their defaults and one-line docs. The main ones:
      run_dir        folder of the run (default $DIAG_RUN_DIR or runs/<script>); a folder
                     holding an earlier run is never overwritten: the run goes to <run_dir>-2, ...
      profile, skip_first, warmup, active, every: profiler windows and their schedule
      sampling, sample_interval_s: device/host sampling thread (1 Hz by default)
      export, export_port_base, export_bind, export_linger_s: the Prometheus endpoint
      flops_per_sample, flops_per_token, mfu_dtype: model FLOPs for MFU
      report, report_wait_s: rank 0 writes the job report at exit
    Besides those:
      config         an AgentConfig to start from (instead of defaults, file and environment)
      config_file    a TOML/YAML config file (default $DIAG_CONFIG); its [thresholds] feed the tree
      thresholds     decision-tree threshold overrides, {name: value}
      on_closed      called with the agent once the run directory is closed (and, on rank 0,
                     the report written), before the endpoint lingers
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, *, config: AgentConfig | None = None,
                 config_file: str | os.PathLike | None = None, thresholds: dict | None = None,
                 on_closed=None, **options):
        if run_dir is not None:
            options["run_dir"] = str(run_dir)
        self._config_problem: str | None = None
        if config is not None:
            cfg = copy.deepcopy(config)
            for flat, value in options.items():
                if flat not in FLAT:
                    raise TypeError(f"unknown agent option {flat!r}; known: {', '.join(sorted(FLAT))}")
                cfg._set(*FLAT[flat], value, "argument")
            if thresholds:
                cfg.thresholds = dict(thresholds)
        else:
            try:
                cfg = AgentConfig.resolve(config_file=config_file, thresholds=thresholds, **options)
            except DiagInputError as exc:
                # A bad file or variable must not stop the training: its settings are left out, once logged.
                self._config_problem = f"config: {exc}; the agent uses its defaults and arguments"
                cfg = AgentConfig.resolve(env={}, thresholds=thresholds, **options)
        self.config = cfg
        r = cfg.run
        self._run_dir_arg = r.dir
        self._run_id = r.id
        self._device_arg = cfg.sampling.device
        self._verbose = r.verbose
        self.report_wait_s = cfg.report.wait_s
        self.analysis_wait_s = cfg.profiler.analysis_wait_s
        self.analyse_during_run = cfg.profiler.analyse_during_run
        self.heartbeat_s = r.heartbeat_s
        self.flush_s = r.flush_s
        self.live_s = max(float(r.live_s or 0.0), 0.0)
        self.live = LiveState()  # the last steps and sample, for diag top (live.json)
        self.export_linger_s = max(float(cfg.exporter.linger_s or 0.0), 0.0)
        self._on_closed = on_closed
        self._linger_stop = threading.Event()

        self.launch: launch_env.LaunchInfo | None = None
        self.writer: RunWriter | None = None
        self.windows: ProfilerWindows | None = None
        self.sampler = None
        self._device_recorded: str | None = None  # the device uuid rank.json holds
        self.exporter = None
        self.tree = None
        self.verdicts = LiveVerdicts(None, self._log)  # each step's live verdict, once the tree is loaded
        self.host_peaks: dict | None = None  # the host's calibration, on CPU runs that have one
        self.timer: StepTimer | None = None
        # Device step time and idle time within data waits, once torch has a CUDA/HIP device.
        self.clock: DeviceClock | None = None
        self.report_paths: dict | None = None
        self.status = "created"
        self._term_handler = None  # the SIGTERM handler the agent installed, while installed
        self._term_signal: int | None = None  # the stop signal being handled
        # Profiler windows asked for over the endpoint: how many, and when the last one was.
        self._on_demand_count, self._on_demand_last = 0, float("-inf")
        self.peak_flops: float | None = None
        self.thread_cpu_s: float | None = None  # CPU time of the background thread, once stopped

        self._queue: collections.deque = collections.deque()
        self._held = HeldSteps()  # step records waiting for their device times
        self._peak = PeakMemory()
        self._logged: set[str] = set()
        self._early_events: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._analysis: WindowAnalysis | None = None  # one analysis process for the whole run
        self._windows_meta: list[dict] = []
        self._steps_done = 0
        self._last_step: int | None = None
        self._loader_used = False
        self._nccl_watch: NcclWatch | None = None  # this rank's NCCL log and `diag nccl` results, live
        self._dist_recorded = False
        self._exception: tuple[str, str] | None = None  # (type, text) of what the training loop raised
        self._watch: tuple | None = None  # (model, optimizer) to describe after the next step
        self._closed = False
        self._bad_counts: set[str] = set()  # step counts (samples, tokens) already said to be implausible
        self._batch_shape: tuple | None = None  # (samples, parts) of the first batch loader() gave
        self._atexit = None

    # -- public API -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.launch.rank if self.launch else 0

    @property
    def run_dir(self) -> Path | None:
        return self.writer.path if self.writer else None

    @property
    def step_number(self) -> int:
        """The number of the step in progress (0-based, the same on every rank)."""
        return self.timer.step if self.timer else 0

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Terminated):
            self.close("terminated", str(exc))
        elif exc_type is None or (issubclass(exc_type, SystemExit) and getattr(exc, "code", 1) in (0, None)):
            self.close("completed")
        elif issubclass(exc_type, KeyboardInterrupt):
            self._exception = (exc_type.__name__, str(exc))
            self.close("interrupted", "KeyboardInterrupt")
        else:
            self._exception = (exc_type.__name__, str(exc))
            self.close("failed", f"{exc_type.__name__}: {exc}")
        return False  # the user's exception propagates unchanged

    def start(self) -> Agent:
        if self.timer is not None:
            return self
        if self._config_problem:
            self._log(self._config_problem)
        try:
            self._start()
        except Exception as exc:  # the agent must never stop the training from starting
            self._log(f"agent: start failed ({type(exc).__name__}: {exc}); only step timing is kept")
        if self.timer is None:
            self.timer = StepTimer()
        self._install_term_handler()
        self.status = "running"
        self._atexit = atexit.register(self._close_at_exit)
        return self

    def loader(self, iterable):
        """Yield from `iterable`, timing each wait for the next batch as data wait."""
        timer = self.timer or self.start().timer
        if not self._loader_used:
            self.record_loader(iterable)
        try:
            time_collate(iterable, lambda s: self.timer.add_collate(s) if self.timer is not None else None)
        except Exception as exc:  # a loader that refuses the attribute is trained untimed
            self._log(f"agent: collate time not measured ({type(exc).__name__}: {exc})")
        it = iter(iterable)
        first = not self._loader_used and timer.step == 0
        self._loader_used = True
        perf, cpu_clock = time.perf_counter, time.process_time
        while True:
            windows = self.windows
            if first:
                timer.restart()  # step 0 starts with its first batch, not at agent start
                first = False
            clock = self.clock
            if clock is not None:
                clock.data_begin()
            t0, c0 = perf(), cpu_clock()
            try:
                if windows is not None and windows.recording:
                    from torch.autograd.profiler import record_function

                    with record_function(_DATA_WAIT_NAME):
                        batch = next(it)
                else:
                    batch = next(it)
            except StopIteration:
                return
            timer.add_data_wait(perf() - t0, cpu_clock() - c0)
            if clock is not None:
                clock.data_end()
            if self._batch_shape is None:
                self._batch_shape = (count_samples(batch), batch_parts(batch))
            yield batch

    def record_loader(self, iterable) -> None:
        """Record a DataLoader's settings in rank.json (the data causes quote them): done by
        `loader()` for the first one it wraps, and by the framework callbacks for their trainers'."""
        try:
            facts = loader_facts(iterable)
            if facts is not None and self.writer is not None:
                facts["local_ranks"] = self.launch.local_world_size if self.launch is not None else None
                self.writer.update_info(loader=facts)
        except Exception as exc:
            self._log(f"agent: DataLoader settings not recorded ({type(exc).__name__}: {exc})")

    def step(self, samples: float | None = None, tokens: float | None = None) -> None:
        """End the current training step (and start the next)."""
        if self._closed:
            return
        timer = self.timer
        if timer is None:
            self.start()
            timer = self.timer
        windows = self.windows
        profiled = windows is not None and windows.recording
        if not (_plausible(samples, "samples") and _plausible(tokens, "tokens")):
            samples, tokens = self._plausible_counts(samples, tokens)
        if samples is not None and self._batch_shape is not None and not self._bad_counts:
            self._check_samples(samples)
        t = timer.finish(samples, tokens)
        clock = self.clock
        if clock is not None:
            clock.step_end(t.step)
        elif t.step % 8 == 0:  # until torch initialises a device; the clock never does
            self.clock = DeviceClock.for_torch(self._log)
            if self.clock is not None:
                self._identify_device()
        if windows is not None:
            worked = windows.end(t.step)
            if windows.begin(timer.step) or worked:
                timer.rebase()
                if self.clock is not None:
                    self.clock.rebase()
        self._queue.append((t, profiled))
        if self._watch is not None:
            self._record_model(t.step)

    def _check_samples(self, samples) -> None:
        """Said once: a step's samples equal to the parts of the batches loader() gives, not to
        their samples (`samples=len(batch)` on an (inputs, labels) batch counts 2)."""
        held, n_parts = self._batch_shape
        if held is not None and n_parts is not None and held != n_parts and samples == n_parts:
            self._bad_counts.add("samples")
            self._log(f"agent.step(samples={samples}): the batches from loader() hold {held} samples each (the "
                      f"first dimension of their first tensor), and {n_parts} parts: len(batch) counts the parts. "
                      "Pass samples=diag.count_samples(batch).")

    def _plausible_counts(self, samples, tokens) -> tuple:
        """The step's counts with those no step can hold (1e30, a tensor, NaN) left out, said once."""
        out = []
        for field, value in (("samples", samples), ("tokens", tokens)):
            if _plausible(value, field):
                out.append(value)
                continue
            out.append(None)
            if field not in self._bad_counts:
                self._bad_counts.add(field)
                self._log(f"agent.step({field}={str(value)[:40]}): not a count of {field} one step can hold "
                          f"(a number from 0 to {rundir.MAX_STEP_COUNTS[field]:.0e}); left out of this and later "
                          "steps' throughput")
        return tuple(out)

    def watch(self, model, optimizer=None) -> Agent:
        """Record what `model` and `optimizer` hold (parameters, gradients, optimizer state, the
        transformer shape of a Hugging Face-style config) once, after the next step."""
        self._watch = (model, optimizer)
        return self

    def _record_model(self, step: int) -> None:
        model, optimizer = self._watch
        self._watch = None  # once: the references are dropped either way
        try:
            from diag.collectors.model_facts import describe

            facts = dict(describe(model, optimizer), step=step)
        except Exception as exc:
            self._log(f"model facts: off ({type(exc).__name__}: {exc})")
            return
        if self.writer is not None:
            self.writer.update_info(model=facts)

    @property
    def windows_analysed(self) -> list[dict]:
        """Windows whose background analysis finished: first_step, last_step, bound."""
        return list(self._windows_meta)

    # -- start-up ---------------------------------------------------------------------------

    def _start(self) -> None:
        info = launch_env.from_torch_distributed(launch_env.detect())
        self.launch = info
        self.writer = RunWriter.open(
            self._run_dir_arg, info, run_id=self._run_id, overwrite=self.config.run.overwrite,
            config=self.config.to_dict(), log=self._log,
        )
        for ev in self._early_events:
            self.writer.write_record("events", ev)
        self._early_events.clear()
        rank_path = self.writer.rank_path
        writable = self.writer.enabled

        if self.config.nccl.log and writable:
            applied = nccl_env.configure(rank_path / rundir.NCCL, coll=self.config.nccl.coll, log=self._log)
            if applied:
                self._event("nccl", f"NCCL logging routed to {applied.get('NCCL_DEBUG_FILE', 'stderr')}")

        tree_settings = self._start_tree(writable)
        device = self._device_index()
        if device is None:
            # The host's calibration (`diag calibrate`), read here once and recorded in rank.json:
            # analyses of this run use the record, never the cache of whichever machine they run on.
            self.host_peaks = calibrate.load()
            if self.host_peaks:
                self.writer.update_info(host_peaks=self.host_peaks)
        if self.config.sampling.enabled:
            self._start_sampler(device)
        if self.config.profiler.enabled and writable:
            self._start_profiler(rank_path, tree_settings)
        self._start_exporter(device)
        self._device_facts()
        self.writer.heartbeat(collectors=self._collectors())
        self.timer = StepTimer()
        self._peak = PeakMemory(device if isinstance(device, int) else None)
        if self.windows is not None:
            self.windows.begin(0)
        self._thread = threading.Thread(target=self._run, name="diag-agent", daemon=True)
        self._thread.start()

    def _start_tree(self, writable: bool) -> dict | None:
        """The decision tree for the live verdicts, its settings recorded for the run (None
        where it cannot be loaded: the steps then get no live verdict)."""
        tree_settings = None
        try:
            from diag.analyzers.diagnosis.decision_tree import load_tree, settings

            self.tree = load_tree(self.config.config_file, self.config.thresholds or None)
            tree_settings = settings(self.tree)
            self.verdicts = LiveVerdicts(self.tree, self._log)
        except Exception as exc:
            self._log(f"agent: decision tree unavailable ({type(exc).__name__}: {exc}); steps get no live verdict")
        if tree_settings is not None and writable:
            # The first rank records them for the run: the window analyses, rank 0's report and
            # every later `diag analyze` of this run directory judge by the same thresholds.
            self.writer.record_tree_settings(tree_settings)
        return tree_settings

    def _start_sampler(self, device) -> None:
        try:
            from diag.collectors.sampler import Sampler

            opts = {"interval_s": self.config.sampling.interval_s, "on_sample": self._on_sample,
                    "log": self._log}
            # The sampler finds DataLoader workers among our children (a few /proc reads);
            # the window analysis process is ours, not a worker.
            self.sampler = Sampler(device, exclude_pids=self._worker_pids, **opts)
            self.sampler.start()
        except Exception as exc:
            self.sampler = None
            self._log(f"sampler: switched off ({type(exc).__name__}: {exc})")

    def _start_profiler(self, rank_path: Path, tree_settings: dict | None) -> None:
        """Scheduled profiler windows behind the guard that lets the job's own profilers first,
        each window's trace analysed in the background."""
        s = self.config.profiler
        self._analysis = WindowAnalysis(rank_path / rundir.WINDOWS, self.rank, tree_settings, self.host_peaks,
                                        on_done=self._window_done, log=self._log)
        guard = ProfilerGuard(self._log)
        try:
            guard.install()  # the job's own profilers come first
            self.windows = ProfilerWindows(
                rank_path / rundir.TRACES,
                WindowSettings(skip_first=s.skip_first, warmup=s.warmup, active=s.active, every=s.every,
                               record_shapes=s.record_shapes, with_flops=s.with_flops,
                               profile_memory=s.profile_memory, stack_windows=s.stack_windows,
                               budget_bytes=s.trace_budget_bytes,
                               export_in_child=s.export_in_child),
                trigger_dir=self.writer.path, on_trace=self._on_trace, log=self._log,
                in_use=self._analysis.in_use, guard=guard,
            )
            self.windows.install_signal()
        except Exception as exc:
            guard.uninstall()
            self.windows = None
            self._log(f"profiler: switched off ({type(exc).__name__}: {exc})")

    def _device_index(self) -> int | None:
        if self._device_arg != "auto":
            return self._device_arg if isinstance(self._device_arg, int) else None
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available():
                if torch.cuda.is_initialized():
                    return torch.cuda.current_device()
                n = torch.cuda.device_count()
                return self.launch.local_rank % n if n else None
        except Exception:
            pass
        return None

    def _start_exporter(self, device) -> None:
        if not self.config.exporter.enabled:
            return
        try:
            from diag.exporter import runtime
        except Exception as exc:
            self._log(f"exporter: unavailable ({type(exc).__name__}: {exc})")
            return
        identity = {
            # The run's id, as rank.json records it: `diag export` of the same run labels it alike.
            "run": (self.writer.run_id if self.writer else None) or "run",
            "rank": str(self.launch.rank),
            "local_rank": self.launch.local_rank,
            "host": self.launch.hostname,
            "gpu": "" if device is None else str(device),
        }
        try:
            self.exporter = runtime.start(
                identity, port_base=self.config.exporter.port, bind=self.config.exporter.bind,
                enabled=True, log=self._log, on_profile=self._profile_request,
            )
        except Exception as exc:
            self.exporter = None
            self._log(f"exporter: switched off ({type(exc).__name__}: {exc})")

    def _identify_device(self) -> None:
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

    def _device_facts(self) -> None:
        """Device facts for rank.json and the peak FLOP/s for MFU."""
        facts = None
        if self.sampler is not None:
            try:
                facts = self.sampler.info(timeout=2.0)
            except Exception:
                facts = None
        self.writer.update_info(device=facts)
        self._device_recorded = (facts or {}).get("uuid")
        if not (self.config.report.flops_per_sample or self.config.report.flops_per_token):
            return
        try:
            from diag.analyzers.trace import devices

            dev = None
            if facts and facts.get("name"):
                dev = devices.lookup({"name": facts["name"], "totalGlobalMem": facts.get("memory_total_bytes")})
            if dev is None and not (facts and facts.get("vendor")) and self.host_peaks:
                dev = devices.host_device(self.host_peaks)
            dtype = self.config.report.mfu_dtype or ("fp32" if dev is not None and dev.key == "cpu" else "bf16")
            self.peak_flops = dev.peak_flops(dtype) if dev is not None else None
            if self.peak_flops is None:
                self._log("mfu: device peak unknown (run `diag calibrate` on CPU hosts); MFU not reported")
        except Exception as exc:
            self._log(f"mfu: off ({type(exc).__name__}: {exc})")

    def _collectors(self) -> dict:
        return {
            "writer": bool(self.writer and self.writer.enabled),
            "profiler": bool(self.windows and self.windows.enabled),
            "sampler": self.sampler is not None,
            "exporter": self.exporter is not None,
            "exporter_port": getattr(self.exporter, "port", None),
            "verdicts": self.verdicts.on,
        }

    # -- logging ----------------------------------------------------------------------------

    def _event(self, source: str, message: str, level: str = "info", **fields) -> None:
        ev = {"t": time.time(), "level": level, "source": source, "message": message, **fields}
        if self.writer is None:
            self._early_events.append(ev)
        else:
            self.writer.write_record("events", ev)
        if self.exporter is not None:
            try:
                self.exporter.observe_event(ev)
            except Exception:
                pass

    def _log(self, message: str) -> None:
        """A collector switched off, a fault: logged once to stderr and to the events stream."""
        source = message.split(":", 1)[0] if ":" in message[:24] else "agent"
        self._event(source, message, level="warning")
        key = re.sub(r"\d+", "#", message)[:80]  # "window 12 failed" and "window 40 failed" are one fault
        if key in self._logged:
            return
        self._logged.add(key)
        if self._verbose:
            rank = self.launch.rank if self.launch else "?"
            print(f"diag[rank {rank}]: {message}", file=sys.stderr, flush=True)

    # -- callbacks from other threads ---------------------------------------------------------

    def _on_sample(self, sample: dict) -> None:
        self.verdicts.latest_sample = sample
        self.live.add_sample(sample)
        if self.writer is not None:
            self.writer.write_record("samples", sample)
        if self.exporter is not None:
            self.exporter.observe_sample(sample)

    def _on_trace(self, first: int, last: int, path: Path) -> None:
        if self._analysis is not None:
            self._analysis.queue(first, last, path)
        self._event("profiler", f"window {first}-{last} saved to {path.name}")

    def _worker_pids(self) -> list[int]:
        return self._analysis.pids() if self._analysis is not None else []

    # -- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._loop()
        finally:
            self.thread_cpu_s = time.thread_time() - cpu0

    def _loop(self) -> None:
        last_beat = last_poll = last_flush = last_live = time.monotonic()
        while not self._stop.wait(0.2):
            try:
                self._drain()
                now = time.monotonic()
                if now - last_poll >= 1.0:
                    last_poll = now
                    if self.windows is not None:
                        first = self.windows.poll_trigger()
                        if first is not None:
                            self._event("profiler", f"on-demand window requested at step {first}")
                    self._poll_workers()
                    self._poll_nccl()
                    if self.exporter is not None and self.windows is not None:
                        self.exporter.observe_profiler(self.windows.window_steps)
                if now - last_flush >= self.flush_s:
                    last_flush = now
                    self.writer.sync()
                if self.live_s and now - last_live >= self.live_s:
                    last_live = now
                    self._write_live()
                if now - last_beat >= self.heartbeat_s:
                    last_beat = now
                    self._record_dist()
                    self.writer.heartbeat(steps=self._steps_done, last_step=self._last_step,
                                          collectors=self._collectors())
            except Exception as exc:  # keep the thread alive; report once
                self._log(f"agent: background error ({type(exc).__name__}: {exc})")

    def _write_live(self, status: str = "running") -> None:
        """live.json: what `diag top` shows of this rank, within a second or two of the step."""
        if self.writer is None or self.launch is None:
            return
        identity = {"rank": self.launch.rank, "local_rank": self.launch.local_rank, "host": self.launch.hostname,
                    "world_size": self.launch.world_size, "pid": os.getpid(),
                    "exporter_port": getattr(self.exporter, "port", None)}
        window = self.windows.window_steps if self.windows is not None else None
        self.writer.write_live(self.live.document(identity, self._steps_done, window, status))

    def _profile_request(self, first_step: int | None) -> int | None:
        """A profiler window asked for over the metrics endpoint (`diag top`'s `p`): the first step
        is the one the caller chose for every rank, so the ranks profile the same steps. None:
        profiling is off; ProfileRefused says why a request is turned down."""
        from diag.exporter.server import ProfileRefused

        cfg = self.config.profiler
        if not cfg.on_demand:
            raise ProfileRefused("windows asked for over the endpoint are off on this rank "
                                 "(profile_on_demand=True or DIAG_PROFILER_ON_DEMAND=1 turns them on)")
        if self.windows is None or not self.windows.enabled:
            return None
        if self.status != "running":
            raise ProfileRefused(f"training has ended on this rank ({self.status})")
        # One on-demand window at a time: a caller repeating the request (or flooding the port)
        # gets the window already asked for, never a run of windows.
        pending = self.windows.requested_step
        if pending is not None:
            return pending
        active = self.windows.window_steps
        if active is not None:
            return active[0]
        now, current = time.monotonic(), self.windows.current_step
        if first_step is not None and not current <= first_step <= current + cfg.on_demand_max_ahead:
            raise ProfileRefused(f"step {first_step} is outside steps {current}-{current + cfg.on_demand_max_ahead}")
        if self._on_demand_count >= cfg.on_demand_max:
            raise ProfileRefused(f"this run took its {cfg.on_demand_max} windows asked for over the endpoint")
        if now - self._on_demand_last < cfg.on_demand_interval_s:
            raise ProfileRefused(f"one window asked for over the endpoint in {cfg.on_demand_interval_s:g} s: "
                                 f"next in {cfg.on_demand_interval_s - (now - self._on_demand_last):.0f} s")
        self._on_demand_count += 1
        self._on_demand_last = now
        first = self.windows.request(first_step)
        self._event("profiler", f"on-demand window requested at step {first} over the metrics endpoint")
        return first

    def _record_dist(self) -> None:
        """The process group's backend and size in rank.json, once it is initialised."""
        if self._dist_recorded or self.writer is None:
            return
        torch = sys.modules.get("torch")
        try:
            dist = torch.distributed if torch is not None else None
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return
            backend, world = str(dist.get_backend()), int(dist.get_world_size())
        except Exception:
            return
        self._dist_recorded = True
        self.writer.update_info(backend=backend, world_size=world)

    def _poll_nccl(self) -> None:
        """Hand `diag nccl` results and this rank's parsed NCCL log to the exporter when they change."""
        if self.exporter is None or self.writer is None:
            return
        if self._nccl_watch is None:
            self._nccl_watch = NcclWatch(self.writer.path, self.writer.rank_path, self.exporter, self._log)
        self._nccl_watch.poll()

    def _drain(self, final: bool = False) -> None:
        q, held = self._queue, self._held
        if final and self.clock is not None:
            self.clock.settle(2.0)
        now = time.monotonic()
        while q:
            t, profiled = q.popleft()
            held.add(t.step, (t, profiled), now)
        for (t, profiled), device in held.ready(self.clock, now, final):
            rec = self._record(t, profiled, device)
            verdict = self.verdicts.judge(rec)
            self._steps_done += 1
            self._last_step = t.step
            self.writer.write_record("steps", rec)
            self.live.add_step({**rec, **verdict})
            if self.exporter is not None:
                self.exporter.observe_step(rec, verdict.get("bound"))

    def _record(self, t, profiled: bool, device=None) -> dict:
        rec = {
            "step": t.step,
            "start_unix": t.start_unix,
            "duration_s": t.duration_s,
            "data_wait_s": t.data_wait_s,
            # Of the data wait, collating batches in this process (a DataLoader with num_workers=0).
            "collate_s": t.collate_s,
            # The process's CPU time over the step and during its data wait: a wait that is CPU
            # work bounds what DataLoader workers can win by the CPUs, a wait on storage does not.
            "cpu_s": t.cpu_s,
            "data_wait_cpu_s": t.data_wait_cpu_s,
            "samples": t.samples,
            "tokens": t.tokens,
            "peak_mem_bytes": self._peak.read(time.monotonic()),
            "profiled": profiled,
            # From the device's timing events (collectors/device_clock.py); None without them.
            "device_s": device.device_s if device is not None else None,
            "data_idle_s": device.data_idle_s if device is not None else None,
            "evidence": "sampled",
            "shares": None,
        }
        if self.peak_flops and t.duration_s > 0:
            flops = None
            if self.config.report.flops_per_token and t.tokens:
                flops = self.config.report.flops_per_token * t.tokens
            elif self.config.report.flops_per_sample and t.samples:
                flops = self.config.report.flops_per_sample * t.samples
            if flops:
                rec["mfu"] = flops / t.duration_s / self.peak_flops
        return rec

    # -- window analysis in a background process (diag.window_analysis) ------------------------

    def _poll_workers(self) -> None:
        """Collect finished window analyses and hand the next trace to the analysis process."""
        a = self._analysis
        if a is None:
            return
        a.poll(submit=self.analyse_during_run or self._closed)
        if self.windows is not None and a.idle:
            self.windows.enforce_budget()

    def _wait_workers(self, timeout_s: float) -> None:
        """Give the analysis of the last windows up to timeout_s, then end the analysis process;
        none where the run directory can no longer be written (a full disk): no summary could
        land, so waiting for one would only hold the process's exit."""
        if self._analysis is not None:
            writable = self.writer is None or getattr(self.writer, "enabled", True)
            self._analysis.finish(timeout_s if writable else 0.0)

    def _window_done(self, first: int, last: int, facts: dict) -> None:
        """A window's summary (facts) has landed: the live verdict judges it for the live views."""
        judged = self.verdicts.window_done(facts)
        bound = (judged or {}).get("bound")
        self._windows_meta.append({"first_step": first, "last_step": last, "bound": bound})
        self._event("profiler", f"window {first}-{last} analysed" + (f": {bound}-bound" if bound else ""))
        if self.exporter is not None:
            self.exporter.observe_window(judged or facts)

    # -- shutdown ---------------------------------------------------------------------------------

    def _install_term_handler(self) -> None:
        """Record a stop from outside (SIGTERM: a scheduler's time limit, torchrun, Kubernetes):
        where the job has no handler of its own, SIGTERM unwinds the training loop as Ctrl-C does
        (Terminated), the agent closes the rank as terminated, and the process then ends by the
        signal itself, as it would have without the agent. A job's own handler is left alone."""
        if threading.current_thread() is not threading.main_thread() or self._term_handler is not None:
            return
        try:
            if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                self._log("agent: SIGTERM has the job's own handler; a stop from outside is recorded when it "
                          "closes the agent")
                return
            signal.signal(signal.SIGTERM, self._on_term)
            self._term_handler = self._on_term
        except (ValueError, OSError):
            pass

    def _on_term(self, signum, frame) -> None:
        if self._term_signal is not None:
            return  # already unwinding
        self._term_signal = signum
        raise Terminated(signum)

    def _end_by_signal(self) -> None:
        """After a SIGTERM the agent turned into Terminated: end the process by that signal."""
        signum, self._term_signal = self._term_signal, None
        if signum is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            sys.stderr.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        except (ValueError, OSError):
            pass

    def _close_at_exit(self) -> None:
        if not self._closed:
            if self._term_signal is not None:
                self.close("terminated", str(Terminated(self._term_signal)))
            else:
                self.close("interrupted", "the process exited without closing the agent")

    def close(self, status: str = "completed", error: str | None = None) -> None:
        """Stop collecting, close this rank's part of the run; on rank 0 write the job report."""
        if self._closed:
            return
        self._closed = True
        self.status = status
        if self._atexit is not None:
            try:
                atexit.unregister(self._close_at_exit)
            except Exception:
                pass
        interrupted = status in ("interrupted", "terminated")  # shut down quickly: a kill may follow
        if self._exception is None and error and status in ("failed", "interrupted"):
            # close(status, "TypeName: text") from a framework callback (Lightning's on_exception)
            m = _EXCEPTION_TEXT.match(error)
            if m:
                self._exception = (m.group(1), m.group(2) or "")
        if self._exception is not None:
            # Recorded before anything closes: the events stream keeps it, and the exporter
            # counts an out-of-memory error (torch.OutOfMemoryError, "CUDA out of memory").
            name, text = self._exception
            self._event("agent", f"training loop raised {name}: {text}" if text else f"training loop raised {name}",
                        level="error" if status == "failed" else "warning", exception=name, error=text)
        self._record_dist()
        try:
            self._shutdown_collectors(quick=interrupted)
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            self._log(f"agent: shutdown error ({type(exc).__name__}: {exc})")
        if self.writer is not None:
            try:
                self.writer.heartbeat(steps=self._steps_done, last_step=self._last_step, collectors=self._collectors())
                if self.live_s:
                    self._write_live(status)
                self.writer.close(status, error)
            except Exception as exc:
                self._log(f"agent: closing the run directory failed ({type(exc).__name__}: {exc})")
            if self.rank == 0:
                try:
                    self._finish_job(status, quick=interrupted)
                except KeyboardInterrupt:
                    print("diag: report skipped (interrupted); run `diag report` on the run directory",
                          file=sys.stderr)
                except Exception as exc:
                    self._log(f"report: failed ({type(exc).__name__}: {exc}); run `diag report {self.run_dir}`")
        if self._on_closed is not None:
            try:
                self._on_closed(self)
            except Exception as exc:
                self._log(f"agent: on_closed failed ({type(exc).__name__}: {exc})")
        if self.exporter is not None:
            if self.export_linger_s > 0 and status == "completed":
                self._linger(self.export_linger_s)
            try:
                self.exporter.close()
            except Exception:
                pass
        if self._term_handler is not None:
            try:
                if signal.getsignal(signal.SIGTERM) is self._term_handler:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
            except (ValueError, OSError):
                pass
            self._term_handler = None
        if status == "terminated":
            self._end_by_signal()

    def summary(self, wait_s: float = 0.0) -> dict | None:
        """The job's diagnosis as a plain dict: the summary.json rank 0 writes at close (the
        diagnosis, step statistics, throughput), with the report's paths under "report". None
        while no report exists: before close, with the report off, or on another rank before rank
        0 wrote it (`wait_s` waits that long for it)."""
        path = self.run_dir / "summary.json" if self.run_dir is not None else None
        deadline = time.monotonic() + max(wait_s, 0.0)
        while path is not None:
            doc = rundir.read_json(path) if path.exists() else None
            if isinstance(doc, dict):
                paths = self.report_paths or {k: path.with_name(f"report.{k}") for k in ("html", "md")}
                return {**doc, "report": {k: str(v) for k, v in paths.items() if Path(v).exists()}}
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        return None

    def stop_linger(self) -> None:
        """End the endpoint's linger after close (safe from a signal handler or another thread)."""
        self._linger_stop.set()

    def _linger(self, seconds: float) -> None:
        port = getattr(self.exporter, "port", None)
        self._event("exporter", f"serving the final metrics on port {port} for {seconds:.0f} s")
        deadline = time.monotonic() + seconds
        try:
            # Short sleeps, so a signal handler calling stop_linger() ends it at once.
            while not self._linger_stop.is_set() and time.monotonic() < deadline:
                time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
        except KeyboardInterrupt:
            pass

    def _shutdown_collectors(self, quick: bool) -> None:
        if self.windows is not None:
            self.windows.close()
            self.windows.guard.uninstall()
            self.windows.wait_exported(10.0 if quick else 60.0)
        if self.sampler is not None:
            try:
                self.sampler.stop()
                facts = self.sampler.info(timeout=0)
                if self.writer is not None and facts.get("uuid") != self._device_recorded:
                    self.writer.update_info(device=facts)  # the sampler moved to torch's device
            except Exception as exc:
                self._log(f"sampler: stop failed ({exc})")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.writer is not None:
            self._drain(final=True)
            self._wait_workers(5.0 if quick else self.analysis_wait_s)
            if self.windows is not None:
                self.windows.enforce_budget()

    def _finish_job(self, status: str, quick: bool) -> None:
        w = self.writer
        world = self.launch.world_size if self.launch else 1
        peers = w.read_peers()
        if world > 1:
            wait = min(self.report_wait_s, 10.0) if quick else self.report_wait_s
            peers = w.wait_for_peers(wait, stale_s=max(3 * self.heartbeat_s, 3.0))
        finals = [i.get("status") if i else None for i in peers.values()]
        if status != "completed":
            job_status = status
        elif any(s not in rundir.FINAL_STATUSES for s in finals):
            job_status = "incomplete"
        elif "failed" in finals:
            job_status = "failed"
        elif "terminated" in finals:
            job_status = "terminated"
        elif "interrupted" in finals:
            job_status = "interrupted"
        else:
            job_status = "completed"
        w.write_manifest(job_status, peers)
        if not self.config.report.enabled or not w.enabled:
            return
        from diag.report import read_diagnosis, write_report

        self.report_paths = write_report(w.path, w.path)
        if self.exporter is not None and self.report_paths:
            # The job verdict as the report's diagnosis gives it, for the lingering endpoint.
            diagnosis = read_diagnosis(self.report_paths["summary"])
            if diagnosis:
                self.exporter.observe_diagnosis(diagnosis)
        html = (self.report_paths or {}).get("html")
        if html and self._verbose:
            print(f"diag: report written to {html}", file=sys.stderr, flush=True)
