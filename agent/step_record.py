"""One training step's record, the document of the run directory's `steps` stream.

The agent makes one per step (what was measured, no verdict) and the run directory's writer
stores it as a JSON line; every reader gets it back through `from_json_record`, which is
where a record's types are settled once: a value of the wrong type, not finite or out of
its range is damage and reads as not measured (None), so no reader checks a field again.
Keys a record does not know (the verdicts of a diag.run/2 record) are ignored.
"""

from __future__ import annotations

import math
import numbers
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from diag.typed_json import REFUSED, holds, note, settled

# No training counts this many steps; a larger step number is damage (it would not fit the
# analysis's 64-bit columns either).
MAX_STEP = 1 << 48
# No step holds more: a batch of a billion samples, a trillion tokens. A count past these (or
# negative, or not a finite number) is a mistake in what the job passed to agent.step().
MAX_STEP_COUNTS = {"samples": 1e9, "tokens": 1e12}
# No step lasts, and no process runs, a year: a time past it is damage.
MAX_SECONDS = 3.2e7
# The types a record's values must have, with their ranges: anything else (NaN, a string, a
# negative time) is damage. A JSON integer reads as a float where a float is asked for.
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Unix = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
Finite = Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]
Samples = Annotated[int, msgspec.Meta(ge=0, le=int(MAX_STEP_COUNTS["samples"]))] | \
    Annotated[float, msgspec.Meta(ge=0.0, le=MAX_STEP_COUNTS["samples"])]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=int(MAX_STEP_COUNTS["tokens"]))] | \
    Annotated[float, msgspec.Meta(ge=0.0, le=MAX_STEP_COUNTS["tokens"])]
Bytes = Annotated[int, msgspec.Meta(ge=0)] | Annotated[float, msgspec.Meta(ge=0.0, le=1e300)]


class StepRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One step's measurements (STEP_FIELDS says what each holds); None where not measured."""

    step: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
    start_unix: Unix | None = None
    duration_s: Seconds | None = None
    data_wait_s: Seconds | None = None
    collate_s: Seconds | None = None
    cpu_s: Seconds | None = None
    data_wait_cpu_s: Seconds | None = None
    samples: Samples | None = None
    tokens: Tokens | None = None
    peak_mem_bytes: Bytes | None = None
    profiled: bool = False
    device_s: Seconds | None = None
    data_idle_s: Seconds | None = None
    evidence: Literal["sampled", "trace"] = "sampled"
    shares: dict[str, Finite | None] | None = None
    mfu: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] | None = None


class LiveStep(StepRecord, kw_only=True, frozen=True):
    """A step as live.json holds it for `diag top`: its record, and its live verdict."""

    bound: Annotated[str, msgspec.Meta(max_length=32)] | None = None


STEP_FIELDS = {
    "step": "step number, the same on every rank",
    "start_unix": "wall-clock start of the step, seconds since the epoch",
    "duration_s": "step wall time from a monotonic clock",
    "data_wait_s": "time spent waiting for the next batch (null without agent.loader())",
    "collate_s": "of the data wait, collating batches in this process: a DataLoader with num_workers=0 (else null)",
    "cpu_s": "the process's CPU time over the step, all its threads (time.process_time)",
    "data_wait_cpu_s": "of cpu_s, the CPU time during the data wait (null without agent.loader())",
    "samples": "samples in the step, from agent.step(samples=...)",
    "tokens": "tokens in the step, from agent.step(tokens=...)",
    "peak_mem_bytes": "the device's peak allocated memory so far (the allocator's, never reset by diag), where available",
    "profiled": "true when a torch.profiler window covered the step",
    "device_s": "device time between timing events at the step's boundaries (null without a CUDA/HIP device)",
    "data_idle_s": "the device's idle time within the step's data waits, from timing events (null without them)",
    "evidence": "trace | sampled: what the step's shares rest on",
    "shares": "the step's time by class (data, host, comm, memory, compute; null where unknown): its data wait "
              "and the latest window's split of the rest",
    "mfu": "model FLOPs utilisation of the step, where the job gave its FLOPs per sample or token (else null)",
}


def plausible_count(value, field: str) -> bool:
    """Whether `value` can be the `field` ("samples", "tokens") of one step: None (not given),
    or a finite number from 0 to MAX_STEP_COUNTS[field]. On the training thread, where a
    comparison is all it may cost: a NumPy scalar passes, and is a plain number once written."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return bool(math.isfinite(value) and 0 <= float(value) <= MAX_STEP_COUNTS[field])


def from_json_record(raw, problems: list | None = None, where: str = "") -> StepRecord | None:
    """The record a decoded JSON object holds: None when it is no step (not an object, or its
    step number is no count of steps); a field it cannot hold is left out (its default), and an
    implausible sample or token count is noted in `problems` as a mistake of the job's."""
    return _typed(raw, StepRecord, problems, where)


def live_step(raw) -> LiveStep | None:
    """A step of a live.json document, read as a record is (from_json_record)."""
    return _typed(raw, LiveStep, None, "")


R = TypeVar("R", bound=StepRecord)


def _typed(raw, kind: type[R], problems: list | None, where: str) -> R | None:
    if type(raw) is not dict:
        return None
    try:
        return msgspec.convert(raw, kind)
    except REFUSED:
        pass  # damaged somewhere: its step number first, then field by field
    n = raw.get("step")
    if not (type(n) is int and holds(kind, "step", n, {})):
        note(problems, f"{where}a step record numbered {str(n)[:40]!r}, left out")
        return None

    def refused(name: str, value) -> None:
        if name in MAX_STEP_COUNTS:
            note(problems, f"{where}step {n} counts {str(value)[:40]} {name}, no count one step holds; left out")

    return settled(raw, kind, {"step": n}, refused)


def to_json_record(rec: StepRecord) -> dict[str, Any]:
    """The record as the JSON object a `steps` line holds."""
    return msgspec.structs.asdict(rec)
