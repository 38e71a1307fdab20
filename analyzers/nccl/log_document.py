"""The NCCL log parser's state turned into a `diag.nccl_log/2` document: merging the
parsers of parallel parts of one log, and the result. The document holds facts only,
among them the signals the diagnosis's finding rules read (diag.analyzers.diagnosis.nccl_log).
"""

from __future__ import annotations

from diag.analyzers.nccl.ib_status import ib_status
from diag.analyzers.nccl.interfaces import interface_kind
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


class LogDocument:
    """Merge parsers of parts of one log; the document of facts. A part of NcclLogParser (log.py)."""

    # -- merging (parallel parsing of one large file in byte ranges) ---------------------
    def merge(self, o: LogDocument) -> None:
        """Fold the state of a parser that read a later part of the input into this one."""
        o._close_chains()
        o._flush_colls()
        self._flush_colls()
        self._merge_counts(o)
        self._merge_topology(o)
        self._merge_collectives(o)
        self._merge_failures(o)
        self._merge_inspector(o)
        self._merge_signals(o)

    def _merge_counts(self, o: LogDocument) -> None:
        """Line counts, versions, transports and the library's own facts."""
        self.lines += o.lines
        self.nccl_lines += o.nccl_lines
        self.bad_lines += o.bad_lines
        self.warn_total += o.warn_total
        self.peers_dropped += o.peers_dropped
        self.pxn += o.pxn
        self.collnet_lines += o.collnet_lines
        _add_counts(self.versions, o.versions)
        _add_counts(self.by_kind, o.by_kind)
        _add_counts(self.net_used, o.net_used)
        if o.backend == "rccl" or self.backend is None:
            self.backend = o.backend or self.backend
        self.rccl.update(o.rccl)
        self.cuda_driver = self.cuda_driver or o.cuda_driver

    def _merge_topology(self, o: LogDocument) -> None:
        """Hosts, ranks, communicators, rings, trees, peers, NICs and the environment."""
        for mine, theirs in ((self.hosts, o.hosts), (self.processes, o.processes), (self.ips, o.ips),
                             (self.nvls["available"], o.nvls["available"]),
                             (self.nvls["unavailable"], o.nvls["unavailable"]),
                             (self.trees["roots"], o.trees["roots"])):
            if len(mine) < MAX_SET:
                mine.update(theirs)
        self.nvls["heads"] += o.nvls["heads"]
        self.nnodes = max(self.nnodes, o.nnodes)
        for k, r in o.ranks.items():
            if k not in self.ranks and len(self.ranks) < MAX_RANKS:
                self.ranks[k] = r
        for cid, c in o.comms.items():
            mine = self.comms.get(cid)
            if mine is None:
                if len(self.comms) < MAX_COMMS:
                    self.comms[cid] = c
                continue
            mine["ranks"].update(c["ranks"])
            mine["hosts"].update(c["hosts"])
            mine["init_complete"] += c["init_complete"]
            mine["nnodes"] = mine["nnodes"] or c["nnodes"]
            mine["local_ranks"] = mine["local_ranks"] or c["local_ranks"]
        for k, v in o.rings.items():
            if len(self.rings) < 1024:
                self.rings.setdefault(k, v)
        t, ot = self.trees, o.trees
        t["lines"] += ot["lines"]
        t["channels"] = max(t["channels"], ot["channels"])
        t["examples"] = (t["examples"] + ot["examples"])[: self.cap]
        t["notation"] = t["notation"] or ot["notation"]
        for k, v in o.summary.items():
            self.summary[k] = max(self.summary.get(k, 0), v)
        for k, p in o.peers.items():
            mine = self.peers.get(k)
            if mine is None:
                if len(self.peers) < MAX_PEERS:
                    self.peers[k] = p
                else:
                    self.peers_dropped += 1
            elif len(mine["channels"]) < 256:
                mine["channels"].update(p["channels"])
        for n in o.nics:
            if n not in self.nics and len(self.nics) < 256:
                self.nics.append(n)
        for k, line in o.interfaces.items():
            if k not in self.interfaces and len(self.interfaces) < MAX_INTERFACES:
                self.interfaces[k] = line
        self.env.update(o.env)

    def _merge_collectives(self, o: LogDocument) -> None:
        """Collective calls, operation counts and the tuner's choices."""
        for op, a in o.colls.items():
            mine = self.colls.get(op)
            if mine is None:
                self.colls[op] = a
                continue
            for k in ("calls", "elements", "bytes"):
                mine[k] += a[k]
            _add_counts(mine["dtypes"], a["dtypes"])
            _add_counts(mine["redops"], a["redops"])
            mine["nranks"] = sorted(set(mine["nranks"]) | set(a["nranks"]))[:64]
            if len(mine["comms"]) < MAX_COMMS:
                mine["comms"].update(a["comms"])
            mine["max_count"] = max(mine["max_count"], a["max_count"])
        for comm, oc in o.opcounts.items():
            if oc > self.opcounts.get(comm, -1) and (comm in self.opcounts or len(self.opcounts) < MAX_COMMS):
                self.opcounts[comm] = oc
        for k, c in o.tune_choices.items():
            mine = self.tune_choices.get(k)
            if mine is None:
                if len(self.tune_choices) < 1000:
                    self.tune_choices[k] = c
                continue
            mine["calls"] += c["calls"]
            mine["min_bytes"] = min(mine["min_bytes"], c["min_bytes"])
            mine["max_bytes"] = max(mine["max_bytes"], c["max_bytes"])
            if c["channels"] is not None:
                mine["channels"] = max(mine["channels"] or 0, c["channels"])
        for name, row in o.tune_table.items():
            self.tune_table.setdefault(name, row)

    def _merge_failures(self, o: LogDocument) -> None:
        """Warnings, error chains, watchdog timeouts, desync reports and the flight recorder."""
        for k, w in o.warn_kinds.items():
            mine = self.warn_kinds.get(k)
            if mine is None:
                if len(self.warn_kinds) < MAX_WARN_KINDS:
                    self.warn_kinds[k] = w
                continue
            mine["count"] += w["count"]
            mine["hosts"] = (mine["hosts"] + [h for h in w["hosts"] if h not in mine["hosts"]])[:64]
            mine["evidence"] = (mine["evidence"] + w["evidence"])[: self.cap]
        self._close_chains()
        for k, c in o.chains.items():
            mine = self.chains.get(k)
            if mine is None:
                if len(self.chains) < MAX_CHAINS:
                    self.chains[k] = c
            else:
                mine["count"] += c["count"]
        for k, tmo in o.timeouts.items():
            mine = self.timeouts.get(k)
            if mine is None:
                if len(self.timeouts) < 1000:
                    self.timeouts[k] = tmo
                continue
            mine["count"] += tmo["count"]
            mine["ranks"].update(tmo["ranks"])
            mine["ran_ms"] = max(mine["ran_ms"] or 0, tmo["ran_ms"] or 0) or None
            for f in ("numel_in", "numel_out"):
                mine[f] = mine[f] if mine[f] is not None else tmo[f]
        for k, w in o.wd_state.items():
            if k in self.wd_state or len(self.wd_state) < MAX_RANKS:
                self.wd_state[k] = w
        self.desync_reports = (self.desync_reports + o.desync_reports)[:100]
        fr, ofr = self.fr, o.fr
        fr["entries"] += ofr["entries"]
        _add_counts(fr["states"], ofr["states"])
        _add_counts(fr["ops"], ofr["ops"])
        fr["pg_status"].update(ofr["pg_status"])
        fr["analysis"] = (fr["analysis"] + ofr["analysis"])[:100]
        for k, v in ofr.items():
            fr.setdefault(k, v)
        if "max_seq" in ofr:
            fr["max_seq"] = max(fr.get("max_seq", -1), ofr["max_seq"])

    def _merge_inspector(self, o: LogDocument) -> None:
        """The Inspector plugin's records."""
        ins, oins = self.inspector, o.inspector
        ins["records"] += oins["records"]
        for k in ("n_ranks", "nnodes", "format"):
            ins[k] = ins.get(k) or oins.get(k)
        for coll, a in oins["colls"].items():
            mine = ins["colls"].get(coll)
            if mine is None:
                if len(ins["colls"]) < 64:
                    ins["colls"][coll] = a
                continue
            mine["count"] += a["count"]
            mine["busbw_sum"] += a["busbw_sum"]
            mine["exec_time_us_sum"] += a["exec_time_us_sum"]
            mine["max_msg_size_bytes"] = max(mine["max_msg_size_bytes"], a["max_msg_size_bytes"])
            if a["busbw_max"] is not None:
                mine["busbw_max"] = a["busbw_max"] if mine["busbw_max"] is None else max(mine["busbw_max"], a["busbw_max"])

    def _merge_signals(self, o: LogDocument) -> None:
        """The signals the finding rules read."""
        for name, b in o.signals.items():
            mine = self.signals.get(name)
            if mine is None:
                self.signals[name] = b
                continue
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
    def _glued_hosts(self) -> dict[str, str]:
        """Host names with other text glued before them ("12:00:01node1" from a line that
        another process's output ran into) -> the host they are: a name that ends with another
        host's name and shares one of its process ids."""
        by_pid: dict[str, set] = {}
        for host, pid in self.processes:
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

    def _unglue_hosts(self) -> None:
        """Every host name as the host it is (`_glued_hosts`): one host is counted once."""
        alias = self._glued_hosts()
        if not alias:
            return
        self.hosts = {alias.get(h, h) for h in self.hosts}
        self.processes = {(alias.get(h, h), pid) for h, pid in self.processes}
        for c in self.comms.values():
            c["hosts"] = {alias.get(h, h) for h in c["hosts"]}
        for w in self.warn_kinds.values():
            w["hosts"] = list(dict.fromkeys(alias.get(h, h) for h in w["hosts"]))
        for r in self.ranks.values():
            r["host"] = alias.get(r.get("host"), r.get("host"))

    def _signal_facts(self) -> dict:
        """Each signal as the finding rules read it: its count, its first lines with their WARN
        messages, and what it carried (InfiniBand statuses decoded)."""
        out = {}
        for name in sorted(self.signals):
            b = self.signals[name]
            data = {k: sorted(v) if isinstance(v, set) else v for k, v in b.data.items()}
            if "statuses" in data:
                data["statuses"] = [ib_status(c) for c in data["statuses"]]
            out[name] = {"count": b.count, "lines": list(b.lines),
                         "messages": [warn_message(line) for line in b.lines], "data": data}
        return out

    def _transport_facts(self) -> dict:
        """Connections by transport kind, the network and interfaces used, and each peer's path."""
        peers = sorted(({**p, "channels": sorted(int(c) for c in p["channels"])} for p in self.peers.values()),
                       key=lambda p: (p["from"], p["to"], p["via"]))
        net_kinds = {k: v for k, v in self.by_kind.items() if k.startswith("NET/")}
        return {
            "connections": sum(self.by_kind.values()),
            "by_kind": dict(sorted(self.by_kind.items(), key=lambda kv: -kv[1])),
            "network": sorted(self.net_used, key=lambda n: -self.net_used[n]),
            "nics": self.nics,
            "interfaces": [{"role": role, "name": name, "address": address, "line": line,
                            "kind": interface_kind(name, address)}
                           for (role, name, address), line in self.interfaces.items()],
            "gdrdma": sum(v for k, v in net_kinds.items() if k.endswith("/GDRDMA")),
            "no_gdrdma": sum(v for k, v in net_kinds.items() if not k.endswith("/GDRDMA")),
            "pxn": self.pxn,
            "peers": peers,
            "peers_dropped": self.peers_dropped,
        }

    def _inspector_facts(self) -> dict | None:
        """The NCCL Inspector's records per collective (None: no Inspector output)."""
        if not self.inspector["records"]:
            return None
        return {"records": self.inspector["records"], "n_ranks": self.inspector["n_ranks"],
                "nnodes": self.inspector["nnodes"], "format": self.inspector.get("format"),
                "collectives": [{"coll": a["coll"], "count": a["count"],
                                 "avg_busbw_gbps": a["busbw_sum"] / a["count"] if a["count"] else None,
                                 "max_busbw_gbps": a["busbw_max"],
                                 "max_msg_size_bytes": a["max_msg_size_bytes"] or None,
                                 "avg_exec_time_us": a["exec_time_us_sum"] / a["count"] if a["count"] else None}
                                for a in self.inspector["colls"].values()]}

    def result(self) -> dict:
        self._close_chains()
        self._flush_colls()
        self._unglue_hosts()
        versions = sorted(self.versions, key=lambda v: -self.versions[v])
        colls = []
        for a in sorted(self.colls.values(), key=lambda a: -a["calls"]):
            colls.append({**{k: v for k, v in a.items() if k != "comms"}, "comms": len(a["comms"]),
                          "nranks": sorted(a["nranks"])})
        ranks = sorted(self.ranks.values(), key=lambda r: (r["comm_id"] or "", r["nranks"], r["rank"]))
        comms = [{"comm_id": c["comm_id"], "nranks": c["nranks"], "ranks_seen": len(c["ranks"]),
                  "nnodes": c["nnodes"], "local_ranks": c["local_ranks"], "init_complete": c["init_complete"],
                  "hosts": len(c["hosts"])}
                 for c in self.comms.values()]
        transports = self._transport_facts()
        rings = [{"channel": ch, "channels": n, "order": order} for (ch, n), order in sorted(self.rings.items())]
        tuning = {
            "choices": sorted(self.tune_choices.values(), key=lambda c: -c["calls"]),
            "table": self.tune_table,
            "env": {k: v for k, v in self.env.items() if k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS",
                                                               "NCCL_MIN_NCHANNELS", "NCCL_TUNER_PLUGIN")},
        }
        timeouts = [{**{k: v for k, v in t.items() if k != "ranks"}, "ranks": sorted(t["ranks"])}
                    for t in sorted(self.timeouts.values(), key=lambda t: (t["seq"], t["op"]))]
        insp = self._inspector_facts()
        fr = None
        if self.fr.get("seen") or self.fr["analysis"]:
            fr = {k: v for k, v in self.fr.items() if k != "seen"}
        doc = {
            "schema": SCHEMA,
            "sources": list(self.sources),
            "lines": self.lines,
            "nccl_lines": self.nccl_lines,
            "unparsed_lines": self.bad_lines,
            "nccl_version": versions[0] if versions else None,
            "versions": versions,
            "backend": self.backend or ("nccl" if self.nccl_lines else None),
            "rccl": self.rccl or None,
            "cuda_driver_version": self.cuda_driver,
            "hosts": sorted(self.hosts),
            "processes": len(self.processes),
            "nodes": self._node_count(),
            "ranks": ranks,
            "world_size": max([c["nranks"] for c in comms] + [max(a["nranks"], default=0) for a in colls]
                              + [self.inspector["n_ranks"] or 0]) or None,
            "communicators": comms,
            "channels": {"rings": rings, "trees": {"lines": self.trees["lines"], "channels": self.trees["channels"],
                                                   "roots": sorted(self.trees["roots"]),
                                                   "notation": self.trees["notation"],
                                                   "examples": self.trees["examples"]},
                         **{f"{k}_channels": v for k, v in self.summary.items()}},
            "transports": transports,
            "nvls": {"available_devices": len(self.nvls["available"]),
                     "unavailable_devices": len(self.nvls["unavailable"]),
                     "heads": self.nvls["heads"], "channels": self.summary.get("nvls")},
            "collnet": {"channels": self.summary.get("collnet"), "lines": self.collnet_lines},
            "tuning": tuning,
            "env": dict(self.env),
            "collectives": colls,
            "max_op_count": max(self.opcounts.values()) if self.opcounts else None,
            "warnings": sorted(self.warn_kinds.values(), key=lambda w: -w["count"]),
            "warning_lines": self.warn_total,
            "error_chains": [{**c, "started_by_message": warn_message(c["started_by"]) if c.get("started_by") else None}
                             for c in sorted(self.chains.values(), key=lambda c: -c["count"])],
            "timeouts": timeouts,
            "watchdog": sorted(self.wd_state.values(), key=lambda w: (str(w["pg"]), w["rank"])),
            "desync_reports": self.desync_reports,
            "flight_recorder": fr,
            "inspector": insp,
            "signals": self._signal_facts(),
            "errors": [],
        }
        return doc

    def _node_count(self) -> int | None:
        """Nodes in the job: the topology line, else distinct hosts / bootstrap addresses."""
        n = max(self.nnodes, len(self.hosts), len(self.ips))
        return n or None
