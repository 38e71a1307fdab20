"""What the diagnosis reads: each rank's analysis merged with its run-directory records.

`merge_ranks(ranks, run)` joins the judged ranks of an analysis (schema diag.analysis/1) with the
records of a run directory already read into memory (`diag.run_documents.RunRecords`)
into one `MergedRank` per rank, whose steps are columns (`Steps`). The diagnosis and the
report views both read these; nothing here judges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from diag.analyzers.analysis_types import (
    Job,
    JudgedRank,
    RankFacts,
    RankVerdict,
    RunRankFacts,
    TraceRankFacts,
    judged_steps,
)
from diag.analyzers.diagnosis.decision_tree import CLASSES
from diag.analyzers.model import step_seconds
from diag.analyzers.numbers import finite as num
from diag.run_documents import RankRecords, RunRecords, WindowSummary
from diag.step_record import StepRecord

PHASE_LABELS = {
    "data": "waiting for data",
    "host": "host overhead (device idle)",
    "comm": "exposed communication",
    "wait": "waiting for other ranks",
    "memory": "bandwidth-bound kernels",
    "compute": "compute kernels",
}


# What the share of each phase means in one phrase, used in the headline sentence.
PHASE_PHRASES = {
    "data": "waiting for the DataLoader takes",
    "host": "the device sits idle while the host launches, synchronises or runs Python for",
    "comm": "exposed communication transfer (not hidden behind computation) is",
    "wait": "waiting at collectives for other ranks takes",
    "memory": "bandwidth-bound kernels (elementwise, norms, copies) take",
    "compute": "compute kernels (matmul, convolution, attention) take",
}


def bucket_starts(n: int, k: int) -> np.ndarray:
    """Start indices of at most k contiguous, near-equal buckets over range(n)."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n, k + 1).astype(int)[:-1])


