"""What the decision tree asks of the steps outside profiler windows ("sampled" evidence).

Outside windows the tree runs on what the agent always measures (data wait from
`agent.loader()`, step time, device utilisation from NVML/amdsmi) and on the composition
of the most recent window, which tells how the device's busy time splits between
communication, bandwidth-bound and compute-bound work.

The sampled attribution keeps the window's proportions rather than its absolute times,
because profiled steps run slower than unprofiled ones (the profiler's own cost), and
absolute times from a window would overstate the device's share of a normal step.

The agent measures each step live (`step_measurements`); the run analysis measures a
whole rank's sampled steps at once, as columns (`sampled_steps`), and the diagnosis walks
the tree over them (`diagnosis.rank.sampled_verdicts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diag.analyzers.analysis_types import TraceRankFacts
from diag.analyzers.model import CLASSES, share_ratios, step_seconds
from diag.analyzers.numbers import finite as _finite_or_none
from diag.step_record import StepRecord

# The classes of a step's non-data time, and of its busy time (a collective waiting for a
# peer occupies the device or gloo's thread as its transfer does).
NON_DATA = ("host", "comm", "wait", "memory", "compute")
BUSY = ("comm", "wait", "memory", "compute")
# A device sample further than this from a step's middle does not describe the step.
SAMPLE_MATCH_S = 5.0


def window_composition(analysis: TraceRankFacts | None) -> dict | None:
    """How a window's steps split their non-data time, from the trace analyzer's facts."""
    if analysis is None or analysis.device_events_missing:
        return None  # host-side attribution of a GPU process: nothing about the device's busy time
    acc = dict.fromkeys(CLASSES, 0.0)
    total = 0.0
    for s in analysis.steps:
        sh, d = s.get("shares"), s.get("duration_ms")
        if not isinstance(sh, dict) or not isinstance(d, (int, float)) or d <= 0:
            continue
        total += d
        for b in CLASSES:
            acc[b] += float(sh.get(b) or 0.0) * d
    if total <= 0:
        return None
    mean = {b: acc[b] / total for b in CLASSES}
    non_data = 1.0 - mean["data"]
    if non_data <= 1e-9:
        return None
    busy = sum(mean[b] for b in BUSY)
    comp = {
        "non_data": {b: mean[b] / non_data for b in NON_DATA},
        "busy_split": {b: (mean[b] / busy if busy > 0 else 0.0) for b in BUSY},
        "achieved_bw_frac": _finite_or_none(analysis.measurements.get("achieved_bw_frac")),
        # Waiting is only known where the window's collectives were matched across ranks.
        "wait_measured": bool((analysis.wait_split or {}).get("measured")),
    }
    return comp


def sampled_shares(
    duration_s: float | None,
    data_wait_s: float | None,
    utilization: float | None,
    composition: dict | None,
    data_idle_s: float | None = None,
) -> tuple[dict | None, dict]:
    """(the five shares or None, the tree measurements) of one step without a trace.

    The device runs asynchronously: while the host waits for the next batch it may still
    be draining the step's queued work. So a data wait counts as data only where the
    device was idle, the trace path's priority (device work before data before host):
    - `data_idle_s`, the device's idle time within the step's data waits (timing events
      around each wait, collectors/device_clock.py), when the agent measured it;
    - else, with a utilisation sample, busy time first and the data wait within the rest;
    - else (no device: a CPU job, whose host is its device) the whole data wait.
    """
    m: dict = {}
    if not isinstance(duration_s, (int, float)) or duration_s <= 0:
        return None, m
    data = min(max((data_wait_s or 0.0) / duration_s, 0.0), 1.0)
    if data_idle_s is not None:
        data = min(max(data_idle_s / duration_s, 0.0), data)
    busy = None
    if utilization is not None:
        busy = min(max(float(utilization), 0.0), 1.0)
        if data_idle_s is None:
            data = min(data, 1.0 - busy)
        busy = min(busy, 1.0 - data)
    if data_wait_s is not None:
        m["data_share"] = data
    rest = 1.0 - data
    if busy is not None:
        host = rest - busy
        m["busy_share"] = busy
        m["host_share"] = host
        if composition is None:
            return None, m
        split = composition["busy_split"]
        shares = {"data": data, "host": host, **{b: busy * split.get(b, 0.0) for b in BUSY}}
    elif composition is not None:
        nd = composition["non_data"]
        shares = {"data": data, **{b: rest * nd.get(b, 0.0) for b in NON_DATA}}
    else:
        return None, m
    m.update({f"{b}_share": v for b, v in shares.items() if b != "wait" or composition.get("wait_measured")})
    m.update(share_ratios(shares))
    if composition.get("achieved_bw_frac") is not None:
        m["achieved_bw_frac"] = composition["achieved_bw_frac"]
    return shares, m


def device_busy_floor(record: StepRecord) -> float | None:
    """The least share of a step the device was busy, from its boundary events (None: not
    measured). Where the host's part of the step ended before the device's, the device ran
    queued work for the difference at least: a loop that never syncs keeps it busy all along.

    A utilisation sample describes the second or so before it was taken, which in a short run
    can be the idle start; this floor is the step's own."""
    host, device = record.duration_s, record.device_s
    if host is None or device is None or device <= 0:
        return None
    return min(max(1.0 - host / device, 0.0), 1.0)


