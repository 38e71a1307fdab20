"""The NCCL log parser's state turned into a `diag.nccl_log/2` document: merging the
parsers of parallel parts of one log, and the result. The document holds facts only,
among them the signals the diagnosis's finding rules read (diag.analyzers.diagnosis.nccl_log).
"""

from __future__ import annotations

from diag.analyzers.nccl.ib_status import ib_status
from diag.analyzers.nccl.interfaces import interface_kind
from diag.analyzers.nccl.log_collectives import flush_colls
from diag.analyzers.nccl.log_errors import close_chains
from diag.analyzers.nccl.log_grammar import (
    MAX_CHAINS,
    MAX_COMMS,
    MAX_INTERFACES,
    MAX_PEERS,
    MAX_RANKS,
    MAX_SET,
    MAX_WARN_KINDS,
    SCHEMA,
    _add_counts,
    warn_message,
)
from diag.analyzers.nccl.log_state import LogState


def _fold(mine: dict, theirs: dict, cap: int | None, combine) -> None:
    """Each of `theirs` into `mine`: a key new to `mine` is taken while `mine` holds fewer than
    `cap` (None: no cap), a key in both is combined (`combine(mine's value, theirs)`)."""
    for k, v in theirs.items():
        m = mine.get(k)
        if m is None:
            if cap is None or len(mine) < cap:
                mine[k] = v
        else:
            combine(m, v)


# -- merging (parallel parsing of one large file in byte ranges) ---------------------
def merge(p: LogState, o: LogState) -> None:
    """Fold the state of a parser that read a later part of the input into this one."""
    close_chains(o)
    flush_colls(o)
    flush_colls(p)
    merge_counts(p, o)
    merge_topology(p, o)
    merge_collectives(p, o)
    merge_failures(p, o)
    merge_inspector(p, o)
    merge_signals(p, o)


def merge_counts(p: LogState, o: LogState) -> None:
    """Line counts, versions, transports and the library's own facts."""
    p.lines += o.lines
    p.nccl_lines += o.nccl_lines
    p.bad_lines += o.bad_lines
    p.warn_total += o.warn_total
    p.peers_dropped += o.peers_dropped
    p.pxn += o.pxn
    p.collnet_lines += o.collnet_lines
    _add_counts(p.versions, o.versions)
    _add_counts(p.by_kind, o.by_kind)
    _add_counts(p.net_used, o.net_used)
    if o.backend == "rccl" or p.backend is None:
        p.backend = o.backend or p.backend
    p.rccl.update(o.rccl)
    p.cuda_driver = p.cuda_driver or o.cuda_driver


def merge_topology(p: LogState, o: LogState) -> None:
    """Hosts, ranks, communicators, rings, trees, peers, NICs and the environment."""
    sets: tuple[tuple[set, set], ...] = (
        (p.hosts, o.hosts), (p.processes, o.processes), (p.ips, o.ips),
        (p.nvls["available"], o.nvls["available"]), (p.nvls["unavailable"], o.nvls["unavailable"]),
        (p.trees["roots"], o.trees["roots"]))
    for mine, theirs in sets:
        if len(mine) < MAX_SET:
            mine.update(theirs)
    p.nvls["heads"] += o.nvls["heads"]
    p.nnodes = max(p.nnodes, o.nnodes)
    for k, r in o.ranks.items():
        if k not in p.ranks and len(p.ranks) < MAX_RANKS:
            p.ranks[k] = r
    _fold(p.comms, o.comms, MAX_COMMS, _combine_comm)
    for k, v in o.rings.items():
        if len(p.rings) < 1024:
            p.rings.setdefault(k, v)
    t, ot = p.trees, o.trees
    t["lines"] += ot["lines"]
    t["channels"] = max(t["channels"], ot["channels"])
    t["examples"] = (t["examples"] + ot["examples"])[: p.cap]
    t["notation"] = t["notation"] or ot["notation"]
    for k, v in o.summary.items():
        p.summary[k] = max(p.summary.get(k, 0), v)
    for k, peer in o.peers.items():
        mine = p.peers.get(k)
        if mine is None:
            if len(p.peers) < MAX_PEERS:
                p.peers[k] = peer
            else:
                p.peers_dropped += 1
        elif len(mine["channels"]) < 256:
            mine["channels"].update(peer["channels"])
    for n in o.nics:
        if n not in p.nics and len(p.nics) < 256:
            p.nics.append(n)
    for k, line in o.interfaces.items():
        if k not in p.interfaces and len(p.interfaces) < MAX_INTERFACES:
            p.interfaces[k] = line
    p.env.update(o.env)


