"""A run directory's records as typed documents: each rank's window summaries and records, and
the run's, as the facade reads them once for the diagnosis and the report's charts.

`WindowSummary` is a file's format (rank-N/windows/window-NNNNNN.json, written by the agent's
window worker); `RankRecords` and `RunRecords` hold what `diag.analyzers.run_records` read.
Their types are settled where they are read (`diag.typed_json`), so no reader checks a field
again. Rank files (rank.json), samples and events stay JSON objects: their readers take the
few keys they know from them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from diag.step_record import MAX_STEP, StepRecord
from diag.typed_json import settled

Step = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
Unix = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
# A summary's error line; a longer one is cut where it is read.
MAX_ERROR_CHARS = 2000


class WindowSummary(msgspec.Struct, kw_only=True, frozen=True):
    """One profiler window: its steps, its trace's file name, and the trace's facts
    (`diag.analyzers.analysis_types.TraceRankFacts`), or why there are none."""

    first_step: Step | None = None
    last_step: Step | None = None
    trace: str | None = None
    created_unix: Unix | None = None
    analysis: dict[str, Any] | None = None
    error: str | None = None


def window_summary(raw) -> WindowSummary | None:
    """The summary a decoded JSON object holds (None when it is not an object, or an empty one);
    a field it cannot hold reads as absent."""
    if type(raw) is not dict or not raw:
        return None
    w = settled(raw, WindowSummary)
    if w.error is not None and len(w.error) > MAX_ERROR_CHARS:
        w = msgspec.structs.replace(w, error=w.error[:MAX_ERROR_CHARS])
    return w


def window_json(w: WindowSummary) -> dict[str, Any]:
    """The summary as its file holds it."""
    return msgspec.structs.asdict(w)


class RankRecords(msgspec.Struct, kw_only=True):
    """What one rank wrote. `steps` holds records only for a rank the run analysis did not
    cover (it carries their timings already)."""

    info: dict[str, Any] = {}  # rank.json
    steps: list[StepRecord] = []
    samples: list[dict[str, Any]] = []  # the sampler's records, in time order as written
    events: list[dict[str, Any]] = []
    windows: list[WindowSummary] = []  # in file-name (first step) order
    traces: int = 0  # trace files kept
    nccl_logs: int = 0  # NCCL log files kept


class RunRecords(msgspec.Struct, kw_only=True):
    """What a run directory holds besides its analysis, for the diagnosis and the report.
    A report of a saved analysis file has its path only."""

    path: str | None = None
    manifest: dict[str, Any] = {}
    ranks: dict[int, RankRecords] = {}
    missing_ranks: list[int] = []  # ranks expected from the world size, absent
    problems: list[str] = []  # unreadable or damaged files, one line each
    nccl_log: dict[str, Any] | None = None  # a diag.nccl_log/2 document (facts; /1 from older runs)
    nccl_bench: dict[str, Any] | None = None  # a diag.nccl_bench/1 document
    # Per collective of nccl_bench: {"collective", **diag.analyzers.nccl.expected.bandwidth_facts(...)}
    nccl_bandwidth: list[dict[str, Any]] = []
