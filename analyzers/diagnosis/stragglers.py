"""Who is late at the collectives, and why the job spends the time it does communicating.

The judgement on the cross-rank facts (`diag.analyzers.job.cross_rank.CollectiveFacts`):
which rank arrives last at each matched collective (within `straggler_late_tolerance` of the
spread of waits), how much of all the job's waiting each rank imposes, which ranks are
stragglers by the `straggler_*` rules of the decision tree, and, for a comm-bound job,
whether a straggler, unsynchronised arrival or the collectives themselves explain it.
Every threshold is a name in `decision_tree.toml`. Pure: new values, the facts untouched.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from diag.analyzers.diagnosis.steady import median_half_width
from diag.analyzers.numbers import median as _median


@dataclass
class _Lateness:
    """One rank's lateness over the matched collectives, judged with the tolerance."""
    late: int = 0  # collectives it reached (nearly) last
    imposing: int = 0  # of those, the ones where some peer arrived earlier and waited
    imposed_us: float = 0.0  # the peers' median wait in those, summed


def judge(facts, bounds: dict, tree) -> dict:
    """{"stragglers", "rank_waits", "comm_explanation", "straggler_finding"}: what the job
    block gains from its collective facts; `bounds` are the ranks' own verdicts (rank -> bound),
    which each straggler and row is named with."""
    th = tree.thresholds
    lateness, late_by_group, imposed_by_group = _lateness(facts.groups, th["straggler_late_tolerance"])
    rank_waits = _rank_waits(facts, lateness, bounds)
    stragglers = [{"rank": s["rank"], "bound": bounds.get(s["rank"]), **s}
                  for s in _stragglers(facts, lateness, late_by_group, imposed_by_group, th)]
    return {
        "stragglers": stragglers,
        "rank_waits": rank_waits,
        "comm_explanation": _comm_explanation(facts, stragglers, rank_waits, tree),
        "straggler_finding": _straggler_finding(stragglers) if stragglers else None,
    }


def _lateness(groups: list[dict], tol: float) -> tuple[dict[int, _Lateness], list[set], list[float]]:
    """Per rank its lateness; per group the ranks late in it and the wait they imposed."""
    per: dict[int, _Lateness] = defaultdict(_Lateness)
    late_by_group, imposed_by_group = [], []
    for g in groups:
        waits = g["wait_us"]
        spread = max(waits.values())
        late = {r for r, w in waits.items() if spread <= 0 or w <= tol * spread}
        early = [waits[r] for r in waits if r not in late]
        peer_wait = float(statistics.median(early)) if early else 0.0
        late_by_group.append(late)
        imposed_by_group.append(peer_wait)
        for r in late:
            p = per[r]
            p.late += 1
            if early:
                p.imposed_us += peer_wait
                p.imposing += 1
    return per, late_by_group, imposed_by_group


def _rank_waits(facts, lateness: dict, bounds: dict) -> list[dict]:
    total_imposed = sum(p.imposed_us for p in lateness.values())
    out = []
    for measured in facts.rank_rows:
        rid = measured["rank"]
        row = {"rank": rid, "bound": bounds.get(rid), **{k: v for k, v in measured.items() if k != "rank"}}
        if row["collectives"]:
            p = lateness.get(rid, _Lateness())
            row.update(late_fraction=round(p.late / row["collectives"], 4),
                       blame_share=round(p.imposed_us / total_imposed, 4) if total_imposed > 0 else 0.0,
                       imposed_wait_ms_per_step=_rounded(p.imposed_us / facts.n_steps[rid], 1000.0))
        out.append(row)
    return out


def _stragglers(facts, lateness, late_by_group, imposed_by_group, th) -> list[dict]:
    if facts.per_rank:
        out = _by_collectives(facts, lateness, late_by_group, imposed_by_group, th)
    elif len(facts.ranks) >= 2 and facts.median_work:
        out = _by_step_time(facts, th["straggler_step_excess"])
    else:
        out = []
    out.sort(key=lambda s: -(s["evidence"].get("imposed_wait_ms_per_step") or s["evidence"].get("work_ms") or 0.0))
    return out


