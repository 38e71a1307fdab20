"""Across ranks: match collectives and measure who waits how long in them.

Facts only: which rank is a straggler, and why communication takes its time, are the
diagnosis layer's judgements (diag.analyzers.diagnosis.stragglers) on `CollectiveFacts`.

Every rank's clock is its own, so nothing here compares timestamps of two ranks. A
collective ends at (nearly) the same true moment on every rank, so a rank that arrives
early spends longer inside it: the time a rank waits in a collective is its duration
minus the shortest duration any rank saw for that collective. The rank with the
shortest durations is the one the others wait for. Durations and rank-local
differences of timestamps are immune to clock skew.

Collectives are matched by (process group, sequence number) where every rank records
one, otherwise by order of occurrence within (process group, name), within the
ProfilerStep when the records carry its number (traces of different windows then
still line up), and within the message size for symmetric collectives (all-reduce,
all-gather...), which is the same on every rank of one call. Pure functions: plain
dicts in, plain dicts out.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from diag.analyzers.analysis_types import JobFacts, RankFacts
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import median as _median
from diag.analyzers.whatif.job import job_what_if
from diag.collectors.nccl_sizes import bus_factor
from diag.rundir import rank_number, world_size_number

# A trace's collective names that nccl-tests spells otherwise.
_NCCL_TESTS_NAME = {"all_to_all": "alltoall"}
# Collectives whose message size is the same on every rank of the call.
SYMMETRIC = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier"}



def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _r3(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


# --- matching -----------------------------------------------------------------------


def _source_kind(by_rank: dict[int, list[dict]]) -> str | None:
    """Device records when every rank that has collectives has device ones, else host.

    A device (NCCL) kernel spans the whole collective including the wait; so does the
    host record of a CPU backend (gloo). Mixing the two would compare unlike durations.
    """
    with_any = [recs for recs in by_rank.values() if recs]
    if not with_any:
        return None
    if all(any(c.get("on") == "device" for c in recs) for recs in with_any):
        return "device"
    return "host"


def _matching_keys(recs: dict[int, list[dict]]) -> tuple[dict, bool, dict]:
    """How records are matched: by sequence number, per process group, where every record of
    it has one (seq_ok); by step where every record has one (use_step); and symmetric
    collectives, which move the same bytes on every rank, by size where every record of their
    (group, name) has one (sized)."""
    seq_ok: dict = defaultdict(lambda: True)
    sized: dict = defaultdict(lambda: True)
    for cs in recs.values():
        for c in cs:
            if c.get("seq") is None:
                seq_ok[c.get("pg")] = False
            if c.get("bytes") is None:
                sized[(c.get("pg"), c.get("name"))] = False
    use_step = all(c.get("step") is not None for cs in recs.values() for c in cs)
    return seq_ok, use_step, sized


def _count_mismatch(recs: dict[int, list[dict]], counts: dict) -> list[dict]:
    """The collectives matched by order that the ranks recorded different numbers of."""
    mismatch = []
    ranks_with = [r for r, cs in recs.items() if cs]
    if len(ranks_with) >= 2:
        for base, per_rank in counts.items():
            if base[0] != "order":
                continue
            full = {r: per_rank.get(r, 0) for r in ranks_with}
            if len(set(full.values())) > 1:
                mismatch.append({"pg": base[1], "name": base[2], "bytes": base[3], "counts": full})
    return mismatch


def match_collectives(by_rank: dict[int, list[dict]]) -> dict:
    """Group the collective records of several ranks into matched collectives.

    `by_rank` maps rank -> collective records (trace.analysis.collectives). Returns
    {"source", "matched_by", "groups": [{"key","name","pg","seq","step","dur_us": {rank: us},
    "ts_us": {rank: us}, "bytes"}], "unmatched": int, "count_mismatch": [...]}; groups
    seen on fewer than two ranks are counted as unmatched.
    """
    kind = _source_kind(by_rank)
    recs = {
        r: sorted(
            (c for c in cs if c.get("on", kind) == kind and c.get("dur_us") is not None),
            key=lambda c: float(c.get("ts_us") or 0.0),
        )
        for r, cs in by_rank.items()
    }
    seq_ok, use_step, sized = _matching_keys(recs)
    groups: dict[tuple, dict] = {}
    counts: dict[tuple, dict[int, int]] = defaultdict(dict)
    for r, cs in recs.items():
        seen: Counter = Counter()
        for c in cs:
            pg, name = c.get("pg"), c.get("name")
            if seq_ok[pg]:
                base = ("seq", pg, int(c["seq"]))
            else:
                size = c.get("bytes") if name in SYMMETRIC and sized[(pg, name)] else None
                base = ("order", pg, name, size, c.get("step") if use_step else None)
            key = (*base, seen[base])
            seen[base] += 1
            g = groups.setdefault(
                key,
                {
                    "key": key,
                    "name": name,
                    "pg": pg,
                    "seq": c.get("seq") if seq_ok[pg] else None,
                    "step": c.get("step") if use_step else None,
                    "dur_us": {},
                    "ts_us": {},
                    "bytes": c.get("bytes"),
                },
            )
            g["dur_us"][r] = float(c["dur_us"])
            g["ts_us"][r] = float(c.get("ts_us") or 0.0)
            g.setdefault("records", {})[r] = c  # for the wait split (diag.analyzers.job.waits)
        for base, n in seen.items():
            ck = base[:4]  # per (pg, name, size), over all steps
            counts[ck][r] = counts[ck].get(r, 0) + n

    matched = [g for g in groups.values() if len(g["dur_us"]) >= 2]
    unmatched = sum(1 for g in groups.values() if len(g["dur_us"]) < 2)
    mismatch = _count_mismatch(recs, counts)
    modes = {g["key"][0] for g in matched}
    _order_by_reference_rank(matched)
    return {
        "source": kind,
        "matched_by": ("seq" if modes == {"seq"} else "order" if modes == {"order"} else "mixed" if modes else None),
        "groups": matched,
        "unmatched": unmatched,
        "count_mismatch": mismatch,
    }


def _order_by_reference_rank(groups: list[dict]) -> None:
    """Sort groups in one rank's clock: the rank present in the most groups.

    Timestamps of different ranks are never compared; groups the reference rank lacks
    follow, ordered by the lowest rank they include.
    """
    if not groups:
        return
    ref = Counter(r for g in groups for r in g["ts_us"]).most_common(1)[0][0]

    def key(g):
        if ref in g["ts_us"]:
            return (0, ref, g["ts_us"][ref])
        r = min(g["ts_us"])
        return (1, r, g["ts_us"][r])

    groups.sort(key=key)


# --- per-rank measures ----------------------------------------------------------------


def _rank_steps(rank: RankFacts) -> tuple[list[float], list[float]]:
    """Step durations and non-communication time per step (ms), from the rank's steps."""
    durs, work = [], []
    for s in rank.steps:
        d = s.get("duration_ms")
        if not isinstance(d, (int, float)) or d <= 0:
            continue
        durs.append(float(d))
        sh = dict_at(s, "shares")
        comm, wait = sh.get("comm"), sh.get("wait") or 0.0
        if isinstance(comm, (int, float)) and isinstance(wait, (int, float)):
            work.append(float(d) * (1.0 - float(comm) - float(wait)))
    return durs, work


