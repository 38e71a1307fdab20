"""The model every stage shares: the classes a step's time is split into, the measurements the
analysis fills in (with their units), the measurements derived from others, and the settings
the analysis measures by.

Neutral: the analysis (trace, job, what-if) and the diagnosis both import it, and it imports
nothing of diag, so the analysis never reaches into the diagnosis for a name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

BOUNDS = ("data", "host", "comm", "memory", "compute")
# The classes a step's time is split into: the five bounds plus waiting for other ranks
# (only measured when collectives are matched across ranks). A verdict is never "wait":
# a rank that mostly waits is bound by the rank it waits for (PEER, resolved by the job).
CLASSES = ("data", "host", "comm", "wait", "memory", "compute")
PEER = "peer"


@dataclass(frozen=True)
class Measurement:
    """One quantity the tree can ask about: a fraction (shown as a percentage) or a ratio of
    two times (shown as "0.19x"), and what it is."""
    unit: str  # "fraction" | "ratio"
    meaning: str

    def text(self, value: float, threshold: bool = False) -> str:
        if self.unit == "ratio":
            if value == math.inf:
                return "inf"
            return f"{value:g}x" if threshold else f"{value:.2f}x"
        return f"{100 * value:g}%" if threshold else f"{100 * value:.1f}%"


# The measurement registry: every metric a node or an advisory of a tree may name (the tree's
# loader refuses others), with its unit for every view that prints it. The analysis fills them in.
MEASUREMENTS = {
    "data_share": Measurement("fraction", "DataLoader wait / step time"),
    "host_share": Measurement("fraction", "device idle, not waiting for data / step time"),
    "comm_share": Measurement("fraction", "exposed communication transfer (not waiting for peers) / step time"),
    "wait_share": Measurement("fraction", "waiting in collectives for the last peer to arrive / step time "
                                          "(matched ranks only)"),
    "memory_share": Measurement("fraction", "bandwidth-bound kernel time (exclusive) / step time"),
    "compute_share": Measurement("fraction", "compute-bound kernel time (exclusive) / step time"),
    "busy_share": Measurement("fraction", "device busy / step time (derived: comm + wait + memory + compute)"),
    "data_fraction_of_idle": Measurement("fraction", "data wait / (data wait + host idle) (derived)"),
    "memory_to_compute": Measurement("ratio", "bandwidth-bound device time / compute-bound device time"),
    "achieved_bw_frac": Measurement("fraction", "achieved memory bandwidth / device peak"),
    "memory_used_frac": Measurement("fraction", "peak device memory used / capacity"),
    "mfu": Measurement("fraction", "model FLOPs utilisation, achieved FLOP/s / peak"),
    "scaling_efficiency": Measurement("fraction", "per-rank throughput at larger world size / at smaller"),
}


def metric_text(metric: str, value, threshold: bool = False) -> str:
    """A measurement's value (or threshold) as every view prints it, by its registered unit."""
    if value is None:
        return "unknown"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    m = MEASUREMENTS.get(metric)
    return m.text(value, threshold) if m else f"{value:.3g}"