def record_seconds(record: StepRecord) -> float | None:
    """A step record's length as the job paced it (model.step_seconds)."""
    return step_seconds(record.device_s, record.duration_s)


def step_measurements(record: StepRecord, sample: dict | None, composition: dict | None) -> tuple[dict | None, dict]:
    """(the shares or None, the tree measurements) of one step record from always-on
    measurements (evidence "sampled"); no measurement at all gives ({}, None)."""
    util = None
    gpu = (sample or {}).get("gpu") if isinstance(sample, dict) else None
    if isinstance(gpu, dict) and isinstance(gpu.get("utilization_ratio"), (int, float)):
        util = float(gpu["utilization_ratio"])
        if not math.isfinite(util):  # a failed reading is no reading
            util = None
    floor = device_busy_floor(record)
    if util is not None and floor is not None:
        util = max(util, floor)
    shares, m = sampled_shares(record_seconds(record), record.data_wait_s, util, composition, record.data_idle_s)
    return (shares, m) if m else (None, m)


NO_SAMPLE = -1


def sample_utilization(samples: list[dict]) -> np.ndarray:
    out = np.full(len(samples), np.nan)
    for i, s in enumerate(samples):
        gpu = s.get("gpu")
        if isinstance(gpu, dict) and isinstance(gpu.get("utilization_ratio"), (int, float)):
            v = float(gpu["utilization_ratio"])
            if math.isfinite(v):  # as step_measurements: a failed reading is no reading
                out[i] = v
    return out


def nearest_samples(times: np.ndarray, mids: np.ndarray) -> np.ndarray:
    """Index of the sample nearest each time (the earlier one on a tie), or -1 beyond SAMPLE_MATCH_S."""
    if len(times) == 0:
        return np.full(len(mids), NO_SAMPLE, dtype=np.int64)
    i = np.searchsorted(times, mids, side="left")
    lo = np.clip(i - 1, 0, len(times) - 1)
    hi = np.clip(i, 0, len(times) - 1)
    d_lo = np.where(i - 1 >= 0, np.abs(times[lo] - mids), np.inf)
    d_hi = np.where(i < len(times), np.abs(times[hi] - mids), np.inf)
    best = np.where(d_lo <= d_hi, lo, hi)
    return np.where(np.abs(times[best] - mids) <= SAMPLE_MATCH_S, best, NO_SAMPLE)


@dataclass(frozen=True)
class SampledSteps:
    """A rank's sampled steps, in step order, as the tree's measurements (facts only).

    covered: the indices of the steps whose measurements are plain numbers, described by
    `columns` (one array per measured quantity, NaN where unmeasured; the derived ones are
    the diagnosis's, `model.derive_columns`) and `empty` (no measurement at all); `shares` of
    every step (None where unknown); `alone`, the measurements of each step the columns do
    not cover, by its index.
    """
    count: int
    covered: list[int]
    columns: dict[str, np.ndarray]
    empty: list[bool]
    shares: list[dict | None]
    alone: dict[int, dict]


