"""The NCCL INFO lines of what runs: COLL lines per collective call, per-call TUNING choices
and the tuning model's table, and the transport of each channel between two peers; each a
function over the parser's state (log_state.LogState).
"""

from __future__ import annotations

from diag.analyzers.nccl.log_grammar import (
    _COLL_REST,
    _TUNE,
    _TUNE_KEY,
    _VIA,
    ALGOS,
    DATATYPES,
    MAX_CACHE,
    MAX_COMMS,
    MAX_PEERS,
    PROTOS,
    REDOPS,
    _transport_kind,
)
from diag.analyzers.nccl.log_state import LogState


def transport(p: LogState, line: str, pfx: tuple, msg: str) -> None:
    m = _VIA.match(msg)
    if not m:
        return
    ch, _conn, src, _sb, dst, _db, direction, via = m.groups()
    sig = add_transport(p, ch, src, dst, direction, via, 1)
    if sig is not None:
        p.signal(sig, line)


def add_transport(p: LogState, ch: str, src: str, dst: str, direction, via: str, n: int):
    """Count n connections of one (channel, peer pair, transport); the finding signal name."""
    kind, label, gdrdma, pxn, sig = _transport_kind(via)
    by_kind = p.by_kind
    by_kind[label] = by_kind.get(label, 0) + n
    key = (src, dst, via)
    peer = p.peers.get(key)
    if peer is None:
        if len(p.peers) >= MAX_PEERS:
            p.peers_dropped += 1
        else:
            peer = p.peers[key] = {"from": int(src), "to": int(dst), "via": via, "kind": kind,
                                   "gdrdma": gdrdma, "pxn": pxn, "channels": set(), "direction": direction}
    if peer is not None and len(peer["channels"]) < 256:
        peer["channels"].add(ch)
    if pxn:
        p.pxn += n
    return sig


def coll(p: LogState, line: str, msg: str) -> None:
    i = msg.find(": opCount ")
    m = _COLL_REST.match(msg, i + 2) if i > 0 else None
    if not m:
        return
    op = msg[:i].rsplit(None, 1)[-1]  # the word before ": opCount" (no leading \w+ to backtrack on)
    # Count raw field tuples (cheap: no conversions per line); _flush_colls aggregates.
    opc, count, dt, red, root, comm, nranks = m.groups()
    key = (op, count, dt, red, nranks)
    raw = p.coll_raw
    raw[key] = raw.get(key, 0) + 1
    ck = (op, comm)
    if ck not in p.coll_comms and len(p.coll_comms) < MAX_COMMS:
        p.coll_comms.add(ck)
    p.opc_last[comm] = opc  # opCount grows per communicator: the last is the largest
    if len(raw) >= MAX_CACHE:
        flush_colls(p)


def flush_colls(p: LogState) -> None:
    for (op, count, dt, red, nranks), calls in p.coll_raw.items():
        count = int(count)
        dt = int(dt)
        dname, dsize = DATATYPES.get(dt, (f"type{dt}", 0))
        a = p.colls.get(op)
        if a is None:
            a = p.colls[op] = {"op": op, "calls": 0, "elements": 0, "bytes": 0, "dtypes": {},
                                  "redops": {}, "nranks": [], "comms": set(), "max_count": 0}
        a["calls"] += calls
        a["elements"] += count * calls
        a["bytes"] += count * dsize * calls
        a["dtypes"][dname] = a["dtypes"].get(dname, 0) + calls
        if op not in ("Send", "Recv", "Broadcast", "AllGather"):
            rname = REDOPS.get(int(red), f"op{red}")
            a["redops"][rname] = a["redops"].get(rname, 0) + calls
        n = int(nranks)
        if n not in a["nranks"] and len(a["nranks"]) < 64:
            a["nranks"].append(n)
        a["max_count"] = max(a["max_count"], count)
    p.coll_raw.clear()
    for op, comm in p.coll_comms:
        a = p.colls.get(op)
        if a is not None and len(a["comms"]) < MAX_COMMS:
            a["comms"].add(comm)
    p.coll_comms.clear()
    for comm, opc in p.opc_last.items():
        try:
            oc = int(opc, 16)
        except ValueError:
            continue
        if oc > p.opcounts.get(comm, -1) and (comm in p.opcounts or len(p.opcounts) < MAX_COMMS):
            p.opcounts[comm] = oc
    p.opc_last.clear()


def tune(p: LogState, line: str, msg: str) -> None:
    m = _TUNE.search(msg)
    if m:
        add_tune(p, _TUNE_KEY(m.groups()), 1)
        p.signal("tuning_choice", line)


def add_tune(p: LogState, fields: tuple, n: int) -> None:
    """n per-call TUNING choices `<op>: <bytes> Bytes -> Algo <a> proto <p> ...` with equal fields."""
    op, nbytes, algo, proto, lo, hi = fields
    if algo.isdigit():
        algo = ALGOS.get(int(algo), algo)
    if proto.isdigit():
        proto = PROTOS.get(int(proto), proto)
    key = (op or "?", algo.upper(), proto.upper())
    c = p.tune_choices.get(key)
    if c is None:
        if len(p.tune_choices) >= 1000:
            return
        c = p.tune_choices[key] = {"op": op, "algo": algo, "proto": proto, "calls": 0,
                                      "min_bytes": None, "max_bytes": None, "channels": None}
    b = int(nbytes)
    c["calls"] += n
    c["min_bytes"] = b if c["min_bytes"] is None else min(c["min_bytes"], b)
    c["max_bytes"] = b if c["max_bytes"] is None else max(c["max_bytes"], b)
    if hi is not None:
        c["channels"] = max(c["channels"] or 0, int(hi) - int(lo) + 1)


def table(p: LogState, msg: str) -> None:
    """Rows of the TUNING model table (`Algorithm |`/`Protocol |` header or the older
    `Latency/AlgBw | Tree/ LL | ...` header), cells `<latency us>/<algbw GB/s>`."""
    cells = [c.strip() for c in msg.split("|")]
    name = cells[0]
    rest = [c for c in cells[1:] if c != ""]
    if name == "Algorithm":
        p.table_algos = rest
        return
    if name == "Protocol":
        algos = p.table_algos or ["?"]
        per = max(1, len(rest) // max(1, len(algos)))
        p.table_cols = [(algos[min(i // per, len(algos) - 1)], proto) for i, proto in enumerate(rest)]
        return
    if name == "Latency/AlgBw":
        cols = []
        for cell in rest:
            a, _, proto = cell.partition("/")
            cols.append((a.strip(), proto.strip()))
        p.table_cols = cols
        return
    if name in ("Max NThreads", "") or not p.table_cols:
        return
    row = p.tune_table.setdefault(name, {}) if len(p.tune_table) < 64 else None
    if row is None:
        return
    for (algo, proto), cell in zip(p.table_cols, rest):
        lat, _, bw = cell.partition("/")
        try:
            row[f"{algo}/{proto}"] = {"latency_us": float(lat), "algbw_gbps": float(bw)}
        except ValueError:
            continue
