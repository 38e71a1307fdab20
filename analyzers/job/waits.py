"""Waiting is not communication: the sixth class of a step's time, from matched collectives.

A collective ends at (nearly) the same moment on every rank, so a rank that arrives early
spends the start of it waiting for the last peer; the part all ranks spend together is
the transfer, whose length is the shortest duration any rank saw (cross_rank's rule).
For each rank and matched collective the wait is therefore the head of its span,
`dur - min(dur)` long. Only the exposed part of that head costs step time: the trace
analysis records where each collective is exposed communication (its "exposed"
intervals), so the wait of a step is

    measure(union of wait heads  intersected with  exposed communication, in the step)

taken out of the step's comm share into its wait share. The shares still sum to 1, and
comm now means exposed transfer. A rank that waits for its peers for long enough is
"bound by its peer" in the decision tree; the diagnosis (`diagnosis.peers`) replaces that
with the bound of the rank it waits for, and says so in the path.

A single trace, or collectives that match across no ranks, leave the attribution as it
was: the rank's "wait_split" says why, and its wait share stays unmeasured.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.analysis_types import TraceRankFacts
from diag.analyzers.job.cross_rank import match_collectives
from diag.analyzers.model import CLASSES
from diag.analyzers.trace.attribution import normalize_shares


def split_waits(analyses: dict[int, list[TraceRankFacts]]
                ) -> tuple[dict[int, list[TraceRankFacts]], dict]:
    """Split the exposed communication of every rank's analyses into transfer and waiting.

    analyses: rank -> the trace analyses of that rank (the trace analyzer's facts).
    Returns (the same analyses as new values, with the steps' and the analysis's shares and
    measurements split, and `wait_split`, `waits_for` and `wait_share` set;
    {"matched": n, "waits_for": {rank: peer}}). The verdicts are the diagnosis's, on the
    split shares.
    """
    owner: dict[int, tuple[int, int]] = {}  # id(record) -> (rank, index of its analysis)
    by_rank: dict[int, list[dict]] = {}
    for rank, docs in analyses.items():
        recs = []
        for k, a in enumerate(docs):
            for c in a.causes.collectives:
                if isinstance(c, dict):
                    owner[id(c)] = (rank, k)
                    recs.append(c)
        by_rank[rank] = recs
    groups = match_collectives(by_rank)["groups"] if len(by_rank) >= 2 else []
    if not groups:
        reason = ("a single rank: no peer to match collectives with" if len(analyses) < 2
                  else "no collective matched across ranks")
        unsplit = {"measured": False, "reason": reason}
        return ({rank: [msgspec.structs.replace(a, wait_split=unsplit, waits_for=None, wait_share=None) for a in docs]
                 for rank, docs in analyses.items()}, {"matched": 0, "waits_for": {}})

    heads: dict[tuple[int, int], list] = defaultdict(list)
    waited: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    matched: dict[tuple[int, int], int] = defaultdict(int)
    for g in groups:
        durs = g["dur_us"]
        lo = min(durs.values())
        last = min(durs, key=lambda r: (durs[r], r))  # the rank the others wait for
        for r, d in durs.items():
            rec = g["records"][r]
            key = owner[id(rec)]
            matched[key] += 1
            w = d - lo
            if w > 0:
                heads[key].append((g["ts_us"][r], g["ts_us"][r] + w))
                waited[r][last] += w
    waits_for = {r: max(peers, key=lambda p: (peers[p], -p)) for r, peers in waited.items() if peers}

    out: dict[int, list[TraceRankFacts]] = {}
    for rank, docs in analyses.items():
        out[rank] = []
        for k, a in enumerate(docs):
            recs = [c for c in a.causes.collectives if isinstance(c, dict)]
            if recs and not any("exposed" in c for c in recs):
                out[rank].append(msgspec.structs.replace(a, wait_split={
                    "measured": False, "reason": "the analysis predates the wait split; analyse its trace again"}))
                continue
            h = heads.get((rank, k))
            wait_set = iv.intersect(iv.normalize(np.array(h, dtype=np.float64)), _exposed_set(recs)) if h else iv.EMPTY
            split = _split(a, wait_set)
            out[rank].append(msgspec.structs.replace(
                split, wait_split={"measured": True, "matched_collectives": matched.get((rank, k), 0)},
                waits_for=waits_for.get(rank),
                wait_share=split.measurements.get("wait_share")))
    return out, {"matched": len(groups), "waits_for": waits_for}


def _exposed_set(records: list[dict]) -> np.ndarray:
    pairs = [p for c in records for p in c.get("exposed") or []
             if isinstance(p, (list, tuple)) and len(p) == 2]
    return iv.normalize(np.array(pairs, dtype=np.float64)) if pairs else iv.EMPTY


def _split(a: TraceRankFacts, wait_set: np.ndarray) -> TraceRankFacts:
    """The analysis with each step's exposed wait moved from comm to wait, and the rank's sum."""
    steps = list(a.steps)
    timed = [i for i, s in enumerate(steps) if isinstance(s, dict) and isinstance(s.get("start_us"), (int, float))
             and isinstance(s.get("duration_ms"), (int, float)) and s["duration_ms"] > 0
             and isinstance(s.get("shares"), dict)]
    if not timed:
        return a
    win = np.array([[steps[i]["start_us"], steps[i]["start_us"] + steps[i]["duration_ms"] * 1e3] for i in timed],
                   dtype=np.float64)
    wait_us = iv.measure_in_windows(wait_set, win).tolist()
    totals = dict.fromkeys(CLASSES, 0.0)
    total = 0.0
    for i, w in zip(timed, wait_us):
        s = steps[i]
        dur = s["duration_ms"] * 1e3
        us = {c: float(s["shares"].get(c) or 0.0) * dur for c in CLASSES}
        w = min(w, us["comm"])
        us["comm"] -= w
        us["wait"] += w
        shares = normalize_shares(us, dur)
        steps[i] = {**s, "shares": shares, "measurements": {**(s.get("measurements") or {}),
                                                            "comm_share": shares["comm"],
                                                            "wait_share": shares["wait"]}}
        for c in CLASSES:
            totals[c] += us[c]
        total += dur
    if total <= 0:
        return msgspec.structs.replace(a, steps=steps)
    shares = normalize_shares(totals, total)
    return msgspec.structs.replace(a, steps=steps, shares=shares, measurements={
        **a.measurements, "comm_share": shares["comm"], "wait_share": shares["wait"]})
