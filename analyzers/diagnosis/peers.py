"""A rank bound by its peer takes the bound of the rank it waits for.

The tree calls a rank (or a step) that mostly waits in collectives "bound by its peer"
(`decision_tree.PEER`): the fix is on the rank it waits for (the analysis's "waits_for").
`resolve` follows chains of waiting ranks to one whose own work decides, and names that
rank in the peer-wait node of the path. Where the waiting goes round in a circle (ranks
wait for each other in turn) or the peer is unknown, the rank's own work decides: the
tree is walked with that node answered "no".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import msgspec

from diag.analyzers.analysis_types import JudgedRank
from diag.analyzers.diagnosis.decision_tree import BOUNDS, PEER, evaluate
from diag.analyzers.diagnosis.rank import step_measurements, with_verdict

NODE = "peer_wait"  # the tree node that hands a waiting step to its peer
_CIRCLE = "the ranks wait for each other in turn: this rank's own work decides"


def resolve(ranks: Sequence[JudgedRank], tree) -> list[JudgedRank]:
    """The ranks with every peer-bound rank and step resolved (new values where they change)."""
    by_id = {r.rank: r for r in ranks if isinstance(r.rank, int)}  # of two with one number, the later
    own = {rid: r.verdict.bound for rid, r in by_id.items()}
    now = dict(by_id)  # each rank as resolved so far: a step follows its peer's resolved steps
    for rid, r in by_id.items():
        if r.verdict.bound != PEER:
            continue
        peer, bound = _follow(rid, by_id, own)
        r = (_through_peer(r, peer, bound, tree) if bound is not None and peer is not None  # a bound comes with its rank
             else with_verdict(r, own_work(r, tree), tree))
        now[rid] = _resolve_steps(r, now.get(peer) if peer is not None else None, tree)
    for rid, r in by_id.items():
        if r.verdict.bound != PEER:
            peer = _waits_for(r)
            now[rid] = _resolve_steps(r, now.get(peer) if peer is not None else None, tree)
    # A resolved rank is its rank with its bound, title, path and steps replaced.
    return [now[r.rank] if isinstance(r.rank, int) and by_id.get(r.rank) is r else r for r in ranks]


def _follow(rid: int, by_id: dict[int, JudgedRank], own: dict) -> tuple[int | None, str | None]:
    seen = {rid}
    peer = _waits_for(by_id[rid])
    first = peer
    while isinstance(peer, int) and peer in by_id and peer not in seen:
        if own.get(peer) in BOUNDS:
            return first, own[peer]
        seen.add(peer)
        peer = _waits_for(by_id[peer])
    return first, None


def _waits_for(r: JudgedRank) -> int | None:
    peer = r.facts.waits_for
    return peer if isinstance(peer, int) else None


def _through_peer(r: JudgedRank, peer: int, bound: str, tree) -> JudgedRank:
    v = tree.verdicts[bound]
    verdict = msgspec.structs.replace(
        r.verdict, bound=bound, title=f"{v['title']} (through rank {peer})",
        summary=f"This rank mostly waits for rank {peer}, whose own work is {v['title']}: " + v["summary"],
        fixes=[f"Speed up rank {peer}, which this rank waits for:"] + list(v["fixes"]), bound_via=peer,
        path=_name_peer(r.verdict.path, peer, bound))
    return msgspec.structs.replace(r, verdict=verdict)


def own_work(r: JudgedRank, tree) -> dict:
    """The verdict of a rank's own work: its waiting is not handed to a peer."""
    return _own_work(r.facts.measurements, tree)


def _own_work(measurements: dict, tree) -> dict:
    return evaluate(measurements, tree, force={NODE: ("no", _CIRCLE)})


def _name_peer(path, peer: int, bound: str) -> list:
    out = []
    for node in path or []:
        if isinstance(node, dict) and node.get("node") == NODE:
            node = {**node, "peer": peer, "peer_bound": bound,
                    "question": f"{node['question']} (it waits for rank {peer}, which is {bound}-bound)"}
        out.append(node)
    return out


def _resolve_steps(r: JudgedRank, peer: JudgedRank | None, tree) -> JudgedRank:
    """Steps handed to a peer take the peer's verdict at the same step, else the peer's own."""
    verdicts = r.verdict.steps
    if not any(v.get("bound") == PEER for v in verdicts):
        return r
    peer_steps = ({s.get("step"): v.get("bound") for s, v in zip(peer.facts.steps, peer.verdict.steps)}
                  if peer is not None else {})
    out = []
    for s, v in zip(r.facts.steps, verdicts):
        if v.get("bound") == PEER:
            b = peer_steps.get(s.get("step"))
            if b not in BOUNDS:
                b = peer.verdict.bound if peer else None
            if b in BOUNDS and peer is not None:  # a bound is only taken from a known peer
                v = {**v, "bound": b, "path": _name_peer(v.get("path"), cast(int, peer.rank), b)}
            else:
                own = _own_work(step_measurements(s), tree)
                v = {**v, "bound": own["bound"], "path": own["path"]}
        out.append(v)
    return msgspec.structs.replace(r, verdict=msgspec.structs.replace(r.verdict, steps=out))
