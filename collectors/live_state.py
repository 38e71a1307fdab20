"""A rank's latest figures for `diag top`, kept in memory and written as one small file.

The step and sample streams reach the run directory in segments, every `flush_s` or so
many records: too late for a live view. This keeps the last few step records and the last
sample, and the agent's background thread writes them every `live_s` as
`rank-NNNNN/live.json` (`diag.live/1`), atomically, so a reader on the shared file system
sees a whole document or the previous one. Bounded: LIVE_STEPS records, one sample.
"""

from __future__ import annotations

import time
from collections import deque

from diag.step_record import StepRecord

LIVE_SCHEMA = "diag.live/1"
LIVE_STEPS = 32  # enough for a median and its noise band, small enough to write every second

# What `diag top` reads of a step record (with its live verdict) and of a sample; the rest
# stays in the streams.
STEP_KEYS = ("step", "start_unix", "duration_s", "device_s", "data_wait_s", "samples", "tokens", "mfu",
             "shares", "evidence")
GPU_KEYS = ("utilization_ratio", "memory_used_bytes", "memory_total_bytes", "power_watts", "temperature_celsius",
            "sm_clock_hz", "clock_events", "xid_errors_total")
HOST_KEYS = ("cpu_ratio", "process_cpu_ratio", "memory_used_bytes", "memory_total_bytes")


class LiveState:
    """The last steps and the last sample of one rank. The training thread never touches it:
    records arrive on the agent's background thread, samples on the sampler's."""

    def __init__(self, keep_steps: int = LIVE_STEPS):
        self._steps: deque[dict] = deque(maxlen=keep_steps)
        self._sample: dict | None = None

    def add_step(self, record: StepRecord, bound: str | None) -> None:
        """A step's record and its live verdict, as live.json holds them (step_record.LiveStep)."""
        self._steps.append({**{k: getattr(record, k) for k in STEP_KEYS}, "bound": bound})

    def add_sample(self, sample: dict) -> None:
        gpu, host = sample.get("gpu"), sample.get("host")
        self._sample = {
            "t": sample.get("t"),
            "gpu": {k: gpu.get(k) for k in GPU_KEYS} if isinstance(gpu, dict) else None,
            "host": {k: host.get(k) for k in HOST_KEYS} if isinstance(host, dict) else None,
        }

    def document(self, identity: dict, steps_done: int, window: tuple[int, int] | None,
                 status: str = "running") -> dict:
        """The `diag.live/1` document: who, how far, the last steps and sample, the window."""
        return {
            "schema": LIVE_SCHEMA,
            "updated_unix": time.time(),
            "status": status,
            **identity,
            "steps_done": steps_done,
            "window": {"first_step": window[0], "last_step": window[1]} if window else None,
            "steps": list(self._steps),
            "sample": self._sample,
        }