def bucket_mean(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """NaN-aware mean of consecutive buckets (along axis 0), NaN where a bucket has no value."""
    ok = ~np.isnan(values)
    sums = np.add.reduceat(np.where(ok, values, 0.0), starts, axis=0)
    cnt = np.add.reduceat(ok.astype(np.float64), starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, sums / np.maximum(cnt, 1), np.nan)


BOUND_CODE = {p: i for i, p in enumerate(CLASSES)}


EVIDENCE_CODE = {"sampled": 1, "trace": 2}


def _code(codes: dict[str, int], label, default: int) -> int:
    """A label's code; anything but a string (a hostile record's list, say) gets the default."""
    return codes.get(label, default) if isinstance(label, str) else default


_NAN = float("nan")


def as_float(v) -> float:
    """A number from JSON as float, NaN when absent or not a number (bools are not numbers)."""
    t = type(v)
    return float(v) if t is float or t is int else _NAN


def _or_nan(v: float | None) -> float:
    """A settled record's number as float, NaN where not measured."""
    return _NAN if v is None else float(v)


def share_row(sh):
    if type(sh) is not dict:
        return None
    try:
        # A share set from before the wait split has no "wait": its waiting is in comm.
        return (float(sh["data"]), float(sh["host"]), float(sh["comm"]), float(sh.get("wait") or 0.0),
                float(sh["memory"]), float(sh["compute"]))
    except (KeyError, TypeError, ValueError):
        return None


class Steps:
    """One rank's (or the job's) steps as columns: numpy arrays, NaN where not measured.

    Columnar because big runs have 10^5-10^6 step records and every chart and figure is a
    reduction over them.
    """

    FIELDS = ("dur", "start", "wait", "samples", "tokens", "peak", "mfu", "device")
    # The FIELDS columns, float64, set in __init__.
    dur: np.ndarray
    start: np.ndarray
    wait: np.ndarray
    samples: np.ndarray
    tokens: np.ndarray
    peak: np.ndarray
    mfu: np.ndarray
    device: np.ndarray

    def __init__(self, n: int):
        self.step = np.zeros(n, dtype=np.int64)
        for f in self.FIELDS:
            setattr(self, f, np.full(n, np.nan))
        self.shares = np.full((n, len(CLASSES)), np.nan)
        self.bound = np.full(n, -1, dtype=np.int8)
        self.evidence = np.zeros(n, dtype=np.int8)  # what each step's shares rest on: EVIDENCE_CODE

    def __len__(self) -> int:
        return len(self.step)

    @property
    def traced(self) -> np.ndarray:
        """Steps whose shares rest on a profiler trace."""
        return self.evidence == EVIDENCE_CODE["trace"]

    @property
    def has_shares(self) -> np.ndarray:
        return ~np.isnan(self.shares[:, 0])


_STEP_MIN, _STEP_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
# A step's row while it is merged: Steps.FIELDS, then its shares, verdict and evidence.
_SHARES, _BOUND, _EVIDENCE = len(Steps.FIELDS), len(Steps.FIELDS) + 1, len(Steps.FIELDS) + 2


def _rank_steps(records: Sequence[StepRecord], doc_steps: list) -> Steps:
    """Step records of the run directory (their types settled as they were read) merged with
    analysed steps (diag.analysis/1); the analysis wins for shares, verdict and evidence, the
    records for timings."""
    rows: dict[int, list] = {}
    for rec in records:
        # A record holds measurements only (step_record.StepRecord): its verdict is the analysis's.
        rows[rec.step] = [_or_nan(step_seconds(rec.device_s, rec.duration_s)), _or_nan(rec.start_unix),
                          _or_nan(rec.data_wait_s), _or_nan(rec.samples), _or_nan(rec.tokens),
                          _or_nan(rec.peak_mem_bytes), _or_nan(rec.mfu), _or_nan(rec.device_s),
                          share_row(rec.shares), -1, EVIDENCE_CODE[rec.evidence]]
    for st in doc_steps:
        # A step number the step column cannot hold (a damaged saved document) is no step.
        if type(st) is not dict or type(st.get("step")) is not int or not _STEP_MIN <= st["step"] <= _STEP_MAX:
            continue
        row = rows.get(st["step"])
        if row is None:
            row = rows[st["step"]] = [_NAN] * len(Steps.FIELDS) + [None, -1, 0]
        sh = share_row(st.get("shares"))
        if sh is not None:
            row[_SHARES] = sh
        b = _code(BOUND_CODE, st.get("bound"), -1)
        if b >= 0:
            row[_BOUND] = b
        e = _code(EVIDENCE_CODE, st.get("evidence"), 0)
        if e:
            row[_EVIDENCE] = e
        if math.isnan(row[0]):
            row[0] = as_float(st.get("duration_ms")) / 1000.0
        if math.isnan(row[2]):
            row[2] = as_float(st.get("data_wait_ms")) / 1000.0
        for i, k in ((3, "samples"), (4, "tokens"), (5, "peak_mem_bytes"), (6, "mfu")):
            if math.isnan(row[i]):
                row[i] = as_float(st.get(k))
        if math.isnan(row[7]):
            row[7] = as_float(st.get("device_ms")) / 1000.0
    order = sorted(rows)
    t = Steps(len(order))
    if not order:
        return t
    t.step[:] = order
    table = [rows[k] for k in order]
    for i, f in enumerate(Steps.FIELDS):
        col = np.fromiter((r[i] for r in table), dtype=np.float64, count=len(table))
        col[~np.isfinite(col)] = np.nan
        setattr(t, f, col)
    t.dur[t.dur <= 0] = np.nan
    have = [i for i, r in enumerate(table) if r[_SHARES] is not None]
    if have:
        sh = np.array([table[i][_SHARES] for i in have], dtype=np.float64)
        total = sh.sum(axis=1)
        ok = np.isfinite(total) & (total > 0) & (sh >= 0).all(axis=1)
        sh[ok] /= total[ok, None]
        sh[~ok] = np.nan
        t.shares[have] = sh
    t.bound[:] = [r[_BOUND] for r in table]
    t.evidence[:] = [r[_EVIDENCE] for r in table]
    # Steps with shares but no verdict: the largest share stands in.
    fill = (t.bound < 0) & t.has_shares
    if fill.any():
        t.bound[fill] = np.argmax(t.shares[fill], axis=1)
    return t


def _covers_records(facts: RankFacts) -> bool:
    """True when the rank came from the run analysis, whose steps hold the records' timings."""
    return isinstance(facts, RunRankFacts) and "sampled_steps" in facts.evidence and bool(facts.steps)


class MergedRank(msgspec.Struct, kw_only=True, frozen=True):
    """One rank as the diagnosis and the report read it: its analysis (its facts and its
    verdict), its run-directory records, and its steps as columns."""

    rank: int
    facts: RankFacts = msgspec.field(default_factory=TraceRankFacts)  # its analysis's facts (none: no field set)
    verdict: RankVerdict = msgspec.field(default_factory=RankVerdict)  # what the diagnosis judged of them
    info: dict[str, Any] = {}  # rank.json, {} without one
    host: str | None = None
    device: str | None = None
    step_table: Steps = msgspec.field(default_factory=lambda: Steps(0))  # its records merged with its analysed steps
    samples: list[dict[str, Any]] = []
    windows: list[WindowSummary] = []
    traces: int = 0
    nccl_logs: int = 0
    events: list[dict[str, Any]] = []


# The merged ranks of a job by rank number.
Ranks = dict[int, MergedRank]


def merge_ranks(judged_ranks: Sequence[JudgedRank], run: RunRecords) -> Ranks:
    """Per rank: its facts and verdict, and its step records merged with its analysed steps
    (of a rank two traces claim, the first)."""
    out: dict[int, MergedRank] = {}
    doc_ranks: dict[int, JudgedRank] = {}
    for r in judged_ranks:
        if isinstance(r.rank, int):
            doc_ranks.setdefault(r.rank, r)
    for rank in sorted(set(doc_ranks) | set(run.ranks)):
        judged = doc_ranks.get(rank) or JudgedRank(facts=TraceRankFacts(rank=rank))
        facts = weighed_facts(judged)
        raw = run.ranks.get(rank) or RankRecords()
        info = raw.info
        out[rank] = MergedRank(
            rank=rank, facts=facts, verdict=judged.verdict, info=info,
            host=first_str(info, "hostname", "host") or (facts.host or None if isinstance(facts, RunRankFacts) else None),
            device=_device_name(info, facts),
            # The run analysis already carries every step record's timings in its steps; the raw
            # records are only read for ranks it does not cover (halves the work on big runs).
            step_table=_rank_steps([] if _covers_records(facts) else raw.steps, judged_steps(judged)),
            samples=raw.samples, windows=raw.windows, traces=raw.traces, nccl_logs=raw.nccl_logs, events=raw.events,
        )
    return out


def weighed_facts(r: JudgedRank) -> RankFacts:
    """The facts as the diagnosis weighs them: a sampled trace's steps (most of its host events
    left out) count as sampled, not traced, so no rule reads their ops as a step's whole work."""
    if r.verdict.sampled is not True:
        return r.facts
    return msgspec.structs.replace(r.facts, steps=[{**s, "evidence": "sampled"} for s in r.facts.steps])


def traced_steps(facts: RankFacts) -> int:
    """How many of a rank's steps were traced (inside a profiler window)."""
    return sum(1 for s in facts.steps if s.get("evidence") == "trace")


def traced_durations(facts: RankFacts) -> list[float]:
    """The durations (ms) of a rank's traced steps."""
    return [float(d) for s in facts.steps
            if s.get("evidence") == "trace" and isinstance(d := s.get("duration_ms"), (int, float))]


def recorded_model(facts: RankFacts) -> dict | None:
    """What the live model and optimizer held, as the rank's agent recorded it (runs only)."""
    return facts.model if isinstance(facts, RunRankFacts) else None


def measured_rates(facts: RankFacts) -> dict | None:
    """The FLOPs and device-work rate of a run's profiled steps (runs only)."""
    return facts.rates if isinstance(facts, RunRankFacts) else None


def recorded_loader(facts: RankFacts) -> dict | None:
    """The wrapped DataLoader's settings, as the rank's agent recorded them (runs only)."""
    return facts.loader if isinstance(facts, RunRankFacts) else None


def device_timeline(facts: RankFacts) -> bool:
    """Whether a trace's steps were timed on the device (a run's rank says no such thing)."""
    return isinstance(facts, TraceRankFacts) and facts.timeline == "device"


def device_events_missing(facts: RankFacts) -> bool:
    """Whether a GPU process's trace lacks its device events."""
    return isinstance(facts, TraceRankFacts) and facts.device_events_missing


def step_iterations(facts: RankFacts) -> dict | None:
    """How a trace without ProfilerStep spans had its iterations found (None otherwise)."""
    return facts.iterations if isinstance(facts, TraceRankFacts) else None


def first_str(d, *keys) -> str | None:
    if not isinstance(d, dict):
        return None
    for k in keys:
        v = d.get(k)
        if isinstance(v, str) and v:
            return v
    return None


def _device_name(info: dict, facts: RankFacts) -> str | None:
    for src in (facts.device, info.get("device")):
        if isinstance(src, str) and src:
            return src
        if isinstance(src, dict):
            name = first_str(src, "name", "type")
            if name:
                return name
    return None


def world_size(job: Job, run: RunRecords, missing: list[int], ranks: Ranks) -> int:
    """The job's world size: the largest any source gives, and at least the ranks present and missing."""
    cands = [job.world_size, run.manifest.get("world_size")]
    cands += [r.facts.world_size for r in ranks.values()]
    cands += [r.info.get("world_size") for r in ranks.values()]
    cands = [c for c in cands if isinstance(c, int) and c > 0]
    return max(cands + [len(ranks) + len(missing), 1])


def tw_shares(t: Steps) -> dict | None:
    """Shares over many steps, each step weighted by its duration (1 where unknown)."""
    ok = t.has_shares
    if not ok.any():
        return None
    w = np.where(np.isnan(t.dur[ok]), 1.0, t.dur[ok])
    v = (t.shares[ok] * w[:, None]).sum(axis=0) / w.sum()
    return {p: float(v[i]) for i, p in enumerate(CLASSES)}


def rank_shares(r: MergedRank) -> dict | None:
    """The rank's shares as its analysis gives them (the run analysis leaves warm-up steps out,
    so these match the decision path), else time-weighted over its steps."""
    sh = share_row(r.facts.shares)
    if sh is not None and all(math.isfinite(x) and x >= 0 for x in sh) and sum(sh) > 0:
        return {p: sh[i] / sum(sh) for i, p in enumerate(CLASSES)}
    return tw_shares(r.step_table)


def concat(ranks: Ranks) -> Steps:
    """All ranks' steps in one table (for counts and distributions)."""
    parts = [r.step_table for r in ranks.values()]
    t = Steps(0)
    if not parts:
        return t
    t.step = np.concatenate([p.step for p in parts])
    for f in Steps.FIELDS:
        setattr(t, f, np.concatenate([getattr(p, f) for p in parts]))
    t.shares = np.concatenate([p.shares for p in parts])
    t.bound = np.concatenate([p.bound for p in parts])
    t.evidence = np.concatenate([p.evidence for p in parts])
    return t


def job_steps(ranks: Ranks) -> Steps:
    """One row per step number across ranks: the job's step time is the slowest rank's,
    shares are the mean over ranks, the verdict the most common one."""
    allt = concat(ranks)
    steps = np.unique(allt.step)
    job = Steps(len(steps))
    if not len(steps):
        return job
    job.step = steps
    pos = np.searchsorted(steps, allt.step)
    with np.errstate(invalid="ignore"):
        np.fmax.at(job.dur, pos, allt.dur)
        np.fmax.at(job.device, pos, allt.device)
        np.fmin.at(job.start, pos, allt.start)
        for f in ("samples", "tokens"):
            col = getattr(allt, f)
            m = ~np.isnan(col)
            acc = np.zeros(len(steps))
            np.add.at(acc, pos[m], col[m])
            seen = np.zeros(len(steps), dtype=bool)
            seen[pos[m]] = True
            setattr(job, f, np.where(seen, acc, np.nan))
        for f in ("mfu", "wait"):
            col = getattr(allt, f)
            m = ~np.isnan(col)
            acc, cnt = np.zeros(len(steps)), np.zeros(len(steps))
            np.add.at(acc, pos[m], col[m])
            np.add.at(cnt, pos[m], 1)
            setattr(job, f, np.where(cnt > 0, acc / np.maximum(cnt, 1), np.nan))
        m = allt.has_shares
        acc, cnt = np.zeros((len(steps), len(CLASSES))), np.zeros(len(steps))
        np.add.at(acc, pos[m], allt.shares[m])
        np.add.at(cnt, pos[m], 1)
        job.shares = np.where(cnt[:, None] > 0, acc / np.maximum(cnt, 1)[:, None], np.nan)
        m = allt.bound >= 0
        votes = np.zeros((len(steps), len(CLASSES)))
        np.add.at(votes, (pos[m], allt.bound[m]), 1)
        job.bound = np.where(votes.sum(axis=1) > 0, np.argmax(votes, axis=1), -1).astype(np.int8)
        np.maximum.at(job.evidence, pos, allt.evidence)
    return job


def mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(sum(v) / len(v)) if v else None


def mode_bound(codes: np.ndarray) -> str | None:
    codes = codes[codes >= 0]
    if not len(codes):
        return None
    return CLASSES[int(np.argmax(np.bincount(codes, minlength=len(CLASSES))))]


def describe(ev) -> str:
    if ev is None:
        return ""
    if isinstance(ev, dict):
        parts = []
        for k, v in ev.items():
            n = num(v)
            parts.append(f"{k} = {n:.4g}" if n is not None else f"{k} = {v}")
        return ", ".join(parts)
    if isinstance(ev, list):
        return "; ".join(describe(x) for x in ev[:5])
    return str(ev)


def size(b: float | None) -> str:
    """Bytes in binary units a reader takes in at a glance: 512 KiB, 6.05 MiB, 71.20 GiB."""
    if b is None:
        return "n/a"
    a = abs(b)
    if a < 2**10:
        return f"{b:.0f} B"
    unit, div = ("GiB", 2**30) if a >= 2**30 else ("MiB", 2**20) if a >= 2**20 else ("KiB", 2**10)
    return f"{b / div:.2f} {unit}"