def _collective_steps(rank: RankFacts) -> int:
    """The steps a rank's collectives were recorded in (at least 1): its traced steps, where a
    run directory holds steps outside the profiler's windows too (their collectives are not in
    any trace), else all its steps."""
    steps = [s for s in rank.steps if isinstance(s, dict)]
    traced = sum(1 for s in steps if s.get("evidence") == "trace")
    return max(1, traced or len(steps))


@dataclass
class RankCollectiveStats:
    """One rank's matched collectives: times in microseconds, measured on its own clock."""
    n: int = 0
    comm_us: float = 0.0  # time inside them
    wait_us: float = 0.0  # of which waiting for the last peer (duration minus the shortest any rank saw)
    waits: list = field(default_factory=list)  # that wait, per collective
    durs: list = field(default_factory=list)  # duration, per collective
    gaps: list = field(default_factory=list)  # from the end of its previous matched collective to this one


@dataclass(frozen=True)
class CollectiveFacts:
    """What the judgement of stragglers and of communication reads (in memory only: the
    diagnosis takes it out of the job block). Facts only: the ranks' verdicts are the
    diagnosis's, which it reads from the ranks themselves."""
    groups: list  # matched collectives; "wait_us" per rank is each rank's wait in it
    per_rank: dict  # rank -> RankCollectiveStats, for ranks with matched collectives
    ranks: list  # every rank present
    step_ms: dict  # rank -> median step time
    work_ms: dict  # rank -> median time outside communication per step
    work_steps: dict  # rank -> that time in each of its steps (ms): the noise its median carries
    n_steps: dict  # rank -> steps counted (at least 1)
    median_step: float | None
    median_work: float | None
    median_gap: float | None  # the ranks' median arrival gap
    transfer_share: float | None  # transfer (the shortest duration) over all time in collectives
    busbw: dict | None
    rank_rows: list  # each rank's waiting, as measured (_rank_rows)
    step_chunks: list  # the matched collectives' indices by step (_step_chunks)


