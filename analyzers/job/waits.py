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
"bound by its peer" in the decision tree; `resolve_peer_verdicts` replaces that with the
bound of the rank it waits for, and says so in the path.

A single trace, or collectives that match across no ranks, leave the attribution as it
was: the rank's "wait_split" says why, and its wait share stays unmeasured.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.job.cross_rank import match_collectives
from diag.analyzers.trace.attribution import normalize_shares

NODE = "peer_wait"  # the tree node that hands a waiting step to its peer


def split_waits(analyses: dict[int, list[dict]], tree) -> dict:
    """Split the exposed communication of every rank's analyses into transfer and waiting.

    analyses: rank -> the trace analyses of that rank (rank dicts of the trace analyzer),
    changed in place: step shares, measurements and verdicts, the analysis's own shares,
    measurements, verdict and advisories, plus "wait_split", "waits_for" and "wait_share".
    Returns {"matched": n, "waits_for": {rank: peer}}.
    """
    owner: dict[int, tuple[int, int]] = {}  # id(record) -> (rank, index of its analysis)
    by_rank: dict[int, list[dict]] = {}
    for rank, docs in analyses.items():
        recs = []
        for k, a in enumerate(docs):
            for c in a.get("collectives") or []:
                if isinstance(c, dict):
                    owner[id(c)] = (rank, k)
                    recs.append(c)
        by_rank[rank] = recs
    groups = match_collectives(by_rank)["groups"] if len(by_rank) >= 2 else []
    if not groups:
        reason = ("a single rank: no peer to match collectives with" if len(analyses) < 2
                  else "no collective matched across ranks")
        for docs in analyses.values():
            for a in docs:
                a.update(wait_split={"measured": False, "reason": reason}, waits_for=None, wait_share=None)
        return {"matched": 0, "waits_for": {}}

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

    for rank, docs in analyses.items():
        for k, a in enumerate(docs):
            recs = [c for c in a.get("collectives") or [] if isinstance(c, dict)]
            if recs and not any("exposed" in c for c in recs):
                a["wait_split"] = {"measured": False, "reason": "the analysis predates the wait split; "
                                                                "analyse its trace again"}
                continue
            exposed = _exposed_set(recs)
            h = heads.get((rank, k))
            wait_set = iv.intersect(iv.normalize(np.array(h, dtype=np.float64)), exposed) if h else iv.EMPTY
            _apply(a, wait_set, tree)
            a["wait_split"] = {"measured": True, "matched_collectives": matched.get((rank, k), 0)}
            a["waits_for"] = waits_for.get(rank)
            a["wait_share"] = (a.get("measurements") or {}).get("wait_share")
    return {"matched": len(groups), "waits_for": waits_for}


def _exposed_set(records: list[dict]) -> np.ndarray:
    pairs = [p for c in records for p in c.get("exposed") or []
             if isinstance(p, (list, tuple)) and len(p) == 2]
    return iv.normalize(np.array(pairs, dtype=np.float64)) if pairs else iv.EMPTY


def _apply(a: dict, wait_set: np.ndarray, tree) -> None:
    """Move each step's exposed wait from comm to wait, and walk the tree again."""
    steps = [s for s in a.get("steps") or [] if isinstance(s, dict)]
    timed = [s for s in steps if isinstance(s.get("start_us"), (int, float))
             and isinstance(s.get("duration_ms"), (int, float)) and s["duration_ms"] > 0
             and isinstance(s.get("shares"), dict)]
    if timed:
        win = np.array([[s["start_us"], s["start_us"] + s["duration_ms"] * 1e3] for s in timed], dtype=np.float64)
        wait_us = iv.measure_in_windows(wait_set, win)
    totals = dict.fromkeys(dt.CLASSES, 0.0)
    total = 0.0
    for s, w in zip(timed, wait_us.tolist() if timed else []):
        dur = s["duration_ms"] * 1e3
        us = {c: float(s["shares"].get(c) or 0.0) * dur for c in dt.CLASSES}
        w = min(w, us["comm"])
        us["comm"] -= w
        us["wait"] += w
        s["shares"] = normalize_shares(us, dur)
        m = dict(s.get("measurements") or {})
        m.update(comm_share=s["shares"]["comm"], wait_share=s["shares"]["wait"])
        s["measurements"] = m
        v = dt.evaluate(m, tree)
        s["bound"], s["path"] = v["bound"], v["path"]
        for c in dt.CLASSES:
            totals[c] += us[c]
        total += dur
    if total <= 0:
        return
    shares = normalize_shares(totals, total)
    m = dict(a.get("measurements") or {})
    m.update(comm_share=shares["comm"], wait_share=shares["wait"])
    a["shares"], a["measurements"] = shares, m
    _set_verdict(a, dt.evaluate(m, tree), tree)


