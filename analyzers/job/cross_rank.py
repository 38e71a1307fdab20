"""Across ranks: match collectives, measure who waits for whom, name stragglers, explain the time spent communicating.

The job verdict itself is the diagnosis layer's (diag.analyzers.diagnosis.verdict); this
module gives it the facts.

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

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.whatif.job import job_what_if

# Thresholds of the cross-rank rules. A tree may override each by the same name in its
# [thresholds] table; these defaults hold otherwise.
DEFAULTS = {
    # A rank is late in a collective when its wait is within this fraction of the spread
    # (longest minus shortest wait): it arrived (nearly) last.
    "straggler_late_tolerance": 0.10,
    # A straggler's "blame share" is the part of all the job's waiting that happens in
    # collectives it reaches last. Chance level is 1/ranks; a straggler must take at least
    # this factor times its fair share (75% of the waiting with 2 ranks, 50% with 3).
    # Shares rather than counts: a late rank delays the first collective after its slow
    # phase, while the later ones of the step arrive together and split by jitter.
    "straggler_blame_factor": 1.5,
    # ...and the wait it imposes on its peers is at least this fraction of the step:
    # below 10% a late rank costs less than the usual step-to-step jitter of a busy host.
    "straggler_wait_share": 0.10,
    # ...and it is late (by that much) in more than this fraction of the steps: a rank
    # that is late once, because its process was descheduled, is not a straggler.
    "straggler_step_fraction": 0.5,
    # Without matched collectives, a rank whose non-communication time per step exceeds
    # the median rank's by this fraction is named on its step time alone.
    "straggler_step_excess": 0.25,
    # A comm-bound job without stragglers is "slow network" when the transfer itself
    # (the shortest duration of each collective) is at least this share of the
    # communication time, and "unsynchronised arrival" when waiting is the larger part.
    "network_transfer_share": 0.50,
}

# Collectives whose message size is the same on every rank of the call.
SYMMETRIC = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier"}

# Bus bandwidth correction factors of nccl-tests (busbw = algbw * factor).
_BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def _threshold(tree, name: str) -> float:
    table = getattr(tree, "thresholds", None) or {}
    return float(table.get(name, DEFAULTS[name]))


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _r3(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


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


def match_collectives(by_rank: dict[int, list[dict]]) -> dict:
    """Group the collective records of several ranks into matched collectives.

    `by_rank` maps rank -> collective records (contract B). Returns
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
    # Sequence numbers only count for a process group when every record of it has one.
    seq_ok: dict = defaultdict(lambda: True)
    for cs in recs.values():
        for c in cs:
            if c.get("seq") is None:
                seq_ok[c.get("pg")] = False
    use_step = all(c.get("step") is not None for cs in recs.values() for c in cs)
    # Symmetric collectives move the same bytes on every rank, so the size tells apart the
    # calls of one (group, name); used when every such record has a size.
    sized: dict = defaultdict(lambda: True)
    for cs in recs.values():
        for c in cs:
            if c.get("bytes") is None:
                sized[(c.get("pg"), c.get("name"))] = False

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
    mismatch = []
    ranks_with = [r for r, cs in recs.items() if cs]
    if len(ranks_with) >= 2:
        for base, per_rank in counts.items():
            if base[0] != "order":
                continue
            full = {r: per_rank.get(r, 0) for r in ranks_with}
            if len(set(full.values())) > 1:
                mismatch.append({"pg": base[1], "name": base[2], "bytes": base[3], "counts": full})
    modes = {g["key"][0] for g in matched}
    _order_by_reference_rank(matched)
    return {
        "source": kind,
        "matched_by": "seq"
        if modes == {"seq"}
        else "order"
        if modes == {"order"}
        else "mixed"
        if modes
        else None,
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


def _rank_steps(rank: dict) -> tuple[list[float], list[float]]:
    """Step durations and non-communication time per step (ms), from the rank's steps."""
    durs, work = [], []
    for s in rank.get("steps") or []:
        d = s.get("duration_ms")
        if not isinstance(d, (int, float)) or d <= 0:
            continue
        durs.append(float(d))
        sh = s.get("shares") if isinstance(s.get("shares"), dict) else {}
        comm, wait = sh.get("comm"), sh.get("wait") or 0.0
        if isinstance(comm, (int, float)) and isinstance(wait, (int, float)):
            work.append(float(d) * (1.0 - float(comm) - float(wait)))
    return durs, work


def _wait_table(groups: list[dict], tol: float) -> tuple[dict, dict]:
    """Per rank: waits, lateness and the waits it imposed; per group: its wait spread."""
    per = defaultdict(
        lambda: {
            "comm_us": 0.0,
            "wait_us": 0.0,
            "waits": [],
            "late": 0,
            "n": 0,
            "imposed_us": 0.0,
            "imposed": [],
            "gaps": [],
            "durs": [],
        }
    )
    prev_end: dict[int, float] = {}
    transfer_us = 0.0
    for g in groups:
        durs = g["dur_us"]
        lo = min(durs.values())
        waits = {r: d - lo for r, d in durs.items()}
        spread = max(waits.values())
        late = {r for r, w in waits.items() if spread <= 0 or w <= tol * spread}
        early = [waits[r] for r in waits if r not in late]
        peer_wait = float(statistics.median(early)) if early else 0.0
        g["wait_us"] = waits
        g["late_ranks"] = sorted(late)
        g["imposed_us"] = peer_wait if early else 0.0
        transfer_us += lo * len(durs)
        for r, d in durs.items():
            p = per[r]
            p["n"] += 1
            p["comm_us"] += d
            p["durs"].append(d)
            p["wait_us"] += waits[r]
            p["waits"].append(waits[r])
            if r in late and early:
                p["late"] += 1
                p["imposed_us"] += peer_wait
                p["imposed"].append(peer_wait)
            elif r in late and spread <= 0:
                p["late"] += 1
            # Rank-local: time from the end of its previous matched collective to this one.
            ts = g["ts_us"][r]
            if r in prev_end and ts >= prev_end[r]:
                p["gaps"].append(ts - prev_end[r])
            prev_end[r] = ts + d
    return per, {"transfer_us": transfer_us}


# --- the job --------------------------------------------------------------------------


def _ranges(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def _finding(fid, severity, message, advice, evidence) -> dict:
    return {"id": fid, "severity": severity, "message": message, "advice": advice, "evidence": evidence}


def analyze_job(ranks: list[dict], tree=None) -> dict:
    """The "job" part of the analysis document from the rank dicts of one job."""
    if tree is None:
        tree = load_tree()
    findings: list[dict] = []

    # Which ranks do we have?
    by_id: dict[int, dict] = {}
    dups, unknown = [], []
    for r in ranks:
        rid = r.get("rank")
        if not isinstance(rid, int):
            unknown.append(r.get("source"))
            continue
        if rid in by_id:
            dups.append((rid, r.get("source")))
            continue
        by_id[rid] = r
    sizes = [
        r.get("world_size") for r in ranks if isinstance(r.get("world_size"), int) and r["world_size"] > 0
    ]
    world = max([*sizes, (max(by_id) + 1) if by_id else 0, len(by_id)]) or None
    present = sorted(by_id)
    missing = [i for i in range(world or 0) if i not in by_id]
    if missing:
        findings.append(
            _finding(
                "missing_ranks",
                "warning",
                f"{len(missing)} of {world} ranks have no analysed trace (ranks {_ranges(missing)}); "
                "the job verdict rests on the other ranks.",
                "Profile every rank (or pass every rank's trace) so stragglers among the missing ranks are not overlooked.",
                {"world_size": world, "present": len(present), "missing": missing[:1000]},
            )
        )
    if dups:
        findings.append(
            _finding(
                "duplicate_ranks",
                "warning",
                "Several traces claim the same rank: "
                + ", ".join(f"rank {r} ({s})" for r, s in dups)
                + "; only the first is used.",
                "Pass one trace per rank, from the same profiling window.",
                {"duplicates": [{"rank": r, "source": s} for r, s in dups]},
            )
        )
    if unknown:
        findings.append(
            _finding(
                "unknown_rank",
                "warning",
                f"{len(unknown)} trace(s) name no rank and are left out of the cross-rank comparison.",
                "Name trace files with their rank (e.g. rank-3.json.gz) or profile with distributed info enabled.",
                {"sources": unknown},
            )
        )

    # Collectives and waits.
    match = match_collectives({rid: r.get("collectives") or [] for rid, r in by_id.items()})
    groups = match["groups"]
    per, totals = _wait_table(groups, _threshold(tree, "straggler_late_tolerance"))
    steps = {rid: _rank_steps(r) for rid, r in by_id.items()}
    step_ms = {rid: _median(d) for rid, (d, _) in steps.items()}
    work_ms = {rid: _median(w) for rid, (_, w) in steps.items()}
    n_steps = {rid: max(1, len(d)) for rid, (d, _) in steps.items()}
    median_step = _median(step_ms.values())
    median_work = _median(work_ms.values())
    median_gap = _median(_median(p["gaps"]) for p in per.values())

    total_imposed = sum(p["imposed_us"] for p in per.values())
    rank_waits = []
    for rid in present:
        p = per.get(rid)
        row = {
            "rank": rid,
            "bound": by_id[rid].get("bound"),
            "step_ms": _r3(step_ms[rid]),
            "work_ms": _r3(work_ms[rid]),
            "collectives": p["n"] if p else 0,
        }
        if p:
            row.update(
                comm_ms=_ms(p["comm_us"]),
                wait_ms=_ms(p["wait_us"]),
                wait_fraction=round(p["wait_us"] / p["comm_us"], 4) if p["comm_us"] > 0 else 0.0,
                median_wait_ms=_ms(statistics.median(p["waits"])),
                late_fraction=round(p["late"] / p["n"], 4),
                blame_share=round(p["imposed_us"] / total_imposed, 4) if total_imposed > 0 else 0.0,
                imposed_wait_ms_per_step=_ms(p["imposed_us"] / n_steps[rid]),
                arrival_gap_ms=_ms(statistics.median(p["gaps"])) if p["gaps"] else None,
            )
        rank_waits.append(row)

    stragglers = _stragglers(
        tree, by_id, per, groups, n_steps, median_step, step_ms, work_ms, median_work, median_gap
    )

    # Why communication takes the time it does. The job verdict (diag.analyzers.diagnosis)
    # decides whether the job is comm-bound; these explain it when it is.
    comm_us = sum(p["comm_us"] for p in per.values())
    wait_us = sum(p["wait_us"] for p in per.values())
    transfer_share = totals["transfer_us"] / comm_us if comm_us > 0 else None
    if not groups:
        cause = "undetermined"
        cause_finding = _finding(
            "comm_cause_undetermined",
            "info",
            f"Comm-bound, but with {len(present)} rank(s) and no collective matched across ranks, "
            "waiting for a late rank cannot be told apart from slow transfers.",
            "Analyse the traces of all ranks (or several) of the same steps together: "
            "`diag analyze rank0.json.gz rank1.json.gz ...` or a directory of them.",
            {"ranks_present": present[:1000]},
        )
    elif stragglers:
        cause, cause_finding = "straggler", _straggler_comm_finding(stragglers, rank_waits)
    elif transfer_share is not None and transfer_share < _threshold(tree, "network_transfer_share"):
        cause, cause_finding = "imbalance", _imbalance_finding(transfer_share, rank_waits)
    else:
        cause, cause_finding = "network", _slow_collectives_finding(groups, transfer_share, world, tree)
    if match["count_mismatch"]:
        findings.append(
            _finding(
                "collective_count_mismatch",
                "info",
                "Ranks recorded different numbers of some collectives ("
                + "; ".join(
                    f"{m['name']}"
                    + (f" of {m['bytes']} bytes" if m.get("bytes") else "")
                    + (f" on group {m['pg']}" if m["pg"] is not None else "")
                    + ": "
                    + ", ".join(f"rank {r}: {n}" for r, n in m["counts"].items())
                    for m in match["count_mismatch"][:5]
                )
                + "), so matching by order may pair different calls.",
                "Profile the same steps on every rank; a rank with fewer calls may have hung or diverged.",
                {"mismatch": match["count_mismatch"][:50]},
            )
        )

    critical_path, what_if = job_what_if(ranks, getattr(tree, "what_if", ()))
    return {
        "world_size": world,
        "ranks_present": present,
        "critical_path": critical_path,
        "what_if": what_if,
        "missing_ranks": missing,
        "stragglers": stragglers,
        "findings": findings,
        # Candidates for the diagnosis: the first when the job is comm-bound, the second otherwise.
        "comm_explanation": {"cause": cause, "finding": cause_finding},
        "straggler_finding": _straggler_finding(stragglers) if stragglers else None,
        "collectives": {
            "source": match["source"],
            "matched_by": match["matched_by"],
            "matched": len(groups),
            "unmatched": match["unmatched"],
            "comm_ms": _ms(comm_us),
            "wait_ms": _ms(wait_us),
            "wait_fraction": round(wait_us / comm_us, 4) if comm_us > 0 else None,
            "transfer_fraction": round(transfer_share, 4) if transfer_share is not None else None,
            "busbw": achieved_busbw(groups, world),
        },
        "rank_waits": rank_waits,
    }


def _step_chunks(groups: list[dict], n_steps: int) -> list[list[dict]]:
    """The matched collectives split by step: by the records' step numbers where present,
    else into `n_steps` equal runs in order (each step issues the same collectives)."""
    if groups and all(g.get("step") is not None for g in groups):
        by: dict = defaultdict(list)
        for g in groups:
            by[g["step"]].append(g)
        return [by[k] for k in sorted(by)]
    n = max(1, min(n_steps, len(groups)))
    size, extra = divmod(len(groups), n)
    out, i = [], 0
    for k in range(n):
        j = i + size + (1 if k < extra else 0)
        out.append(groups[i:j])
        i = j
    return out


def _late_steps(chunks: list[list[dict]], rank: int, threshold_us: float) -> int:
    """Steps in which the peers' wait imposed by `rank` reaches threshold_us."""
    return sum(
        1 for ch in chunks if sum(g["imposed_us"] for g in ch if rank in g["late_ranks"]) >= threshold_us
    )


def _stragglers(
    tree, by_id, per, groups, n_steps, median_step, step_ms, work_ms, median_work, median_gap
) -> list[dict]:
    blame_factor = _threshold(tree, "straggler_blame_factor")
    share_min = _threshold(tree, "straggler_wait_share")
    steps_min = _threshold(tree, "straggler_step_fraction")
    out = []
    if per:
        chunks = _step_chunks(groups, int(statistics.median(n_steps.values())) if n_steps else 1)
        total_imposed = sum(p["imposed_us"] for p in per.values())
        n_ranks = len(per)
        wait_per_step = {r: q["wait_us"] / n_steps[r] / 1000.0 for r, q in per.items()}
        coll_median = {r: statistics.median(q["durs"]) / 1000.0 for r, q in per.items() if q["durs"]}
        for rid, p in per.items():
            if not p["n"] or not p["imposed"] or total_imposed <= 0:
                continue
            blame = p["imposed_us"] / total_imposed
            imposed_ms = p["imposed_us"] / n_steps[rid] / 1000.0
            # What the peers lose, against the step time; without steps, against their comm time.
            if median_step:
                share = imposed_ms / median_step
            else:
                peers = [q["comm_us"] for r, q in per.items() if r != rid]
                med = statistics.median(peers) if peers else 0.0
                share = p["imposed_us"] / med if med > 0 else 0.0
            if blame < min(1.0, blame_factor / n_ranks) or share < share_min:
                continue
            # Consistency: late in most steps, not once (a descheduled process, a GC pause).
            late_steps = len(chunks)
            if median_step and len(chunks) >= 2:
                late_steps = _late_steps(chunks, rid, share_min * median_step * 1000.0)
                if late_steps <= steps_min * len(chunks):
                    continue
            peers_wait = _median(w for r, w in wait_per_step.items() if r != rid) or 0.0
            own_wait = wait_per_step[rid]
            peers_coll = _median(c for r, c in coll_median.items() if r != rid)
            gap = _median(p["gaps"])
            ev = {
                "basis": "collectives",
                "blame_share": round(blame, 4),
                "late_steps": late_steps,
                "steps": len(chunks),
                "late_collectives": p["late"],
                "matched_collectives": p["n"],
                "late_fraction": round(p["late"] / p["n"], 4),
                "peers_median_wait_ms_per_step": round(peers_wait, 3),
                "own_wait_ms_per_step": round(own_wait, 3),
                "imposed_wait_ms_per_step": round(imposed_ms, 3),
                "imposed_wait_share_of_step": round(share, 4),
                "own_median_collective_ms": round(coll_median.get(rid, 0.0), 3),
                "peers_median_collective_ms": round(peers_coll, 3) if peers_coll is not None else None,
                "step_ms": _r3(step_ms.get(rid)),
                "median_step_ms": _r3(median_step),
                "work_ms": _r3(work_ms.get(rid)),
                "median_work_ms": _r3(median_work),
                "arrival_gap_ms": _ms(gap) if gap is not None else None,
                "median_arrival_gap_ms": _ms(median_gap) if median_gap is not None else None,
            }
            msg = (
                f"Rank {rid} is late: its peers wait a median {peers_wait:.1f} ms per step in collectives "
                f"while it waits {own_wait:.1f} ms; {blame:.0%} of all waiting happens in the "
                f"{p['late']} of {p['n']} matched collectives it reaches last "
                f"({imposed_ms:.1f} ms per step, {share:.0%} of the step; late in {late_steps} of "
                f"{len(chunks)} steps)"
            )
            if work_ms.get(rid) is not None and median_work:
                msg += (
                    f"; its time outside communication is {work_ms[rid]:.1f} ms per step against a median "
                    f"of {median_work:.1f} ms"
                )
            out.append({"rank": rid, "bound": by_id[rid].get("bound"), "message": msg + ".", "evidence": ev})
    elif len(by_id) >= 2 and median_work:
        # No collectives to compare: fall back on time outside communication per step.
        excess = _threshold(tree, "straggler_step_excess")
        for rid, w in work_ms.items():
            if w is not None and w >= (1.0 + excess) * median_work:
                out.append(
                    {
                        "rank": rid,
                        "bound": by_id[rid].get("bound"),
                        "message": f"Rank {rid} works {w:.1f} ms per step outside communication against a median "
                        f"of {median_work:.1f} ms ({w / median_work - 1:.0%} more); no collectives were recorded "
                        "to confirm that its peers wait for it.",
                        "evidence": {
                            "basis": "step_time",
                            "work_ms": _r3(w),
                            "median_work_ms": _r3(median_work),
                            "step_ms": _r3(step_ms.get(rid)),
                            "median_step_ms": _r3(median_step),
                        },
                    }
                )
    out.sort(
        key=lambda s: -(s["evidence"].get("imposed_wait_ms_per_step") or s["evidence"].get("work_ms") or 0.0)
    )
    return out


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
    waits = [
        r["wait_fraction"]
        for r in rank_waits
        if "wait_fraction" in r and r["rank"] not in {s["rank"] for s in stragglers}
    ]
    return _finding(
        "straggler_induced_comm",
        "warning",
        f"Comm-bound because rank{'s' if len(stragglers) > 1 else ''} {names} "
        f"{'are' if len(stragglers) > 1 else 'is'} late: the other ranks spend their communication time waiting. "
        + stragglers[0]["message"],
        _straggler_advice(stragglers),
        {
            "stragglers": [s["rank"] for s in stragglers],
            "peers_median_wait_fraction_of_comm": round(statistics.median(waits), 4) if waits else None,
            **{
                k: stragglers[0]["evidence"][k]
                for k in (
                    "peers_median_wait_ms_per_step",
                    "own_wait_ms_per_step",
                    "blame_share",
                    "imposed_wait_ms_per_step",
                )
                if k in stragglers[0]["evidence"]
            },
        },
    )


def _straggler_finding(stragglers) -> dict:
    return _finding(
        "straggler",
        "warning",
        " ".join(s["message"] for s in stragglers[:3]),
        _straggler_advice(stragglers),
        {"stragglers": [s["rank"] for s in stragglers]},
    )


def _imbalance_finding(transfer_share, rank_waits) -> dict:
    late = {r["rank"]: r.get("late_fraction") for r in rank_waits if r.get("late_fraction") is not None}
    return _finding(
        "unsynchronised_arrival",
        "warning",
        f"Comm-bound, but {1 - transfer_share:.0%} of the communication time is waiting for peers and no single "
        "rank is consistently late: ranks reach the collectives at different times.",
        "Balance the work between ranks (equal batch and sequence lengths, bucketing by length), and look for "
        "host noise (other processes, CPU frequency, DataLoader workers competing with the training process).",
        {"wait_fraction_of_comm": round(1 - transfer_share, 4), "late_fraction_by_rank": late},
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
            bw.append(size / (fastest * 1e-6) / 1e9 * _BUSBW_FACTOR.get(g["name"], lambda _n: 1.0)(max(n, 2)))
            sizes.append(size)
    if not bw:
        return None
    return {"median_gbps": round(statistics.median(bw), 3), "collectives": len(bw),
            "median_bytes": int(statistics.median(sizes)), "ranks": world or None}


def _slow_collectives_finding(groups, transfer_share, world, tree) -> dict:
    ev: dict = {"transfer_fraction_of_comm": round(transfer_share, 4) if transfer_share is not None else None}
    if groups:
        mins = [min(g["dur_us"].values()) for g in groups]
        ev["median_collective_ms"] = _ms(statistics.median(mins))
        ev["matched_collectives"] = len(groups)
        bw = achieved_busbw(groups, world)
        if bw:
            ev["median_busbw_gbps"] = bw["median_gbps"]
    fixes = tree.verdicts.get("comm", {}).get("fixes", []) if hasattr(tree, "verdicts") else []
    share = ev["transfer_fraction_of_comm"]
    return _finding(
        "slow_collectives",
        "warning",
        "Comm-bound because the collectives themselves are slow: "
        + (
            f"{share:.0%} of communication time is transfer, not waiting for a late rank"
            if share is not None
            else "no rank is late"
        )
        + (f"; median bus bandwidth {ev['median_busbw_gbps']:.2f} GB/s" if "median_busbw_gbps" in ev else "")
        + ".",
        " ".join(fixes)
        + " Measure the fabric with `diag nccl` and compare with the hardware's bus bandwidth.",
        ev,
    )




