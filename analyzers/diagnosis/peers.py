"""A rank bound by its peer takes the bound of the rank it waits for.

The tree calls a rank (or a step) that mostly waits in collectives "bound by its peer"
(`decision_tree.PEER`): the fix is on the rank it waits for (the analysis's "waits_for").
`resolve` follows chains of waiting ranks to one whose own work decides, and names that
rank in the peer-wait node of the path. Where the waiting goes round in a circle (ranks
wait for each other in turn) or the peer is unknown, the rank's own work decides: the
tree is walked with that node answered "no".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from diag.analyzers.analysis_types import Rank
from diag.analyzers.diagnosis.decision_tree import BOUNDS, PEER, evaluate
from diag.analyzers.diagnosis.rank import step_measurements, with_verdict

NODE = "peer_wait"  # the tree node that hands a waiting step to its peer
_CIRCLE = "the ranks wait for each other in turn: this rank's own work decides"


def resolve(ranks: Sequence[Rank], tree) -> list[Rank]:
    """The ranks with every peer-bound rank and step resolved (new dicts where they change)."""
    by_id: dict[int, Mapping[str, Any]] = {
        rid: r for r in ranks if isinstance(r, dict) and isinstance(rid := r.get("rank"), int)}
    own = {rid: r.get("bound") for rid, r in by_id.items()}
    now = dict(by_id)  # each rank as resolved so far: a step follows its peer's resolved steps
    for rid, r in by_id.items():
        if r.get("bound") != PEER:
            continue
        peer, bound = _follow(rid, by_id, own)
        r = (_through_peer(r, peer, bound, tree) if bound is not None and peer is not None  # a bound comes with its rank
             else with_verdict(r, own_work(r, tree), tree))
        now[rid] = _resolve_steps(r, now.get(peer) if peer is not None else None, tree)
    for rid, r in by_id.items():
        if r.get("bound") != PEER:
            peer = r.get("waits_for")
            now[rid] = _resolve_steps(r, now.get(peer) if isinstance(peer, int) else None, tree)
    # A resolved rank is its rank with its bound, title, path and steps replaced.
    return [cast(Rank, now[rid]) if isinstance(r, dict) and isinstance(rid := r.get("rank"), int)
            and by_id.get(rid) is r else r for r in ranks]


def _follow(rid: int, by_id: dict, own: dict) -> tuple[int | None, str | None]:
    seen = {rid}
    peer = by_id[rid].get("waits_for")
    first = peer
    while isinstance(peer, int) and peer in by_id and peer not in seen:
        if own.get(peer) in BOUNDS:
            return first, own[peer]
        seen.add(peer)
        peer = by_id[peer].get("waits_for")
    return first, None


def _through_peer(r: Mapping[str, Any], peer: int, bound: str, tree) -> dict:
    v = tree.verdicts[bound]
    return {**r, "bound": bound, "title": f"{v['title']} (through rank {peer})",
            "summary": f"This rank mostly waits for rank {peer}, whose own work is {v['title']}: " + v["summary"],
            "fixes": [f"Speed up rank {peer}, which this rank waits for:"] + list(v["fixes"]), "bound_via": peer,
            "path": _name_peer(r.get("path"), peer, bound)}


def own_work(r: Mapping[str, Any], tree) -> dict:
    """The verdict of a rank's (or step's) own work: its waiting is not handed to a peer."""
    return evaluate(step_measurements(r), tree, force={NODE: ("no", _CIRCLE)})


def _name_peer(path, peer: int, bound: str) -> list:
    out = []
    for node in path or []:
        if isinstance(node, dict) and node.get("node") == NODE:
            node = {**node, "peer": peer, "peer_bound": bound,
                    "question": f"{node['question']} (it waits for rank {peer}, which is {bound}-bound)"}
        out.append(node)
    return out


def _resolve_steps(r: Mapping[str, Any], peer: Mapping[str, Any] | None, tree) -> Mapping[str, Any]:
    """Steps handed to a peer take the peer's verdict at the same step, else the peer's own."""
    steps = r.get("steps") or []
    if not any(isinstance(s, dict) and s.get("bound") == PEER for s in steps):
        return r
    peer_steps = {s.get("step"): s.get("bound") for s in (peer or {}).get("steps") or [] if isinstance(s, dict)}
    out = []
    for s in steps:
        if isinstance(s, dict) and s.get("bound") == PEER:
            b = peer_steps.get(s.get("step"))
            if b not in BOUNDS:
                b = peer.get("bound") if peer else None
            if b in BOUNDS and peer is not None:  # a bound is only taken from a known peer
                s = {**s, "bound": b, "path": _name_peer(s.get("path"), peer["rank"], b)}
            else:
                v = own_work(s, tree)
                s = {**s, "bound": v["bound"], "path": v["path"]}
        out.append(s)
    return {**r, "steps": out}
