"""Stream NCCL_DEBUG=INFO logs (and RCCL, PyTorch watchdog, flight-recorder and NCCL
Inspector output) into one `diag.nccl_log/2` document of facts; the findings are the
diagnosis's (diag.analyzers.diagnosis.nccl_log).

The parser reads line by line and keeps only aggregates: counts, per-peer transports,
per-op collective totals, and at most `max_evidence` example lines per finding signal
and per warning kind, so a multi-gigabyte log is parsed in bounded memory. Files are read
as undecoded chunks of whole lines (`feed_bytes`): one compiled regular expression splits
a chunk in C into the frequent line kinds (COLL, transport, per-call TUNING, no-op INFO
lines), which are counted per distinct field tuple; only the other lines are decoded and
parsed one by one, pre-filtered with substring tests before any regular expression runs.

Format generations handled (examples in ../shared/data/nccl):
- prefixes `host:pid:tid [dev]`, with srun labels, Ray worker tags, timestamps
  `[YYYY-MM-DD HH:MM:SS]`, Markdown quotes, the redacted `node [0]` and bare `[0]`;
- `Init START/COMPLETE` lines from NCCL 2.4 (no busId) to 2.19+ (`ncclCommInitRank ...
  commId`), the topology line (`nRanks nNodes localRanks`);
- rings (`Channel 00/24 :  0 1 ...`), trees (2.5+ `down/down/down->rank->up`, and the
  2.4 reverse notation), channel summaries, NVLS and CollNet lines;
- transports `Channel 00/0 : 7[7] -> 6[6] via ...` (busId or device brackets, `/conn`
  suffix or not, 2.4 `Ring 00 : 34 -> 33 [send] via NET/Socket/0`);
- COLL lines (hex opCount, `Send`/`Recv`), TUNING per-call choices (numeric 2.1x and
  named 2.2x) and model tables (both layouts);
- WARN lines with their source location and the `file.cc:line -> code` error chains.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from diag import inflate
from diag.analyzers.nccl.log_bulk import BulkLines
from diag.analyzers.nccl.log_document import LogDocument
from diag.analyzers.nccl.log_errors import ErrorLines
from diag.analyzers.nccl.log_grammar import (
    _CHAIN,
    _COLL_REST,
    _ENV,
    _IFACE,
    _INIT,
    _IP,
    _LINE_ERRORS,
    _OLD_LEVEL,
    _OLDEST_WARN,
    _PREFIX,
    _RING,
    _SUMMARY,
    _TUNE,
    _TUNE_KEY,
    _VERSION,
    _VIA,
    ALGOS,
    DATATYPES,
    MAX_CACHE,
    MAX_COMMS,
    MAX_EVIDENCE,
    MAX_INTERFACES,
    MAX_PEERS,
    MAX_RANKS,
    MAX_SET,
    PREFIX_SPAN,
    PROTOS,
    REDOPS,
    _Bucket,
    _transport_kind,
)
from diag.errors import DiagInputError


class NcclLogParser(BulkLines, ErrorLines, LogDocument):
    """Feed lines with `feed`, get the document with `result()`. Bounded memory."""

    def __init__(self, max_evidence: int = MAX_EVIDENCE):
        self.cap = max_evidence
        self.lines = 0
        self.nccl_lines = 0
        self.bad_lines = 0
        self.sources: list[str] = []
        self.versions: dict[str, int] = {}
        self.backend = None
        self.rccl: dict = {}
        self.cuda_driver = None
        self.hosts: set[str] = set()
        self.processes: set[tuple] = set()
        self.ips: set[str] = set()
        self.ranks: dict[tuple, dict] = {}
        self.comms: dict[str, dict] = {}
        self.nnodes = 0
        self.rings: dict[tuple, list] = {}
        self.trees = {"lines": 0, "channels": 0, "roots": set(), "examples": [], "notation": None}
        self.summary: dict[str, int] = {}
        self.peers: dict[tuple, dict] = {}
        self.peers_dropped = 0
        self.pxn = 0
        self.by_kind: dict[str, int] = {}
        self.net_used: dict[str, int] = {}
        self.nics: list[str] = []
        self.interfaces: dict[tuple[str, str, str], str] = {}  # (role, name, address) -> first line
        self.nvls = {"available": set(), "unavailable": set(), "heads": 0}
        self.collnet_lines = 0
        self.env: dict[str, str] = {}
        self.colls: dict[str, dict] = {}
        self._coll_raw: dict[tuple, int] = {}
        self._coll_comms: set[tuple] = set()
        self._opc_last: dict[str, str] = {}
        self.opcounts: dict[str, int] = {}
        self.tune_choices: dict[tuple, dict] = {}
        self.tune_table: dict[str, dict] = {}
        self._table_cols: list[tuple[str, str]] = []
        self._table_algos: list[str] = []
        self.warn_kinds: dict[str, dict] = {}
        self.warn_total = 0
        self.chains: dict[tuple, dict] = {}
        self._open_chain: dict[tuple, list] = {}
        self._chain_warn: dict[tuple, str] = {}  # thread -> the WARN line its open chain followed
        self._last_warn: dict[tuple, str] = {}  # thread -> its last WARN line not yet followed by a chain
        self.timeouts: dict[tuple, dict] = {}
        self.wd_state: dict[tuple, dict] = {}
        self.desync_reports: list[dict] = []
        self.fr = {"entries": 0, "states": {}, "ops": {}, "pg_status": {}, "analysis": []}
        self._fr_cur: dict | None = None
        self.inspector = {"records": 0, "colls": {}, "n_ranks": None, "nnodes": None}
        self._insp_cur: dict = {}
        self.signals: dict[str, _Bucket] = {}
        self._prefix_cache: dict[str, tuple] = {}

    # -- helpers -----------------------------------------------------------------------
    def signal(self, name: str, line: str, **data) -> _Bucket:
        """Count one occurrence of a finding signal, keeping the first lines as evidence."""
        b = self.signals.get(name)
        if b is None:
            b = self.signals[name] = _Bucket(self.cap)
        b.count += 1
        if b.full:
            if not data:
                return b
        else:
            b.lines.append(line.rstrip()[:1000])
            b.full = len(b.lines) >= b.cap
        if data:
            for k, v in data.items():
                if v is None:
                    continue
                if isinstance(v, list):
                    lst = b.data.setdefault(k, [])
                    for x in v:
                        if x not in lst and len(lst) < 1000:
                            lst.append(x)
                else:
                    b.data.setdefault(k, v)
        return b

    def _prefix(self, pre: str) -> tuple:
        hit = self._prefix_cache.get(pre)
        if hit is not None:
            return hit
        m = _PREFIX.search(pre[-PREFIX_SPAN:])
        if m:
            hit = (m.group("host"), m.group("pid"), m.group("tid"), int(m.group("dev")), m.group("loc"))
        else:
            hit = (None, None, None, None, None)
        if len(self._prefix_cache) >= MAX_CACHE:
            self._prefix_cache.clear()
        self._prefix_cache[pre] = hit
        host, pid = hit[0], hit[1]
        if host is not None and len(self.hosts) < MAX_SET:
            self.hosts.add(host)
            if pid is not None:
                self.processes.add((host, pid))
        return hit

    def _version(self, name: str, version: str, line: str) -> None:
        if name == "RCCL":
            self.backend = "rccl"
            version, _, build = version.partition("-")  # "2.27.7-HEAD:29e1567"
            if build:
                self.rccl["build"] = build
        elif self.backend is None:
            self.backend = "nccl"
        if len(self.versions) < 100:
            self.versions[version] = self.versions.get(version, 0) + 1
        self.signal("version", line)

    # -- entry points --------------------------------------------------------------------
    def feed(self, line: str) -> None:
        try:
            self._feed(line)
        except _LINE_ERRORS:
            self.bad_lines += 1  # a mangled line must not stop the parse

    def _feed(self, line: str) -> None:
        self.lines += 1
        if line[:1] == "#":
            return  # comments and nccl-tests header lines
        j = line.rfind("NCCL INFO ")
        if j >= 0:
            self.nccl_lines += 1
            msg = line[j + 10:]
            if msg[-1:] == "\n":
                msg = msg[:-1]
            self._info(line, line[:j], msg)
            return
        j = line.find("NCCL WARN ")
        if j >= 0:
            self.nccl_lines += 1
            self._warn(line.rstrip(), line[:j], line[j + 10:].rstrip())
            return
        if ("INFO " in line or "WARN " in line) and self._untagged(line):
            return
        if ("CCL" in line or "atchdog" in line or "ollective" in line or '"' in line or "opCount" in line
                or "ersion" in line or "ccl" in line or "rank" in line):
            self._other(line.rstrip())

    def _untagged(self, line: str) -> bool:
        """A line of NCCL before 2.3, without the "NCCL" tag (log_grammar._OLD_LEVEL): read as
        its INFO or WARN; False where the line is not one."""
        m = _OLD_LEVEL.search(line, max(0, line.find("[")))
        if m is not None:
            self.nccl_lines += 1
            pre, msg = line[:m.start(1)], line[m.end():].rstrip()
            if m.group(1) == "INFO":
                self._info(line, pre, msg)
            else:
                self._warn(line.rstrip(), pre, msg)
            return True
        m = _OLDEST_WARN.match(line.lstrip())
        if m is not None:
            self.nccl_lines += 1
            self._warn(line.rstrip(), m.group(1) + " ", line.lstrip()[m.end():].rstrip())
            return True
        return False

    def feed_all(self, lines: Iterable[str]) -> None:
        """`feed` for every line; the INFO path is inlined because it carries most lines."""
        feed = self.feed
        cache = self._prefix_cache
        prefix = self._prefix
        dispatch = _INFO_DISPATCH
        n = 0
        for line in lines:
            j = line.rfind("NCCL INFO ")
            if j < 0 or line[:1] == "#":
                feed(line)
                continue
            n += 1
            pre = line[:j]
            pfx = cache.get(pre)
            if pfx is None:
                pfx = prefix(pre)
            msg = line[j + 10:]
            if msg[-1:] == "\n":
                msg = msg[:-1]
            sp = msg.find(" ")
            handler = dispatch.get(msg[:sp] if sp > 0 else msg)
            try:
                if handler is not None:
                    handler(self, line, pfx, msg)
                else:
                    self._info_other(line, pfx, msg, sp)
            except _LINE_ERRORS:
                self.bad_lines += 1  # a mangled line must not stop the parse
        self.lines += n
        self.nccl_lines += n

    # -- NCCL INFO -------------------------------------------------------------------------
    def _info(self, line: str, pre: str, msg: str) -> None:
        pfx = self._prefix(pre)
        sp = msg.find(" ")
        handler = _INFO_DISPATCH.get(msg[:sp] if sp > 0 else msg)
        if handler is not None:
            handler(self, line, pfx, msg)
        else:
            self._info_other(line, pfx, msg, sp)

    def _info_other(self, line: str, pfx: tuple, msg: str, sp: int) -> None:
        if sp <= 0:
            if "|" in msg:  # rows of the TUNING model table start with spaces
                self._table(msg)
            return
        w = msg[:sp]
        last = w[-1]
        if last == ":":
            if ": opCount " in msg:
                self._coll(line, msg)
            elif " Bytes -> Algo " in msg:
                self._tune(line, msg)
            return
        if w.startswith(("NCCL_", "RCCL_")):
            self._env(line, msg)
            return
        if ".c" in w or ".h" in w:  # "file.cc:123 -> 3": an error chain frame
            m = _CHAIN.match(msg)
            if m:
                self._chain(line, pfx, m)
            return
        if "|" in msg:
            self._table(msg)
            return
        if " coll channels" in msg:
            for n, kind in _SUMMARY.findall(msg):
                self.summary[kind] = max(self.summary.get(kind, 0), int(n))
            return
        if " Bytes -> Algo " in msg:  # 2.1x TUNING lines without the op name
            self._tune(line, msg)
            return
        if "CollNet" in msg:
            self.collnet_lines += 1
            return
        if "Init FAILED" in msg:
            self.signal("init_failure", line)

    def _i_channel(self, line, pfx, msg) -> None:
        if " via " in msg:
            self._transport(line, pfx, msg)
            return
        m = _RING.match(msg)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            if key not in self.rings and len(self.rings) < 1024:
                self.rings[key] = [int(x) for x in m.group(3).split()]

    def _i_connected(self, line, pfx, msg) -> None:
        self.signal("connected_" + msg.rsplit(" ", 1)[-1], line)

    def _i_version(self, line, pfx, msg) -> None:
        m = _VERSION.search(msg)
        if m:
            self._version(m.group(1), m.group(2), line)

    def _i_trees(self, line, pfx, msg) -> None:
        self._trees(msg)

    def _i_nvls(self, line, pfx, msg) -> None:
        self._nvls(line, pfx, msg)

    def _i_net(self, line, pfx, msg) -> None:
        self._net(line, msg)

    def _i_using(self, line, pfx, msg) -> None:
        if msg.startswith("Using network "):
            net = msg[14:].strip()
            if net:
                self.net_used[net] = self.net_used.get(net, 0) + 1
                self.signal("using_network_" + net.split()[0].lower(), line)

    def _i_bootstrap(self, line, pfx, msg) -> None:
        m = _IP.search(msg)
        if m and len(self.ips) < MAX_SET:
            self.ips.add(m.group(1))
        if "Using" in msg:
            self._interfaces("bootstrap", msg, line)

    def _interfaces(self, role: str, text: str, line: str) -> None:
        """The interfaces NCCL says it uses for `role` (bootstrap, socket, oob), each once."""
        for m in _IFACE.finditer(text):
            key = (role, m.group(1), m.group(2))
            if key not in self.interfaces and len(self.interfaces) < MAX_INTERFACES:
                self.interfaces[key] = line

    def _i_failed(self, line, pfx, msg) -> None:
        if "libibverbs" in msg:
            self.signal("ibverbs_missing", line)

    def _i_cuda_driver(self, line, pfx, msg) -> None:
        try:
            if self.cuda_driver is None:
                self.cuda_driver = int(msg.split()[1])
        except (IndexError, ValueError):
            pass

    def _i_init(self, line, pfx, msg) -> None:
        if " rank " in msg:
            self._init(line, pfx, msg)

    def _i_could(self, line, pfx, msg) -> None:
        if "Could not find a path" in msg:
            self.signal("topology_fallback", line)

    def _i_ignore(self, line, pfx, msg) -> None:
        return

    def _transport(self, line: str, pfx: tuple, msg: str) -> None:
        m = _VIA.match(msg)
        if not m:
            return
        ch, _conn, src, _sb, dst, _db, direction, via = m.groups()
        sig = self._add_transport(ch, src, dst, direction, via, 1)
        if sig is not None:
            self.signal(sig, line)

    def _add_transport(self, ch: str, src: str, dst: str, direction, via: str, n: int):
        """Count n connections of one (channel, peer pair, transport); the finding signal name."""
        kind, label, gdrdma, pxn, sig = _transport_kind(via)
        by_kind = self.by_kind
        by_kind[label] = by_kind.get(label, 0) + n
        key = (src, dst, via)
        p = self.peers.get(key)
        if p is None:
            if len(self.peers) >= MAX_PEERS:
                self.peers_dropped += 1
            else:
                p = self.peers[key] = {"from": int(src), "to": int(dst), "via": via, "kind": kind,
                                       "gdrdma": gdrdma, "pxn": pxn, "channels": set(), "direction": direction}
        if p is not None and len(p["channels"]) < 256:
            p["channels"].add(ch)
        if pxn:
            self.pxn += n
        return sig

    def _bucket(self, name: str) -> _Bucket:
        b = self.signals.get(name)
        if b is None:
            b = self.signals[name] = _Bucket(self.cap)
        return b

    def _trees(self, msg: str) -> None:
        t = self.trees
        t["lines"] += 1
        tokens = msg[5:].split()
        # tokens alternate "[channel]" and the tree of that channel; parse each distinct tree once
        t["channels"] = max(t["channels"], len(tokens) // 2)
        if len(t["examples"]) < self.cap:
            t["examples"].append(msg[:300])
        for part in set(tokens[1::2]):
            pieces = part.split("->")
            if len(pieces) != 3:
                continue
            if "/" in pieces[0]:  # 2.5+: down0/down1/down2->rank->up
                t["notation"] = "down->rank->up"
                if pieces[2] == "-1" and len(t["roots"]) < 4096:
                    t["roots"].add(int(pieces[1]))
            else:  # 2.4: up->rank->down0/down1/down2
                t["notation"] = t["notation"] or "up->rank->down"
                if pieces[0] == "-1" and len(t["roots"]) < 4096:
                    t["roots"].add(int(pieces[1]))

    def _nvls(self, line: str, pfx: tuple, msg: str) -> None:
        if msg.startswith("NVLS multicast support is"):
            dev = msg.rsplit(" ", 1)[-1]
            key = (pfx[0], pfx[1], dev)
            if " not available" in msg:
                if len(self.nvls["unavailable"]) < MAX_SET:
                    self.nvls["unavailable"].add(key)
                self.signal("nvls_unavailable", line)
            elif len(self.nvls["available"]) < MAX_SET:
                self.nvls["available"].add(key)
                self.signal("nvls_available", line)
        elif msg.startswith("NVLS Head"):
            self.nvls["heads"] += 1
        else:
            self.signal("nvls_other", line)

    def _env(self, line: str, msg: str) -> None:
        m = _ENV.match(msg)
        if not m:
            return
        name, value = m.group(1), m.group(2).strip()
        if len(self.env) < 500:
            self.env[name] = value
        self.signal("env_" + name, line)

    def _net(self, line: str, msg: str) -> None:
        if msg.startswith("NET/IB") and "Using" in msg:
            nics = re.findall(r"\[\d+\]([\w\-.]+:\d+/\w+)", msg)
            for n in nics:
                if n not in self.nics and len(self.nics) < 256:
                    self.nics.append(n)
            if not nics:
                self.signal("ib_no_device", line)
            oob = msg.find("OOB ")
            if oob >= 0:
                self._interfaces("oob", msg[oob:], line)
        elif msg.startswith("NET/IB") and "No device found" in msg:
            self.signal("ib_no_device", line)
        elif msg.startswith("NET/Socket") and "Using" in msg:
            m = _IP.search(msg)
            if m and len(self.ips) < MAX_SET:
                self.ips.add(m.group(1))
            self._interfaces("socket", msg, line)
        elif msg.startswith("NET/Plugin"):
            pass

    def _coll(self, line: str, msg: str) -> None:
        i = msg.find(": opCount ")
        m = _COLL_REST.match(msg, i + 2) if i > 0 else None
        if not m:
            return
        op = msg[:i].rsplit(None, 1)[-1]  # the word before ": opCount" (no leading \w+ to backtrack on)
        # Count raw field tuples (cheap: no conversions per line); _flush_colls aggregates.
        opc, count, dt, red, root, comm, nranks = m.groups()
        key = (op, count, dt, red, nranks)
        raw = self._coll_raw
        raw[key] = raw.get(key, 0) + 1
        ck = (op, comm)
        if ck not in self._coll_comms and len(self._coll_comms) < MAX_COMMS:
            self._coll_comms.add(ck)
        self._opc_last[comm] = opc  # opCount grows per communicator: the last is the largest
        if len(raw) >= MAX_CACHE:
            self._flush_colls()

    def _flush_colls(self) -> None:
        for (op, count, dt, red, nranks), calls in self._coll_raw.items():
            count = int(count)
            dt = int(dt)
            dname, dsize = DATATYPES.get(dt, (f"type{dt}", 0))
            a = self.colls.get(op)
            if a is None:
                a = self.colls[op] = {"op": op, "calls": 0, "elements": 0, "bytes": 0, "dtypes": {},
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
        self._coll_raw.clear()
        for op, comm in self._coll_comms:
            a = self.colls.get(op)
            if a is not None and len(a["comms"]) < MAX_COMMS:
                a["comms"].add(comm)
        self._coll_comms.clear()
        for comm, opc in self._opc_last.items():
            try:
                oc = int(opc, 16)
            except ValueError:
                continue
            if oc > self.opcounts.get(comm, -1) and (comm in self.opcounts or len(self.opcounts) < MAX_COMMS):
                self.opcounts[comm] = oc
        self._opc_last.clear()

    def _tune(self, line: str, msg: str) -> None:
        m = _TUNE.search(msg)
        if m:
            self._add_tune(_TUNE_KEY(m.groups()), 1)
            self.signal("tuning_choice", line)

    def _add_tune(self, fields: tuple, n: int) -> None:
        """n per-call TUNING choices `<op>: <bytes> Bytes -> Algo <a> proto <p> ...` with equal fields."""
        op, nbytes, algo, proto, lo, hi = fields
        if algo.isdigit():
            algo = ALGOS.get(int(algo), algo)
        if proto.isdigit():
            proto = PROTOS.get(int(proto), proto)
        key = (op or "?", algo.upper(), proto.upper())
        c = self.tune_choices.get(key)
        if c is None:
            if len(self.tune_choices) >= 1000:
                return
            c = self.tune_choices[key] = {"op": op, "algo": algo, "proto": proto, "calls": 0,
                                          "min_bytes": None, "max_bytes": None, "channels": None}
        b = int(nbytes)
        c["calls"] += n
        c["min_bytes"] = b if c["min_bytes"] is None else min(c["min_bytes"], b)
        c["max_bytes"] = b if c["max_bytes"] is None else max(c["max_bytes"], b)
        if hi is not None:
            c["channels"] = max(c["channels"] or 0, int(hi) - int(lo) + 1)

    def _table(self, msg: str) -> None:
        """Rows of the TUNING model table (`Algorithm |`/`Protocol |` header or the older
        `Latency/AlgBw | Tree/ LL | ...` header), cells `<latency us>/<algbw GB/s>`."""
        cells = [c.strip() for c in msg.split("|")]
        name = cells[0]
        rest = [c for c in cells[1:] if c != ""]
        if name == "Algorithm":
            self._table_algos = rest
            return
        if name == "Protocol":
            algos = self._table_algos or ["?"]
            per = max(1, len(rest) // max(1, len(algos)))
            self._table_cols = [(algos[min(i // per, len(algos) - 1)], p) for i, p in enumerate(rest)]
            return
        if name == "Latency/AlgBw":
            cols = []
            for cell in rest:
                a, _, p = cell.partition("/")
                cols.append((a.strip(), p.strip()))
            self._table_cols = cols
            return
        if name in ("Max NThreads", "") or not self._table_cols:
            return
        row = self.tune_table.setdefault(name, {}) if len(self.tune_table) < 64 else None
        if row is None:
            return
        for (algo, proto), cell in zip(self._table_cols, rest):
            lat, _, bw = cell.partition("/")
            try:
                row[f"{algo}/{proto}"] = {"latency_us": float(lat), "algbw_gbps": float(bw)}
            except ValueError:
                continue

    def _init(self, line: str, pfx: tuple, msg: str) -> None:
        m = _INIT.search(msg)
        if not m:
            return
        (comm, rank, nranks, nnodes, local_ranks, _local_rank, cuda_dev, nvml_dev, bus_id,
         comm_id, phase) = m.groups()
        rank, nranks = int(rank), int(nranks)
        if nnodes:
            self.nnodes = max(self.nnodes, int(nnodes))
        cid = comm_id or f"nranks={nranks}"
        c = self.comms.get(cid)
        if c is None and len(self.comms) < MAX_COMMS:
            c = self.comms[cid] = {"comm_id": comm_id, "nranks": nranks, "ranks": set(), "nnodes": None,
                                   "local_ranks": None, "init_complete": 0, "hosts": set()}
        key = (pfx[0], pfx[1], comm, rank)
        r = self.ranks.get(key)
        if r is None and len(self.ranks) < MAX_RANKS:
            r = self.ranks[key] = {"rank": rank, "nranks": nranks, "host": pfx[0],
                                   "pid": int(pfx[1]) if pfx[1] else None, "cuda_dev": None,
                                   "nvml_dev": None, "bus_id": None, "comm": comm, "comm_id": comm_id}
        if r is not None:
            if cuda_dev is not None:
                r["cuda_dev"] = int(cuda_dev)
            if nvml_dev is not None:
                r["nvml_dev"] = int(nvml_dev)
            if bus_id is not None:
                r["bus_id"] = bus_id
            if comm_id and not r["comm_id"]:
                r["comm_id"] = comm_id
        if c is not None:
            if len(c["ranks"]) < MAX_SET:
                c["ranks"].add(rank)
            if pfx[0] and len(c["hosts"]) < 4096:
                c["hosts"].add(pfx[0])
            if nnodes:
                c["nnodes"] = int(nnodes)
                c["local_ranks"] = int(local_ranks)
            if phase == "Init COMPLETE":
                c["init_complete"] += 1
        if phase and phase != "Init START" and phase != "Init COMPLETE":
            self.signal("init_failure", line)


# First word of an INFO message -> handler. Unknown words fall through to cheap checks.
_INFO_DISPATCH = {
    "Channel": NcclLogParser._i_channel, "Ring": NcclLogParser._i_channel,
    "Connected": NcclLogParser._i_connected, "Trees": NcclLogParser._i_trees,
    "NVLS": NcclLogParser._i_nvls, "NET/IB": NcclLogParser._i_net, "NET/IB:": NcclLogParser._i_net,
    "NET/Socket": NcclLogParser._i_net, "NET/Plugin": NcclLogParser._i_ignore,
    "NET/Plugin:": NcclLogParser._i_ignore, "Using": NcclLogParser._i_using,
    "Bootstrap": NcclLogParser._i_bootstrap, "Failed": NcclLogParser._i_failed,
    "cudaDriverVersion": NcclLogParser._i_cuda_driver, "comm": NcclLogParser._i_init,
    "ncclCommInitRank": NcclLogParser._i_init, "ncclCommInitRankConfig": NcclLogParser._i_init,
    "ncclCommInitAll": NcclLogParser._i_init, "ncclCommSplit": NcclLogParser._i_init,
    "ncclCommInitRankScalable": NcclLogParser._i_init, "Init": NcclLogParser._i_init,
    "NCCL": NcclLogParser._i_version, "RCCL": NcclLogParser._i_version,
    "Could": NcclLogParser._i_could, "Setting": NcclLogParser._i_ignore, "P2P": NcclLogParser._i_ignore,
    "threadThresholds": NcclLogParser._i_ignore, "DMA-BUF": NcclLogParser._i_ignore,
    "TUNER/Plugin:": NcclLogParser._i_ignore, "Launch": NcclLogParser._i_ignore,
}


def _looks_binary(sample: bytes) -> bool:
    if b"\x00" in sample:
        return True
    text = sample.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v\x1b"))
    return bad > 0.10 * max(1, len(text))


def _open_log(path: Path):
    """(a binary stream over a plain or gzipped log, plain?); DiagInputError for empty or
    binary files and unreadable gzip."""
    try:
        fh = inflate.open_binary(path)
    except OSError as exc:
        raise DiagInputError(f"cannot read: {exc.strerror or exc}", source=str(path)) from None
    try:
        head = fh.peek(65536)[:65536]
    except DiagInputError:
        fh.close()
        raise
    if not head.strip():
        fh.close()
        raise DiagInputError("empty file", source=str(path))
    if _looks_binary(head):
        fh.close()
        raise DiagInputError("binary data, not a text log", source=str(path))
    return fh, not isinstance(fh.raw, inflate.GzipStream)


def parse_lines(lines: Iterable[str], source: str | None = None, max_evidence: int = MAX_EVIDENCE) -> dict:
    """The diag.nccl_log/2 document of one stream of lines."""
    p = NcclLogParser(max_evidence=max_evidence)
    if source:
        p.sources.append(source)
    p.feed_all(lines)
    return p.result()


def _recognised(p: NcclLogParser, before: tuple) -> bool:
    return (p.nccl_lines, sum(b.count for b in p.signals.values())) != before


def parse_files(paths, max_evidence: int = MAX_EVIDENCE, progress=None, jobs: int | None = None) -> dict:
    """One document over many files (the ranks of a job). Files that cannot be read or hold
    no NCCL output are listed under "errors" as {"source", "error"}; the rest are parsed.

    A large plain-text file is split into byte ranges parsed by `jobs` processes (default:
    the usable CPUs, at most 8; 1 disables it)."""
    from diag.analyzers.nccl import log_parallel as par

    jobs = par.default_jobs() if jobs is None else max(1, jobs)
    p = NcclLogParser(max_evidence=max_evidence)
    errors = []
    for path in paths:
        path = Path(path)
        before = (p.nccl_lines, sum(b.count for b in p.signals.values()))
        damage = None
        try:
            fh, plain = _open_log(path)
            with fh:
                big = jobs > 1 and plain and path.stat().st_size >= par.MIN_PARALLEL_BYTES
                if not big:  # undecoded chunks of whole lines (gzip: of the decompressed stream)
                    try:
                        for chunk in par.line_chunks(fh, 0, None):
                            p.feed_bytes(chunk)
                    except inflate.InflateError as exc:  # the lines before the damage are kept
                        if not _recognised(p, before):
                            raise
                        damage = str(exc)
            if big:
                p._close_chains()
                p.merge(par.parse_large_file(path, max_evidence, jobs))
        except DiagInputError as exc:
            errors.append({"source": str(path), "error": str(exc)})
            continue
        except OSError as exc:
            errors.append({"source": str(path), "error": f"{path}: cannot read: {exc}"})
            continue
        p._close_chains()  # chains never span files
        if not _recognised(p, before):
            errors.append({"source": str(path),
                           "error": f"{path}: no NCCL, RCCL or PyTorch NCCL log lines found (unknown format)"})
            continue
        p.sources.append(str(path))
        if damage:
            errors.append({"source": str(path), "error": f"{damage}; the lines before it are parsed"})
        if progress:
            progress(path)
    doc = p.result()
    doc["errors"] = errors
    return doc


def parse_file(path) -> dict:
    """One file; DiagInputError when it is unreadable or holds no NCCL log lines."""
    doc = parse_files([path])
    if not doc["sources"]:
        raise DiagInputError(doc["errors"][0]["error"].split(": ", 1)[-1], source=str(path))
    return doc