def late_by_chance(late: int, steps: int, ranks: int) -> float:
    """The chance that a rank is the late one in `late` or more of `steps` steps when lateness
    is noise: each step's latest rank any of the `ranks`, alike (the binomial tail). Two ranks
    on a shared host trade lateness at random; 2 of 3 steps is a coin's toss, 9 of 9 is not."""
    p = 1.0 / max(ranks, 1)
    return sum(math.comb(steps, k) * p ** k * (1 - p) ** (steps - k) for k in range(late, steps + 1))


def _work_explains(work_ms: float | None, peers_work_ms: float | None, imposed_ms: float, share: float,
                   noise_ms: float = 0.0) -> bool:
    """Whether a rank's time outside communication exceeds its peers' median by `share` of the
    wait it imposes, and by more than `noise_ms`, what the medians' own scatter can make of
    two ranks doing the same work (True where either is unknown: nothing says otherwise)."""
    if work_ms is None or peers_work_ms is None:
        return True
    excess = work_ms - peers_work_ms
    return excess >= share * imposed_ms and excess > noise_ms


def _work_noise(facts, rid) -> float:
    """The 95% half-width of the difference between a rank's median time outside communication
    and its peers': its own median's and the peers' typical one's, combined (0 where its steps
    are too few to tell)."""
    own = median_half_width(facts.work_steps.get(rid) or []) or 0.0
    peers = _median(median_half_width(w) or 0.0 for r, w in facts.work_steps.items() if r != rid) or 0.0
    return math.hypot(own, peers)


def _by_collectives(facts, lateness, late_by_group, imposed_by_group, th) -> list[dict]:
    per = facts.per_rank
    blame_factor, share_min, steps_min = (th["straggler_blame_factor"], th["straggler_wait_share"],
                                          th["straggler_step_fraction"])
    chunks = facts.step_chunks
    total_imposed = sum(p.imposed_us for p in lateness.values())
    n_ranks = len(per)
    wait_per_step = {r: q.wait_us / facts.n_steps[r] / 1000.0 for r, q in per.items()}
    coll_median = {r: statistics.median(q.durs) / 1000.0 for r, q in per.items() if q.durs}
    median_step = facts.median_step
    out = []
    for rid, q in per.items():
        p = lateness.get(rid, _Lateness())
        if not q.n or not p.imposing or total_imposed <= 0:
            continue
        blame = p.imposed_us / total_imposed
        imposed_ms = p.imposed_us / facts.n_steps[rid] / 1000.0
        # What the peers lose, against the step time; without steps, against their comm time.
        if median_step:
            share = imposed_ms / median_step
        else:
            peers = [x.comm_us for r, x in per.items() if r != rid]
            med = statistics.median(peers) if peers else 0.0
            share = p.imposed_us / med if med > 0 else 0.0
        if blame < min(1.0, blame_factor / n_ranks) or share < share_min:
            continue
        # Consistency: late in most steps, not once (a descheduled process, a GC pause).
        late_steps = len(chunks)
        if median_step and len(chunks) >= 2:
            floor_us = share_min * median_step * 1000.0
            late_steps = sum(1 for ch in chunks
                             if sum(imposed_by_group[i] for i in ch if rid in late_by_group[i]) >= floor_us)
            if late_steps <= steps_min * len(chunks):
                continue
            # Few steps: lateness that chance gives as often counts only where the rank's own
            # work outside communication accounts for the wait it imposes.
            peers_work = _median(w for r, w in facts.work_ms.items() if r != rid and w is not None)
            if late_by_chance(late_steps, len(chunks), n_ranks) > th["straggler_chance"] and not _work_explains(
                    facts.work_ms.get(rid), peers_work, imposed_ms, th["straggler_work_explains"],
                    _work_noise(facts, rid)):
                continue
        peers_wait = _median(w for r, w in wait_per_step.items() if r != rid) or 0.0
        own_wait = wait_per_step[rid]
        peers_coll = _median(c for r, c in coll_median.items() if r != rid)
        gap = _median(q.gaps)
        step_ms, work_ms = facts.step_ms.get(rid), facts.work_ms.get(rid)
        ev = {
            "basis": "collectives",
            "blame_share": round(blame, 4),
            "late_steps": late_steps,
            "steps": len(chunks),
            "late_collectives": p.late,
            "matched_collectives": q.n,
            "late_fraction": round(p.late / q.n, 4),
            "peers_median_wait_ms_per_step": round(peers_wait, 3),
            "own_wait_ms_per_step": round(own_wait, 3),
            "imposed_wait_ms_per_step": round(imposed_ms, 3),
            "imposed_wait_share_of_step": round(share, 4),
            "own_median_collective_ms": round(coll_median.get(rid, 0.0), 3),
            "peers_median_collective_ms": round(peers_coll, 3) if peers_coll is not None else None,
            "step_ms": _rounded(step_ms),
            "median_step_ms": _rounded(median_step),
            "work_ms": _rounded(work_ms),
            "median_work_ms": _rounded(facts.median_work),
            "arrival_gap_ms": _rounded(gap, 1000.0),
            "median_arrival_gap_ms": _rounded(facts.median_gap, 1000.0),
        }
        msg = (
            f"Rank {rid} is late: its peers wait a median {peers_wait:.1f} ms per step in collectives "
            f"while it waits {own_wait:.1f} ms; {blame:.0%} of all waiting happens in the "
            f"{p.late} of {q.n} matched collectives it reaches last "
            f"({imposed_ms:.1f} ms per step, {share:.0%} of the step; late in {late_steps} of "
            f"{len(chunks)} steps)"
        )
        if work_ms is not None and facts.median_work:
            msg += (f"; its time outside communication is {work_ms:.1f} ms per step against a median "
                    f"of {facts.median_work:.1f} ms")
        out.append({"rank": rid, "message": msg + ".", "evidence": ev})
    return out