def _rank_rows(ranks: list[int], per_rank: dict, step_ms: dict, work_ms: dict) -> list[dict]:
    """Each rank's waiting, as measured."""
    out = []
    for rid in ranks:
        p = per_rank.get(rid)
        row = {"rank": rid, "step_ms": _r3(step_ms[rid]), "work_ms": _r3(work_ms[rid]), "collectives": p.n if p else 0}
        if p:
            row.update(comm_ms=_ms(p.comm_us), wait_ms=_ms(p.wait_us),
                       wait_fraction=round(p.wait_us / p.comm_us, 4) if p.comm_us > 0 else 0.0,
                       median_wait_ms=_ms(statistics.median(p.waits)),
                       arrival_gap_ms=_ms(statistics.median(p.gaps)) if p.gaps else None)
        out.append(row)
    return out


def _step_chunks(groups: list[dict], n_steps: dict) -> list[list[int]]:
    """Indices of the matched collectives by step: by the records' step numbers where
    present, else in equal runs in order (each step issues the same collectives)."""
    if groups and all(g.get("step") is not None for g in groups):
        by: dict = defaultdict(list)
        for i, g in enumerate(groups):
            by[g["step"]].append(i)
        return [by[k] for k in sorted(by)]
    n = max(1, min(int(statistics.median(n_steps.values())) if n_steps else 1, len(groups)))
    size, extra = divmod(len(groups), n)
    out, i = [], 0
    for k in range(n):
        j = i + size + (1 if k < extra else 0)
        out.append(list(range(i, j)))
        i = j
    return out


def _wait_stats(groups: list[dict]) -> tuple[dict[int, RankCollectiveStats], list[dict], float]:
    """Per rank its waits; the groups with each rank's wait; the job's transfer time."""
    per: dict[int, RankCollectiveStats] = defaultdict(RankCollectiveStats)
    prev_end: dict[int, float] = {}
    transfer_us = 0.0
    out = []
    for g in groups:
        durs = g["dur_us"]
        lo = min(durs.values())
        waits = {r: d - lo for r, d in durs.items()}
        out.append({**g, "wait_us": waits})
        transfer_us += lo * len(durs)
        for r, d in durs.items():
            p = per[r]
            p.n += 1
            p.comm_us += d
            p.durs.append(d)
            p.wait_us += waits[r]
            p.waits.append(waits[r])
            # Rank-local: time from the end of its previous matched collective to this one.
            ts = g["ts_us"][r]
            if r in prev_end and ts >= prev_end[r]:
                p.gaps.append(ts - prev_end[r])
            prev_end[r] = ts + d
    return dict(per), out, transfer_us


# --- the job --------------------------------------------------------------------------