def sampled_steps(recs: list[StepRecord], samples_of: list, comp_of: list, util: np.ndarray) -> SampledSteps:
    """The sampled steps' measurements: records, each one's nearest sample (or None) and
    window composition (or None), and the samples' utilisation per record (NaN: none)."""
    inputs = list(zip(recs, samples_of, comp_of))
    ok = [i for i, r in enumerate(recs) if (length := record_seconds(r)) is not None and length > 0]
    floors = np.array([np.nan if (f := device_busy_floor(r)) is None else f for r in recs], dtype=float)
    util = np.where(np.isnan(util) | np.isnan(floors), util, np.fmax(util, floors))
    cols, empty, rows = _columns(recs, ok, comp_of, util) if ok else ({}, [], {})
    alone = {i: step_measurements(*inputs[i]) for i in range(len(recs)) if i not in rows}
    shares = [rows[i] if i in rows else alone[i][0] for i in range(len(recs))]
    return SampledSteps(len(recs), ok, cols, empty, shares, {i: m for i, (_, m) in alone.items()})


def _columns(recs: list[StepRecord], ok: list[int], comp_of: list, util: np.ndarray) -> tuple[dict, list, dict]:
    """(the tree's measured columns of the covered records, which have none at all, the
    shares of each covered record by its index)."""
    idx = np.array(ok, dtype=np.int64)
    dur = np.array([float(record_seconds(recs[i]) or 0.0) for i in ok])
    dw_raw = [recs[i].data_wait_s for i in ok]
    has_dw = np.array([w is not None for w in dw_raw])
    dw = np.array([float(w or 0.0) for w in dw_raw])
    idle = np.array([np.nan if (v := recs[i].data_idle_s) is None else v for i in ok], dtype=float)
    has_idle = ~np.isnan(idle)
    u = util[idx]
    has_u = ~np.isnan(u)
    # The few distinct window compositions, indexed per row (-1: none, the table's last entry).
    table: list[dict] = []
    seen: dict[int, int] = {}
    cid = []
    for i in ok:
        c = comp_of[i]
        if c is None:
            cid.append(-1)
            continue
        k = seen.get(id(c))
        if k is None:
            k = seen[id(c)] = len(table)
            table.append(c)
        cid.append(k)
    cidx = np.array(cid, dtype=np.int64)
    has_c = cidx >= 0
    m = len(ok)

    def per_row(values: list) -> np.ndarray:
        return np.array([*values, np.nan], dtype=float)[cidx]

    def split(key: str, b: str) -> np.ndarray:
        return per_row([c[key][b] for c in table])

    # As sampled_shares: the device's idle time within the data waits, else busy time first.
    data = np.minimum(np.maximum(dw / dur, 0.0), 1.0)
    data = np.where(has_idle, np.minimum(np.maximum(np.nan_to_num(idle) / dur, 0.0), data), data)
    busy = np.minimum(np.maximum(np.where(has_u, u, 0.0), 0.0), 1.0)
    data = np.where(has_u & ~has_idle, np.minimum(data, 1.0 - busy), data)
    busy = np.minimum(busy, 1.0 - data)
    rest = 1.0 - data
    host_u = rest - busy
    nan = np.full(m, np.nan)
    shares = {"data": data}
    with np.errstate(invalid="ignore"):
        shares["host"] = np.where(has_u, host_u, rest * split("non_data", "host"))
        for b in BUSY:
            shares[b] = np.where(has_u, busy * split("busy_split", b), rest * split("non_data", b))
    has_shares = has_c
    cols = {
        "data_share": np.where(has_dw | has_shares, data, nan),
        "busy_share": np.where(has_u, busy, nan),
        "host_share": np.where(has_u | has_shares, shares["host"], nan),
    }
    for b in BUSY:
        cols[f"{b}_share"] = np.where(has_shares, shares[b], nan)
    wait_known = per_row([1.0 if c.get("wait_measured") else np.nan for c in table])
    cols["wait_share"] = cols["wait_share"] * wait_known
    mem, cmp_ = cols["memory_share"], cols["compute_share"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(cmp_ > 0, mem / np.where(cmp_ > 0, cmp_, 1.0), np.where(mem > 0, np.inf, nan))
    cols["memory_to_compute"] = np.where(has_shares, ratio, nan)
    bw = per_row([c["achieved_bw_frac"] if c.get("achieved_bw_frac") is not None else np.nan for c in table])
    cols["achieved_bw_frac"] = np.where(has_shares, bw, nan)

    empty = ~(has_dw | has_u | has_shares)  # no measurement at all: no verdict, empty path
    share_rows = np.column_stack([shares[b] for b in CLASSES]).tolist()
    has_sh_l = has_shares.tolist()
    rows = {i: (dict(zip(CLASSES, share_rows[j])) if has_sh_l[j] else None) for j, i in enumerate(ok)}
    return cols, empty.tolist(), rows