def _combine_comm(mine: dict, c: dict) -> None:
    mine["ranks"].update(c["ranks"])
    mine["hosts"].update(c["hosts"])
    mine["init_complete"] += c["init_complete"]
    mine["nnodes"] = mine["nnodes"] or c["nnodes"]
    mine["local_ranks"] = mine["local_ranks"] or c["local_ranks"]


def merge_collectives(p: LogState, o: LogState) -> None:
    """Collective calls, operation counts and the tuner's choices."""
    _fold(p.colls, o.colls, None, _combine_coll)
    for comm, oc in o.opcounts.items():
        if oc > p.opcounts.get(comm, -1) and (comm in p.opcounts or len(p.opcounts) < MAX_COMMS):
            p.opcounts[comm] = oc
    _fold(p.tune_choices, o.tune_choices, 1000, _combine_tune_choice)
    for name, row in o.tune_table.items():
        p.tune_table.setdefault(name, row)


def _combine_coll(mine: dict, a: dict) -> None:
    for k in ("calls", "elements", "bytes"):
        mine[k] += a[k]
    _add_counts(mine["dtypes"], a["dtypes"])
    _add_counts(mine["redops"], a["redops"])
    mine["nranks"] = sorted(set(mine["nranks"]) | set(a["nranks"]))[:64]
    if len(mine["comms"]) < MAX_COMMS:
        mine["comms"].update(a["comms"])
    mine["max_count"] = max(mine["max_count"], a["max_count"])


def _combine_tune_choice(mine: dict, c: dict) -> None:
    mine["calls"] += c["calls"]
    mine["min_bytes"] = min(mine["min_bytes"], c["min_bytes"])
    mine["max_bytes"] = max(mine["max_bytes"], c["max_bytes"])
    if c["channels"] is not None:
        mine["channels"] = max(mine["channels"] or 0, c["channels"])


def merge_failures(p: LogState, o: LogState) -> None:
    """Warnings, error chains, watchdog timeouts, desync reports and the flight recorder."""
    def warn_kind(mine: dict, w: dict) -> None:
        mine["count"] += w["count"]
        mine["hosts"] = (mine["hosts"] + [h for h in w["hosts"] if h not in mine["hosts"]])[:64]
        mine["evidence"] = (mine["evidence"] + w["evidence"])[: p.cap]

    _fold(p.warn_kinds, o.warn_kinds, MAX_WARN_KINDS, warn_kind)
    close_chains(p)
    _fold(p.chains, o.chains, MAX_CHAINS, _combine_count)
    _fold(p.timeouts, o.timeouts, 1000, _combine_timeout)
    for k, w in o.wd_state.items():
        if k in p.wd_state or len(p.wd_state) < MAX_RANKS:
            p.wd_state[k] = w
    p.desync_reports = (p.desync_reports + o.desync_reports)[:100]
    fr, ofr = p.fr, o.fr
    fr["entries"] += ofr["entries"]
    _add_counts(fr["states"], ofr["states"])
    _add_counts(fr["ops"], ofr["ops"])
    fr["pg_status"].update(ofr["pg_status"])
    fr["analysis"] = (fr["analysis"] + ofr["analysis"])[:100]
    for k, v in ofr.items():
        fr.setdefault(k, v)
    if "max_seq" in ofr:
        fr["max_seq"] = max(fr.get("max_seq", -1), ofr["max_seq"])


def _combine_count(mine: dict, c: dict) -> None:
    mine["count"] += c["count"]


def _combine_timeout(mine: dict, tmo: dict) -> None:
    mine["count"] += tmo["count"]
    mine["ranks"].update(tmo["ranks"])
    mine["ran_ms"] = max(mine["ran_ms"] or 0, tmo["ran_ms"] or 0) or None
    for f in ("numel_in", "numel_out"):
        mine[f] = mine[f] if mine[f] is not None else tmo[f]


def merge_inspector(p: LogState, o: LogState) -> None:
    """The Inspector plugin's records."""
    ins, oins = p.inspector, o.inspector
    ins["records"] += oins["records"]
    for k in ("n_ranks", "nnodes", "format"):
        ins[k] = ins.get(k) or oins.get(k)
    _fold(ins["colls"], oins["colls"], 64, _combine_inspected)


