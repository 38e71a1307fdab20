"""The agent's background thread: it turns the steps the training thread queued into records
(with their device times, once known, and their live verdicts), and on their intervals polls
the collectors, flushes the run directory, writes live.json and beats the heartbeat.

The step path only appends to the queue; everything that takes time happens here.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from diag.collectors.device_clock import HeldSteps
from diag.step_record import StepRecord, from_json_record


class Background:
    """Works for one agent, reading its parts (writer, clock, live verdicts, collectors) as they
    are when it runs."""

    def __init__(self, agent):
        self.agent = agent
        self.queue: collections.deque = collections.deque()  # (StepTime, profiled) from the step path
        self.held = HeldSteps()  # step records waiting for their device times
        self.steps_done = 0
        self.last_step: int | None = None
        self.cpu_s: float | None = None  # CPU time of the thread, once stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dist_recorded = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="diag-agent", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._loop()
        finally:
            self.cpu_s = time.thread_time() - cpu0

    def _loop(self) -> None:
        a = self.agent
        last_beat = last_poll = last_flush = last_live = time.monotonic()
        while not self._stop.wait(0.2):
            try:
                self.drain()
                now = time.monotonic()
                if now - last_poll >= 1.0:
                    last_poll = now
                    a.collectors.poll(a.writer, submit=a.analyse_during_run or a.closed)
                if now - last_flush >= a.flush_s:
                    last_flush = now
                    a.writer.sync()
                if a.live_s and now - last_live >= a.live_s:
                    last_live = now
                    a.feed.write(a.launch, self.steps_done)
                if now - last_beat >= a.heartbeat_s:
                    last_beat = now
                    self.heartbeat()
            except Exception as exc:  # keep the thread alive; report once
                a._log(f"agent: background error ({type(exc).__name__}: {exc})")

    def drain(self, final: bool = False) -> None:
        """Record every queued step whose device time is known (every one, when final)."""
        a = self.agent
        q, held, clock = self.queue, self.held, a.clock
        if final and clock is not None:
            clock.settle(2.0)
        now = time.monotonic()
        while q:
            t, profiled = q.popleft()
            held.add(t.step, (t, profiled), now)
        for (t, profiled), device in held.ready(clock, now, final):
            rec = step_record(t, profiled, device, a.peak_memory.read(time.monotonic()),
                              mfu_of(t, a.config.report, a.collectors.peak_flops))
            self.steps_done += 1
            self.last_step = t.step
            if rec is not None:
                a.feed.step(rec)

    def heartbeat(self) -> None:
        a = self.agent
        self.record_dist()
        a.writer.heartbeat(steps=self.steps_done, last_step=self.last_step,
                           collectors=a.collectors.status(a.writer, a.feed.verdicts.on))

    def record_dist(self) -> None:
        """The process group's backend and size in rank.json, once it is initialised."""
        writer = self.agent.writer
        if self._dist_recorded or writer is None:
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
        writer.update_info(backend=backend, world_size=world)


def mfu_of(t, report, peak_flops: float | None) -> float | None:
    """A step's model FLOP utilisation from the FLOPs per token or sample the user gave."""
    if not peak_flops or t.duration_s <= 0:
        return None
    flops = None
    if report.flops_per_token and t.tokens:
        flops = report.flops_per_token * t.tokens
    elif report.flops_per_sample and t.samples:
        flops = report.flops_per_sample * t.samples
    return flops / t.duration_s / peak_flops if flops else None


def step_record(t, profiled: bool, device, peak_mem_bytes, mfu: float | None) -> StepRecord | None:
    """One step's record in the run directory: what was measured, no verdict (None where the
    job's own counts are of no type a record holds; step_record.from_json_record says why)."""
    return from_json_record({
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
        # A tensor or NumPy count is read here, off the training thread (job_inputs.plausible).
        "samples": _plain(t.samples),
        "tokens": _plain(t.tokens),
        "peak_mem_bytes": _plain(peak_mem_bytes),
        "profiled": profiled,
        # From the device's timing events (collectors/device_clock.py); None without them.
        "device_s": device.device_s if device is not None else None,
        "data_idle_s": device.data_idle_s if device is not None else None,
        "mfu": mfu,
    })


def _plain(value):
    """A count as a plain number: a tensor's or NumPy scalar's value (None if it has none)."""
    if value is None or type(value) in (int, float):
        return value
    try:
        return value.item()
    except Exception:
        return None