def _set_verdict(a: dict, v: dict, tree) -> None:
    a.update(bound=v["bound"], title=v["title"], summary=v["summary"], path=v["path"], fixes=v["fixes"])
    # The tree's advisories depend on the shares (exposed communication): given again.
    rules = {r["id"] for r in tree.advisories}
    kept = [f for f in a.get("findings") or [] if not (isinstance(f, dict) and f.get("id") in rules)]
    # A trace analysis (it has a timeline) tags its advisories; a run analysis's rank does not.
    a["findings"] = kept + dt.advise(a["measurements"], tree, bound=v["bound"],
                                     source="trace" if "timeline" in a else None)


def resolve_peer_verdicts(ranks: list[dict], tree) -> None:
    """A rank (or step) whose tree says "bound by another rank" gets the bound of the rank it
    waits for, followed through chains of waiting ranks; the peer-wait node of its path names
    that rank. Where the waiting goes round in a circle (ranks wait for each other in turn)
    or the peer is unknown, its own work decides: the tree is walked with that node "no"."""
    by_id = {r["rank"]: r for r in ranks if isinstance(r, dict) and isinstance(r.get("rank"), int)}
    own: dict[int, str | None] = {rid: r.get("bound") for rid, r in by_id.items()}
    for rid, r in by_id.items():
        if r.get("bound") != dt.PEER:
            continue
        peer, bound = _follow(rid, by_id, own)
        if bound is not None:
            _name_peer(r.get("path"), peer, bound)
            fixes = list(tree.verdicts[bound]["fixes"])
            r.update(bound=bound, title=f"{tree.verdicts[bound]['title']} (through rank {peer})",
                     summary=f"This rank mostly waits for rank {peer}, whose own work is "
                             f"{tree.verdicts[bound]['title']}: " + tree.verdicts[bound]["summary"],
                     fixes=[f"Speed up rank {peer}, which this rank waits for:"] + fixes, bound_via=peer)
        else:
            _set_verdict(r, _own_work(r.get("measurements") or {}, tree), tree)
        _resolve_steps(r, by_id.get(peer) if peer is not None else None, tree)
    for r in by_id.values():
        if r.get("bound") != dt.PEER:
            _resolve_steps(r, by_id.get(r.get("waits_for")), tree)


def _follow(rid: int, by_id: dict, own: dict) -> tuple[int | None, str | None]:
    seen = {rid}
    peer = by_id[rid].get("waits_for")
    first = peer
    while isinstance(peer, int) and peer in by_id and peer not in seen:
        if own.get(peer) in dt.BOUNDS:
            return first, own[peer]
        seen.add(peer)
        peer = by_id[peer].get("waits_for")
    return first, None


def _own_work(m: dict, tree) -> dict:
    return dt.evaluate(m, tree, force={NODE: ("no", "the ranks wait for each other in turn: "
                                                    "this rank's own work decides")})


def _name_peer(path, peer: int, bound: str) -> None:
    for node in path or []:
        if isinstance(node, dict) and node.get("node") == NODE:
            node["peer"] = peer
            node["peer_bound"] = bound
            node["question"] += f" (it waits for rank {peer}, which is {bound}-bound)"


def _resolve_steps(r: dict, peer: dict | None, tree) -> None:
    """Steps handed to a peer take the peer's verdict at the same step, else the peer's own."""
    peer_steps = {s.get("step"): s.get("bound") for s in (peer or {}).get("steps") or [] if isinstance(s, dict)}
    for s in r.get("steps") or []:
        if not isinstance(s, dict) or s.get("bound") != dt.PEER:
            continue
        b = peer_steps.get(s.get("step"))
        if b not in dt.BOUNDS:
            b = peer.get("bound") if peer else None
        if b in dt.BOUNDS:
            s["bound"] = b
            _name_peer(s.get("path"), r.get("waits_for"), b)
        else:
            m = s.get("measurements") or {f"{c}_share": v for c, v in (s.get("shares") or {}).items()}
            v = _own_work(m, tree)
            s["bound"], s["path"] = v["bound"], v["path"]
