"""`diag.Agent`: wrap a training loop on every rank; rank 0 writes the job's report at exit.

    with diag.Agent(run_dir="runs/exp1") as agent:
        for batch in agent.loader(train_loader):   # times the wait for each batch
            loss = train_step(batch)
            agent.step(samples=diag.count_samples(batch))  # marks the end of a training step

The step path does only host-side bookkeeping: a monotonic clock read, an append to a
queue and, inside profiler windows, the profiler's step markers. Everything else (the
per-step verdict, writing records, the exporter, trace analysis) happens on one
background thread or in a background process. Each part that fails is switched off
and logged once (to stderr and to the rank's events stream); the training goes on.
Exceptions from the user's loop propagate unchanged.
"""

from __future__ import annotations

import atexit
import copy
import os
import re
import sys
import threading
import time
from pathlib import Path

from diag import rundir
from diag.background import Background
from diag.collectors import launch_env, nccl_env
from diag.collectors.device_clock import DeviceClock
from diag.collectors.loader_facts import loader_facts, time_collate
from diag.collectors.profiler_windows import ProfilerWindows
from diag.collectors.run_writer import RunWriter
from diag.collectors.step_timer import PeakMemory, StepTimer
from diag.config import FLAT, AgentConfig
from diag.errors import DiagInputError
from diag.job_finish import finish_job, linger, read_summary
from diag.job_inputs import StepCounts, record_model
from diag.live_feed import LiveFeed
from diag.on_demand import OnDemandWindows
from diag.supervisor import Collectors
from diag.termination import StopSignal, Terminated, loop_exception