def _by_step_time(facts, excess: float) -> list[dict]:
    """No collectives to compare: time outside communication per step against the median rank's."""
    out = []
    median_work = facts.median_work
    for rid, w in facts.work_ms.items():
        if w is not None and w >= (1.0 + excess) * median_work:
            out.append({
                "rank": rid,
                "message": f"Rank {rid} works {w:.1f} ms per step outside communication against a median "
                f"of {median_work:.1f} ms ({w / median_work - 1:.0%} more); no collectives were recorded "
                "to confirm that its peers wait for it.",
                "evidence": {"basis": "step_time", "work_ms": _rounded(w), "median_work_ms": _rounded(median_work),
                             "step_ms": _rounded(facts.step_ms.get(rid)), "median_step_ms": _rounded(facts.median_step)},
            })
    return out


def _comm_explanation(facts, stragglers, rank_waits, tree) -> dict:
    """Why communication takes its time: used when the job verdict is comm-bound."""
    transfer_share = facts.transfer_share
    if not facts.groups:
        return {"cause": "undetermined", "finding": _finding(
            "comm_cause_undetermined", "info",
            f"Comm-bound, but with {len(facts.ranks)} rank(s) and no collective matched across ranks, "
            "waiting for a late rank cannot be told apart from slow transfers.",
            "Analyse the traces of all ranks (or several) of the same steps together: "
            "`diag analyze rank0.json.gz rank1.json.gz ...` or a directory of them.",
            {"ranks_present": sorted(facts.ranks)[:1000]})}
    if stragglers:
        return {"cause": "straggler", "finding": _straggler_comm_finding(stragglers, rank_waits)}
    if transfer_share is not None and transfer_share < tree.thresholds["network_transfer_share"]:
        return {"cause": "imbalance", "finding": _imbalance_finding(transfer_share, rank_waits)}
    return {"cause": "network", "finding": _slow_collectives_finding(facts, tree)}


def _straggler_advice(stragglers) -> str:
    bounds = sorted({s["bound"] for s in stragglers if s.get("bound")})
    own = f" Its own verdict is {'/'.join(bounds)}-bound: apply those fixes there first." if bounds else ""
    return (
        "Speed up the late rank rather than the network." + own + " Common causes: uneven data sharding or "
        "sequence lengths, extra work on one rank (logging, evaluation, checkpointing on rank 0), a throttled "
        "or slower device (check clocks and temperature), a noisy neighbour on its host."
    )


