"""Steady iterations of a trace recorded without ProfilerStep spans.

torch.profiler's schedule marks each step `ProfilerStep#N`; a trace from the older
`torch.autograd.profiler.profile()`, or from a profiler started by hand, has no such spans,
and taken whole it mixes start-up (context creation, the first iterations, autotuning)
with the loop. A training loop still leaves a marker that repeats once per iteration:
torch.optim's `Optimizer.step#<Class>.step` and `Optimizer.zero_grad#...`, the
DataLoader's `enumerate(DataLoader)#...__next__`, or a user annotation around the step.
The starts of one marker's occurrences bound the iterations, each from one occurrence to
the next; the time before the first and after the last is start-up and tear-down.

Start-up inside the found iterations: leading iterations longer than
`iteration_startup_ratio` times the median of the later half are left out (a first call
that compiles, autotunes or allocates). Fewer than `iteration_min_count` iterations, or no
marker at all: the whole trace is one window, and the facts say why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Markers by preference: the optimizer's step ends every training iteration once; the others
# also repeat once per iteration but may be absent (no zero_grad, a loader that is not torch's).
MARKERS = (
    ("Optimizer.step#", "the optimizer's step"),
    ("Optimizer.zero_grad#", "the optimizer's zero_grad"),
    ("enumerate(DataLoader)#", "the DataLoader's next batch"),
)
USER_ANNOTATION = 1  # cpu_kind of record_function ranges (schema.CPU_CATS)
MAX_CANDIDATES = 16  # markers tried at most (each try reads the trace's host columns once)


@dataclass(frozen=True)
class Iterations:
    """The windows to judge, as (iteration number or None, start us, end us), and how they were found."""

    windows: list[tuple[int | None, float, float]]
    marker: str | None = None  # the repeating event's name
    marker_kind: str | None = None  # what it is ("the optimizer's step", "a user annotation")
    found: int = 0  # iterations between consecutive markers
    startup: list[int] = field(default_factory=list)  # iterations left out as start-up
    reason: str = ""

    def facts(self) -> dict:
        return {"marker": self.marker, "marker_kind": self.marker_kind, "found": self.found,
                "used": [w[0] for w in self.windows] if self.marker else [], "startup": list(self.startup),
                "reason": self.reason}


def _starts(trace, name_id: int) -> np.ndarray:
    """Starts of the marker's occurrences on the thread where it occurs most, in order."""
    rows = np.flatnonzero(trace.cpu_name == name_id)
    tids = trace.cpu_tid[rows]
    values, counts = np.unique(tids, return_counts=True)
    rows = rows[tids == values[np.argmax(counts)]]
    return np.unique(trace.cpu_ts[rows])  # sorted; one per start (nested repeats collapse)


def _candidates(trace, min_occurrences: int) -> list[tuple[int, str, str]]:
    """(name id, name, kind) of repeating markers, by preference."""
    by_prefix: dict[str, tuple[int, str]] = {}
    annotations: list[tuple[int, int, str]] = []
    ids, counts = np.unique(trace.cpu_name, return_counts=True)
    for i, n in zip(ids.tolist(), counts.tolist()):
        name = trace.names[i]
        for prefix, _ in MARKERS:
            if name.startswith(prefix) and (prefix not in by_prefix or n > by_prefix[prefix][1]):
                by_prefix[prefix] = (i, n)
    user_ids, user_counts = np.unique(trace.cpu_name[trace.cpu_kind == USER_ANNOTATION], return_counts=True)
    for i, n in zip(user_ids.tolist(), user_counts.tolist()):
        name = trace.names[i]
        if n >= min_occurrences and not name.startswith(tuple(p for p, _ in MARKERS) + ("ProfilerStep",)):
            annotations.append((n, i, name))
    out = [(by_prefix[p][0], trace.names[by_prefix[p][0]], kind) for p, kind in MARKERS if p in by_prefix]
    # Then user annotations, the least repeated first: one around each step repeats less often
    # than one around each layer.
    out += [(i, name, "a user annotation") for _, i, name in sorted(annotations)]
    return out[:MAX_CANDIDATES]


def steady_iterations(trace, whole: tuple[float, float], settings) -> Iterations:
    """The steady iterations of a trace without ProfilerStep spans, or the whole trace as one
    window; `settings` (model.FactSettings) says how many repeats make a loop and how much
    longer than the steady ones a start-up iteration is."""
    min_count = int(settings.iteration_min_count)
    ratio = float(settings.iteration_startup_ratio)
    for name_id, name, kind in _candidates(trace, min_count + 1):
        starts = _starts(trace, name_id)
        if len(starts) < min_count + 1:
            continue
        durations = np.diff(starts)
        later = durations[len(durations) // 2:]
        ref = float(np.median(later))
        if not ref > 0:
            continue
        first = 0
        while first < len(durations) - min_count and durations[first] > ratio * ref:
            first += 1
        windows: list[tuple[int | None, float, float]] = [(k, float(starts[k]), float(starts[k + 1]))
                                                          for k in range(first, len(durations))]
        reason = (f"{len(durations)} iterations between the starts of {name!r} ({kind}); "
                  + (f"the first {first} left out as start-up (over {ratio:g}x the median "
                     f"{ref / 1e3:.1f} ms of the later iterations)" if first else "none longer than "
                     f"{ratio:g}x the median {ref / 1e3:.1f} ms, so none left out as start-up"))
        return Iterations(windows, name, kind, len(durations), list(range(first)), reason)
    return Iterations([(None, whole[0], whole[1])], reason=(
        "no ProfilerStep spans and no marker that repeats once per iteration (optimizer step, zero_grad, "
        "DataLoader, a user annotation) at least "
        f"{min_count + 1} times: the whole trace is judged as one step, start-up included"))