_DATA_WAIT_NAME = "enumerate(DataLoader)#diag.Agent.loader"


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
        self._verbose = r.verbose
        self.analyse_during_run = cfg.profiler.analyse_during_run
        self.heartbeat_s = r.heartbeat_s
        self.flush_s = r.flush_s
        self.live_s = max(float(r.live_s or 0.0), 0.0)
        self.export_linger_s = max(float(cfg.exporter.linger_s or 0.0), 0.0)
        self._on_closed = on_closed
        self._linger_stop = threading.Event()

        self.launch: launch_env.LaunchInfo | None = None
        self.writer: RunWriter | None = None
        self.collectors = Collectors(cfg, self._log, self._event)
        self.on_demand = OnDemandWindows(cfg.profiler, self._event)
        self.feed = LiveFeed(self.collectors, self._log, self._event)
        self.timer: StepTimer | None = None
        # Device step time and idle time within data waits, once torch has a CUDA/HIP device.
        self.clock: DeviceClock | None = None
        self.peak_memory = PeakMemory()
        self.report_paths: dict | None = None
        self.status = "created"
        self.closed = False
        self._stop_signal = StopSignal(self._log)
        self._background = Background(self)
        self._counts = StepCounts()
        self._logged: set[str] = set()
        self._early_events: list[dict] = []
        self._loader_used = False
        self._exception: tuple[str, str] | None = None  # (type, text) of what the training loop raised
        self._watch: tuple | None = None  # (model, optimizer) to describe after the next step

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

    @property
    def windows(self) -> ProfilerWindows | None:
        """The scheduled profiler windows; None while off."""
        return self.collectors.windows

    @property
    def exporter(self):
        """The Prometheus endpoint; None while off."""
        return self.collectors.exporter

    @property
    def tree(self):
        """The decision tree the live verdicts judge by; None where it could not be loaded."""
        return self.feed.tree

    @property
    def thread_cpu_s(self) -> float | None:
        """CPU time of the agent's background thread, once it stopped."""
        return self._background.cpu_s

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
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
        # None: the user's exception propagates unchanged

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
        self._stop_signal.install()
        self.status = "running"
        atexit.register(self._close_at_exit)
        return self

    def loader(self, iterable):
        """Yield from `iterable`, timing each wait for the next batch as data wait."""
        timer = _started_timer(self)
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
            windows = self.collectors.windows
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
            self._counts.note_batch(batch)
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
        if self.closed:
            return
        timer = _started_timer(self)
        windows = self.collectors.windows
        profiled = windows is not None and windows.recording
        samples, tokens = self._counts.checked(samples, tokens, self._log)
        t = timer.finish(samples, tokens)
        clock = self.clock
        if clock is not None:
            clock.step_end(t.step)
        elif t.step % 8 == 0:  # until torch initialises a device; the clock never does
            self.clock = DeviceClock.for_torch(self._log)
            if self.clock is not None:
                self.collectors.identify_device()
        if windows is not None:
            worked = windows.end(t.step)
            if windows.begin(timer.step) or worked:
                timer.rebase()
                if self.clock is not None:
                    self.clock.rebase()
        self._background.queue.append((t, profiled))
        if self._watch is not None:
            (model, optimizer), self._watch = self._watch, None  # once: the references are dropped either way
            record_model(self.writer, model, optimizer, t.step, self._log)

    def watch(self, model, optimizer=None) -> Agent:
        """Record what `model` and `optimizer` hold (parameters, gradients, optimizer state, the
        transformer shape of a Hugging Face-style config) once, after the next step."""
        self._watch = (model, optimizer)
        return self

    @property
    def windows_analysed(self) -> list[dict]:
        """Windows whose background analysis finished: first_step, last_step, bound."""
        return list(self.feed.windows_analysed)

    def summary(self, wait_s: float = 0.0) -> dict | None:
        """The job's diagnosis as a plain dict: the summary.json rank 0 writes at close (the
        diagnosis, step statistics, throughput), with the report's paths under "report". None
        while no report exists: before close, with the report off, or on another rank before rank
        0 wrote it (`wait_s` waits that long for it)."""
        return read_summary(self.run_dir, self.report_paths, wait_s)

    def stop_linger(self) -> None:
        """End the endpoint's linger after close (safe from a signal handler or another thread)."""
        self._linger_stop.set()

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
        if self.config.nccl.log and self.writer.enabled:
            applied = nccl_env.configure(self.writer.rank_path / rundir.NCCL, coll=self.config.nccl.coll,
                                         log=self._log)
            if applied:
                self._event("nccl", f"NCCL logging routed to {applied.get('NCCL_DEBUG_FILE', 'stderr')}")
        self.feed.writer = self.writer
        tree_settings = self.feed.load_tree(self.config)
        device = self.collectors.start(
            info, self.writer, tree_settings, on_sample=self.feed.sample, on_window=self.feed.window_done,
            on_profile=lambda first: self.on_demand.request(self.collectors.windows, self.status, first))
        self.writer.heartbeat(collectors=self.collectors.status(self.writer, self.feed.verdicts.on))
        self.timer = StepTimer()
        self.peak_memory = PeakMemory(device if isinstance(device, int) else None)
        if self.collectors.windows is not None:
            self.collectors.windows.begin(0)
        self._background.start()

    # -- logging -------------------------------------------------------------------------------

    def _event(self, source: str, message: str, level: str = "info", **fields) -> None:
        ev = {"t": time.time(), "level": level, "source": source, "message": message, **fields}
        if self.writer is None:
            self._early_events.append(ev)
        else:
            self.writer.write_record("events", ev)
        exporter = self.collectors.exporter
        if exporter is not None:
            try:
                exporter.observe_event(ev)
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

    # -- shutdown ---------------------------------------------------------------------------------

    def _close_at_exit(self) -> None:
        if not self.closed:
            if self._stop_signal.received is not None:
                self.close("terminated", str(Terminated(self._stop_signal.received)))
            else:
                self.close("interrupted", "the process exited without closing the agent")

    def close(self, status: str = "completed", error: str | None = None) -> None:
        """Stop collecting, close this rank's part of the run; on rank 0 write the job report."""
        if self.closed:
            return
        self.closed = True
        self.status = status
        try:
            atexit.unregister(self._close_at_exit)
        except Exception:
            pass
        quick = status in ("interrupted", "terminated")  # shut down quickly: a kill may follow
        self._exception = loop_exception(self._exception, status, error)
        if self._exception is not None:
            # Recorded before anything closes: the events stream keeps it, and the exporter
            # counts an out-of-memory error (torch.OutOfMemoryError, "CUDA out of memory").
            name, text = self._exception
            self._event("agent", f"training loop raised {name}: {text}" if text else f"training loop raised {name}",
                        level="error" if status == "failed" else "warning", exception=name, error=text)
        self._background.record_dist()
        try:
            self._shutdown_collectors(quick)
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            self._log(f"agent: shutdown error ({type(exc).__name__}: {exc})")
        if self.writer is not None:
            self._close_run(self.writer, status, error, quick)
        if self._on_closed is not None:
            try:
                self._on_closed(self)
            except Exception as exc:
                self._log(f"agent: on_closed failed ({type(exc).__name__}: {exc})")
        if self.collectors.exporter is not None and self.export_linger_s > 0 and status == "completed":
            linger(self.collectors.exporter, self.export_linger_s, self._linger_stop, self._event)
        self.collectors.close_exporter()
        self._stop_signal.uninstall()
        if status == "terminated":
            self._stop_signal.end_process()

    def _shutdown_collectors(self, quick: bool) -> None:
        self.collectors.stop_sampling(self.writer, quick)
        self._background.stop(5.0)
        if self.writer is not None:
            self._background.drain(final=True)
            self.collectors.finish_analysis(self.writer, 5.0 if quick else self.config.profiler.analysis_wait_s,
                                            beat=lambda: _closing_heartbeat(self))

    def _close_run(self, writer: RunWriter, status: str, error: str | None, quick: bool) -> None:
        """This rank's last heartbeat, live.json and final status; on rank 0, the job's report."""
        try:
            self._background.heartbeat()
            if self.live_s:
                self.feed.write(self.launch, self._background.steps_done, status)
            writer.close(status, error)
        except Exception as exc:
            self._log(f"agent: closing the run directory failed ({type(exc).__name__}: {exc})")
        if self.rank != 0:
            return
        try:
            self.report_paths = finish_job(
                writer, self.launch.world_size if self.launch else 1, status, quick=quick,
                config=self.config, heartbeat_s=self.heartbeat_s, exporter=self.collectors.exporter,
                verbose=self._verbose)
        except KeyboardInterrupt:
            print("diag: report skipped (interrupted); run `diag report` on the run directory", file=sys.stderr)
        except Exception as exc:
            self._log(f"report: failed ({type(exc).__name__}: {exc}); run `diag report {self.run_dir}`")


def _closing_heartbeat(agent: Agent) -> None:
    """rank.json's heartbeat while the rank closes (its background thread has stopped)."""
    try:
        agent._background.heartbeat()
    except Exception as exc:
        agent._log(f"agent: heartbeat failed ({type(exc).__name__}: {exc})")


def _started_timer(agent: Agent) -> StepTimer:
    """The agent's step timer, starting the agent on its first use (start() always makes one)."""
    if agent.timer is None:
        agent.start()
    assert agent.timer is not None
    return agent.timer