def analyze_job(ranks: Sequence[RankFacts], changes: tuple) -> JobFacts:
    """The facts of the "job" part of the analysis document from the ranks' facts of one job;
    `changes` are the what-if changes to replay (FactSettings.what_if). Which findings these facts make (ranks missing,
    claimed twice or unnamed; collectives counted differently) is the diagnosis's call
    (diagnosis/reporting.py)."""
    # Which ranks do we have?
    by_id: dict[int, RankFacts] = {}
    dups: list[tuple[int, str]] = []
    unknown: list[str | None] = []
    for r in ranks:
        rid = rank_number(r.rank)
        if rid is None:
            unknown.append(r.source)
            continue
        if rid in by_id:
            dups.append((rid, r.source))
            continue
        by_id[rid] = r
    sizes = [s for s in (world_size_number(r.world_size) for r in ranks) if s is not None]
    world = max([*sizes, (max(by_id) + 1) if by_id else 0, len(by_id)]) or None
    present = sorted(by_id)
    missing = [i for i in range(world or 0) if i not in by_id]
    # Collectives and waits.
    match = match_collectives({rid: r.causes.collectives for rid, r in by_id.items()})
    per, groups, transfer_us = _wait_stats(match["groups"])
    steps = {rid: _rank_steps(r) for rid, r in by_id.items()}
    step_ms = {rid: _median(d) for rid, (d, _) in steps.items()}
    work_ms = {rid: _median(w) for rid, (_, w) in steps.items()}
    comm_us = sum(p.comm_us for p in per.values())
    wait_us = sum(p.wait_us for p in per.values())
    transfer_share = transfer_us / comm_us if comm_us > 0 else None
    busbw = achieved_busbw(groups, world)
    n_steps = {rid: _collective_steps(r) for rid, r in by_id.items()}
    facts = CollectiveFacts(
        groups=groups, per_rank=per, ranks=present,
        step_ms=step_ms, work_ms=work_ms, work_steps={rid: w for rid, (_, w) in steps.items()}, n_steps=n_steps,
        median_step=_median(step_ms.values()), median_work=_median(work_ms.values()),
        median_gap=_median(_median(p.gaps) for p in per.values()), transfer_share=transfer_share, busbw=busbw,
        rank_rows=_rank_rows(present, per, step_ms, work_ms), step_chunks=_step_chunks(groups, n_steps),
    )
    critical_path, what_if = job_what_if(ranks, changes)
    return JobFacts(
        world_size=world,
        ranks_present=present,
        critical_path=critical_path,
        what_if=what_if,
        missing_ranks=missing,
        duplicate_ranks=[{"rank": r, "source": src} for r, src in dups],
        unnamed_traces=unknown,
        collectives={
            "source": match["source"],
            "matched_by": match["matched_by"],
            "matched": len(groups),
            "unmatched": match["unmatched"],
            "comm_ms": _ms(comm_us),
            "wait_ms": _ms(wait_us),
            "wait_fraction": round(wait_us / comm_us, 4) if comm_us > 0 else None,
            "transfer_fraction": round(transfer_share, 4) if transfer_share is not None else None,
            "busbw": busbw,
            # Collectives the ranks recorded different numbers of: matching by order may pair
            # different calls.
            "count_mismatch": match["count_mismatch"][:50],
        },
        # The judgement's input (diag.analyzers.diagnosis.stragglers).
        collective_facts=facts,
    )


def achieved_busbw(groups: list[dict], world: int | None) -> dict | None:
    """Median bus bandwidth (nccl-tests' definition) of the matched collectives whose size is
    known, timed by their fastest rank: the transfer, without waiting for a late peer.

    The group size is taken as the world size (records carry no group size).
    """
    bw, sizes = [], []
    for g in groups:
        n = world or len(g["dur_us"])
        fastest = min(g["dur_us"].values())
        if g.get("bytes") and fastest > 0:
            # nccl-tests sizes an all-gather by its output: every rank's input.
            size = g["bytes"] * (max(n, 2) if g["name"] == "all_gather" else 1)
            bw.append(size / (fastest * 1e-6) / 1e9 * bus_factor(_NCCL_TESTS_NAME.get(g["name"], g["name"]), max(n, 2)))
            sizes.append(size)
    if not bw:
        return None
    return {"median_gbps": round(statistics.median(bw), 3), "collectives": len(bw),
            "median_bytes": int(statistics.median(sizes)), "ranks": world or None}