def _combine_inspected(mine: dict, a: dict) -> None:
    mine["count"] += a["count"]
    mine["busbw_sum"] += a["busbw_sum"]
    mine["exec_time_us_sum"] += a["exec_time_us_sum"]
    mine["max_msg_size_bytes"] = max(mine["max_msg_size_bytes"], a["max_msg_size_bytes"])
    if a["busbw_max"] is not None:
        mine["busbw_max"] = a["busbw_max"] if mine["busbw_max"] is None else max(mine["busbw_max"], a["busbw_max"])


def merge_signals(p: LogState, o: LogState) -> None:
    """The signals the finding rules read."""
    _fold(p.signals, o.signals, None, _combine_signal)


def _combine_signal(mine, b) -> None:
    mine.count += b.count
    mine.lines = (mine.lines + b.lines)[: mine.cap]
    mine.full = len(mine.lines) >= mine.cap
    for k, v in b.data.items():
        if isinstance(v, list):
            lst = mine.data.setdefault(k, [])
            lst.extend(x for x in v if x not in lst)
            del lst[1000:]
        else:
            mine.data.setdefault(k, v)


# -- result ----------------------------------------------------------------------------
def glued_hosts(p: LogState) -> dict[str, str]:
    """Host names with other text glued before them ("12:00:01node1" from a line that
    another process's output ran into) -> the host they are: a name that ends with another
    host's name and shares one of its process ids."""
    by_pid: dict[str, set] = {}
    for host, pid in p.processes:
        by_pid.setdefault(pid, set()).add(host)
    alias = {}
    for hosts in by_pid.values():
        if len(hosts) < 2 or len(hosts) > 64:
            continue
        for h in hosts:
            base = min((g for g in hosts if g != h and h.endswith(g)), key=len, default=None)
            if base is not None:
                alias[h] = base
    return alias


def unglue_hosts(p: LogState) -> None:
    """Every host name as the host it is (`_glued_hosts`): one host is counted once."""
    alias = glued_hosts(p)
    if not alias:
        return
    p.hosts = {alias.get(h, h) for h in p.hosts}
    p.processes = {(alias.get(h, h), pid) for h, pid in p.processes}
    for c in p.comms.values():
        c["hosts"] = {alias.get(h, h) for h in c["hosts"]}
    for w in p.warn_kinds.values():
        w["hosts"] = list(dict.fromkeys(alias.get(h, h) for h in w["hosts"]))
    for r in p.ranks.values():
        r["host"] = alias.get(r["host"], r["host"]) if r.get("host") is not None else None


def signal_facts(p: LogState) -> dict:
    """Each signal as the finding rules read it: its count, its first lines with their WARN
    messages, and what it carried (InfiniBand statuses decoded)."""
    out = {}
    for name in sorted(p.signals):
        b = p.signals[name]
        data = {k: sorted(v) if isinstance(v, set) else v for k, v in b.data.items()}
        if "statuses" in data:
            data["statuses"] = [ib_status(c) for c in data["statuses"]]
        out[name] = {"count": b.count, "lines": list(b.lines),
                     "messages": [warn_message(line) for line in b.lines], "data": data}
    return out


def transport_facts(p: LogState) -> dict:
    """Connections by transport kind, the network and interfaces used, and each peer's path."""
    peers = sorted(({**peer, "channels": sorted(int(c) for c in peer["channels"])} for peer in p.peers.values()),
                   key=lambda peer: (peer["from"], peer["to"], peer["via"]))
    net_kinds = {k: v for k, v in p.by_kind.items() if k.startswith("NET/")}
    return {
        "connections": sum(p.by_kind.values()),
        "by_kind": dict(sorted(p.by_kind.items(), key=lambda kv: -kv[1])),
        "network": sorted(p.net_used, key=lambda n: -p.net_used[n]),
        "nics": p.nics,
        "interfaces": [{"role": role, "name": name, "address": address, "line": line,
                        "kind": interface_kind(name, address)}
                       for (role, name, address), line in p.interfaces.items()],
        "gdrdma": sum(v for k, v in net_kinds.items() if k.endswith("/GDRDMA")),
        "no_gdrdma": sum(v for k, v in net_kinds.items() if not k.endswith("/GDRDMA")),
        "pxn": p.pxn,
        "peers": peers,
        "peers_dropped": p.peers_dropped,
    }


def inspector_facts(p: LogState) -> dict | None:
    """The NCCL Inspector's records per collective (None: no Inspector output)."""
    if not p.inspector["records"]:
        return None
    return {"records": p.inspector["records"], "n_ranks": p.inspector["n_ranks"],
            "nnodes": p.inspector["nnodes"], "format": p.inspector.get("format"),
            "collectives": [{"coll": a["coll"], "count": a["count"],
                             "avg_busbw_gbps": a["busbw_sum"] / a["count"] if a["count"] else None,
                             "max_busbw_gbps": a["busbw_max"],
                             "max_msg_size_bytes": a["max_msg_size_bytes"] or None,
                             "avg_exec_time_us": a["exec_time_us_sum"] / a["count"] if a["count"] else None}
                            for a in p.inspector["colls"].values()]}