def derive(measurements: dict) -> dict:
    """Fill in derived measurements from the shares where they are missing."""
    m = {k: v for k, v in measurements.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
    if "busy_share" not in m and all(k in m for k in ("comm_share", "memory_share", "compute_share")):
        # A collective waiting for a peer occupies the device (or gloo's thread) as its transfer does.
        m["busy_share"] = m["comm_share"] + m.get("wait_share", 0.0) + m["memory_share"] + m["compute_share"]
    if "data_fraction_of_idle" not in m and "data_share" in m and "host_share" in m:
        idle = m["data_share"] + m["host_share"]
        m["data_fraction_of_idle"] = m["data_share"] / idle if idle > 0 else 0.0
    return m


def derive_columns(columns: dict) -> dict:
    """`derive` over columns of steps (NaN: unmeasured), as a new dict: a derived column is the
    measured one where there is one, else derived as `derive` derives it."""
    cols = dict(columns)
    if all(k in cols for k in ("comm_share", "memory_share", "compute_share")):
        wait = cols.get("wait_share")
        derived = cols["comm_share"] + (np.nan_to_num(wait) if wait is not None else 0.0) \
            + cols["memory_share"] + cols["compute_share"]
        busy = cols.get("busy_share")
        cols["busy_share"] = derived if busy is None else np.where(np.isnan(busy), derived, busy)
    if "data_share" in cols and "host_share" in cols:
        ds, hs = cols["data_share"], cols["host_share"]
        idle = ds + hs
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(idle > 0, ds / np.where(idle > 0, idle, 1.0), 0.0)
        frac[np.isnan(idle)] = np.nan
        cols["data_fraction_of_idle"] = frac
    return cols


def share_ratios(shares: dict) -> dict:
    """The ratio measurements of a step's (or rank's) shares: memory_to_compute, +inf where
    there is memory time and no compute."""
    mem, comp = shares.get("memory", 0.0), shares.get("compute", 0.0)
    if comp > 0:
        return {"memory_to_compute": mem / comp}
    return {"memory_to_compute": float("inf")} if mem > 0 else {}


def step_seconds(device_s, duration_s):
    """A step's length as the job paced it: its device time between the step's boundary events
    where the device clock measured it (`device_s`), else the host's time (`duration_s`, as
    given).

    A loop that never waits for the device queues work ahead: the host's steps then take the
    time to launch (1 ms for a 14 ms step on an H200) until the queue fills or something syncs,
    and the step that syncs takes the backlog. The boundary events tile the device's timeline,
    each step's start being the step before's end, so their times add up to the run's wall
    time in every regime: the device's work where it sets the pace, the host's span where the
    device waits for it (the events are then recorded as the host reaches each boundary)."""
    if type(device_s) in (int, float) and math.isfinite(device_s) and device_s > 0:
        return device_s
    return duration_s


def warmup_steps(n_steps: int, thresholds: Mapping) -> int:
    """How many of a run's first steps are warm-up when no profiler window says where it ends:
    the one rule, for the run analysis's counted steps and the diagnosis's models alike."""
    if n_steps < thresholds["warmup_min_run_steps"]:
        return 0
    return int(min(thresholds["warmup_max_steps"], max(1, n_steps * thresholds["warmup_fraction"])))


@dataclass(frozen=True)
class FactSettings:
    """What the analysis measures by: the what-if changes to replay, and the tree's thresholds
    that set how a fact is measured (a resolution, a model's rate, the share a phase must
    cover for its detailed facts to be worth their cost). None of them judges a fact: the
    diagnosis does, by its own thresholds. Made from a tree by `decision_tree.Tree.facts`."""
    what_if: tuple
    # Phases under this share of the traced time get no detailed facts (their cost is real on a
    # large trace, and no cause rule names a phase that small: the diagnosis sets it so).
    cause_facts_min_share: float
    # Steady iterations of a trace without ProfilerStep spans: how many repeats make a loop, and
    # how much longer than the steady ones a start-up iteration is.
    iteration_min_count: float
    iteration_startup_ratio: float
    # Bandwidth-bound kernel groups: the fraction of peak a what-if brings them to, the fraction
    # under which their saving is counted, and the smallest call that can reach the peak.
    bandwidth_target_peak: float
    bandwidth_slow_peak: float
    bandwidth_min_call_mb: float
    # How much faster bf16 matrix math runs than fp32 on a CPU, for the what-if of lowering it.
    cpu_half_precision_speedup: float
    # The shortest stretch of the training thread outside every op that counts as a gap.
    python_gap_min_us: float
    # The share of its host events a trace must hold for its CPU work between ops to be measured.
    cpu_work_min_op_coverage: float
    # The warm-up a run's counted steps leave out where no profiler window says (warmup_steps).
    warmup_min_run_steps: float
    warmup_max_steps: float
    warmup_fraction: float

    def warmup_steps(self, n_steps: int) -> int:
        return warmup_steps(n_steps, self.__dict__)

    @classmethod
    def of(cls, thresholds: Mapping, what_if=()) -> FactSettings:
        """The settings from a tree's thresholds (every one of these must be there)."""
        values = {f.name: float(thresholds[f.name]) for f in fields(cls) if f.name != "what_if"}
        return cls(what_if=tuple(what_if), **values)