def _straggler_comm_finding(stragglers, rank_waits) -> dict:
    names = ", ".join(str(s["rank"]) for s in stragglers[:8])
    late = {s["rank"] for s in stragglers}
    waits = [r["wait_fraction"] for r in rank_waits if "wait_fraction" in r and r["rank"] not in late]
    first = stragglers[0]["evidence"]
    return _finding(
        "straggler_induced_comm", "warning",
        f"Comm-bound because rank{'s' if len(stragglers) > 1 else ''} {names} "
        f"{'are' if len(stragglers) > 1 else 'is'} late: the other ranks spend their communication time waiting. "
        + stragglers[0]["message"],
        _straggler_advice(stragglers),
        {"stragglers": [s["rank"] for s in stragglers],
         "peers_median_wait_fraction_of_comm": round(statistics.median(waits), 4) if waits else None,
         **{k: first[k] for k in ("peers_median_wait_ms_per_step", "own_wait_ms_per_step", "blame_share",
                                  "imposed_wait_ms_per_step") if k in first}},
    )


def _straggler_finding(stragglers) -> dict:
    return _finding("straggler", "warning", " ".join(s["message"] for s in stragglers[:3]),
                    _straggler_advice(stragglers), {"stragglers": [s["rank"] for s in stragglers]})


def _imbalance_finding(transfer_share, rank_waits) -> dict:
    late = {r["rank"]: r.get("late_fraction") for r in rank_waits if r.get("late_fraction") is not None}
    return _finding(
        "unsynchronised_arrival", "warning",
        f"Comm-bound, but {1 - transfer_share:.0%} of the communication time is waiting for peers and no single "
        "rank is consistently late: ranks reach the collectives at different times.",
        "Balance the work between ranks (equal batch and sequence lengths, bucketing by length), and look for "
        "host noise (other processes, CPU frequency, DataLoader workers competing with the training process).",
        {"wait_fraction_of_comm": round(1 - transfer_share, 4), "late_fraction_by_rank": late},
    )


def _slow_collectives_finding(facts, tree) -> dict:
    share = facts.transfer_share
    ev: dict = {"transfer_fraction_of_comm": round(share, 4) if share is not None else None}
    if facts.groups:
        ev["median_collective_ms"] = _rounded(statistics.median(min(g["dur_us"].values()) for g in facts.groups),
                                              1000.0)
        ev["matched_collectives"] = len(facts.groups)
        if facts.busbw:
            ev["median_busbw_gbps"] = facts.busbw["median_gbps"]
    fixes = tree.verdicts.get("comm", {}).get("fixes", [])
    return _finding(
        "slow_collectives", "warning",
        "Comm-bound because the collectives themselves are slow: "
        + (f"{share:.0%} of communication time is transfer, not waiting for a late rank" if share is not None
           else "no rank is late")
        + (f"; median bus bandwidth {ev['median_busbw_gbps']:.2f} GB/s" if "median_busbw_gbps" in ev else "")
        + ".",
        " ".join(fixes) + " Measure the fabric with `diag nccl` and compare with the hardware's bus bandwidth.",
        ev,
    )


def _finding(fid, severity, message, advice, evidence) -> dict:
    return {"id": fid, "severity": severity, "message": message, "advice": advice, "evidence": evidence}


def _rounded(x: float | None, per: float = 1.0) -> float | None:
    """x / per to three decimals (microseconds to milliseconds with per=1000)."""
    return round(x / per, 3) if x is not None else None


def straggler_what_if(entries: list | None, tree) -> list:
    """The job's what-if entries, with a straggler change's prediction withdrawn where the
    slowest rank's lag behind the median rank is within the run's own step-to-step noise
    (the interval of its median, `steady`): two ranks trading places are noise, not a
    straggler. New entries; the facts' per-step lags are not carried on."""
    out = []
    for e in entries or []:
        if not isinstance(e, dict) or "pace_lag_ms_by_step" not in e:
            out.append(e)
            continue
        e = dict(e)
        lags = [float(x) for x in e.pop("pace_lag_ms_by_step") or []
                if isinstance(x, (int, float)) and math.isfinite(x)]
        lag = statistics.median(lags) if lags else 0.0
        band = median_half_width(lags, tree.thresholds["noise_interval_z"]) or 0.0
        if lag <= band:
            e.update(predicted_step_ms=None, speedup=None,
                     note=(f"the slowest rank's pace is {lag:.1f} ms behind the median rank's, within the run's "
                           f"own step-to-step noise (±{band:.1f} ms): no straggler to remove, no prediction"))
        out.append(e)
    return out