def result(p: LogState) -> dict:
    close_chains(p)
    flush_colls(p)
    unglue_hosts(p)
    versions = sorted(p.versions, key=lambda v: -p.versions[v])
    colls = []
    for a in sorted(p.colls.values(), key=lambda a: -a["calls"]):
        colls.append({**{k: v for k, v in a.items() if k != "comms"}, "comms": len(a["comms"]),
                      "nranks": sorted(a["nranks"])})
    ranks = sorted(p.ranks.values(), key=lambda r: (r["comm_id"] or "", r["nranks"], r["rank"]))
    comms = [{"comm_id": c["comm_id"], "nranks": c["nranks"], "ranks_seen": len(c["ranks"]),
              "nnodes": c["nnodes"], "local_ranks": c["local_ranks"], "init_complete": c["init_complete"],
              "hosts": len(c["hosts"])}
             for c in p.comms.values()]
    transports = transport_facts(p)
    rings = [{"channel": ch, "channels": n, "order": order} for (ch, n), order in sorted(p.rings.items())]
    tuning = {
        "choices": sorted(p.tune_choices.values(), key=lambda c: -c["calls"]),
        "table": p.tune_table,
        "env": {k: v for k, v in p.env.items() if k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS",
                                                           "NCCL_MIN_NCHANNELS", "NCCL_TUNER_PLUGIN")},
    }
    timeouts = [{**{k: v for k, v in t.items() if k != "ranks"}, "ranks": sorted(t["ranks"])}
                for t in sorted(p.timeouts.values(), key=lambda t: (t["seq"], t["op"]))]
    insp = inspector_facts(p)
    fr = None
    if p.fr.get("seen") or p.fr["analysis"]:
        fr = {k: v for k, v in p.fr.items() if k != "seen"}
    doc = {
        "schema": SCHEMA,
        "sources": list(p.sources),
        "lines": p.lines,
        "nccl_lines": p.nccl_lines,
        "unparsed_lines": p.bad_lines,
        "nccl_version": versions[0] if versions else None,
        "versions": versions,
        "backend": p.backend or ("nccl" if p.nccl_lines else None),
        "rccl": p.rccl or None,
        "cuda_driver_version": p.cuda_driver,
        "hosts": sorted(p.hosts),
        "processes": len(p.processes),
        "nodes": node_count(p),
        "ranks": ranks,
        "world_size": max([c["nranks"] for c in comms] + [max(a["nranks"], default=0) for a in colls]
                          + [p.inspector["n_ranks"] or 0]) or None,
        "communicators": comms,
        "channels": {"rings": rings, "trees": {"lines": p.trees["lines"], "channels": p.trees["channels"],
                                               "roots": sorted(p.trees["roots"]),
                                               "notation": p.trees["notation"],
                                               "examples": p.trees["examples"]},
                     **{f"{k}_channels": v for k, v in p.summary.items()}},
        "transports": transports,
        "nvls": {"available_devices": len(p.nvls["available"]),
                 "unavailable_devices": len(p.nvls["unavailable"]),
                 "heads": p.nvls["heads"], "channels": p.summary.get("nvls")},
        "collnet": {"channels": p.summary.get("collnet"), "lines": p.collnet_lines},
        "tuning": tuning,
        "env": dict(p.env),
        "collectives": colls,
        "max_op_count": max(p.opcounts.values()) if p.opcounts else None,
        "warnings": sorted(p.warn_kinds.values(), key=lambda w: -w["count"]),
        "warning_lines": p.warn_total,
        "error_chains": [{**c, "started_by_message": warn_message(c["started_by"]) if c.get("started_by") else None}
                         for c in sorted(p.chains.values(), key=lambda c: -c["count"])],
        "timeouts": timeouts,
        "watchdog": sorted(p.wd_state.values(), key=lambda w: (str(w["pg"]), w["rank"])),
        "desync_reports": p.desync_reports,
        "flight_recorder": fr,
        "inspector": insp,
        "signals": signal_facts(p),
        "errors": [],
    }
    return doc


def node_count(p: LogState) -> int | None:
    """Nodes in the job: the topology line, else distinct hosts / bootstrap addresses."""
    n = max(p.nnodes, len(p.hosts), len(p.ips))
    return n or None
