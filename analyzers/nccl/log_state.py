"""The state of the NCCL log parser: every aggregate a log's lines add to (counts, per-peer
transports, per-op collective totals, bounded evidence lines per finding signal), and the
three helpers every line handler uses. The handlers are functions over this state, one
module per family of lines (log_info, log_collectives, log_errors, log_bulk); log_document
turns it into the document.
"""

from __future__ import annotations

from typing import Any

from diag.analyzers.nccl.log_grammar import (
    _PREFIX,
    MAX_CACHE,
    MAX_EVIDENCE,
    MAX_SET,
    PREFIX_SPAN,
    _Bucket,
)


class LogState:
    """What the lines of a log added up to so far. Bounded: every collection has a cap."""

    def __init__(self, max_evidence: int = MAX_EVIDENCE):
        self.cap = max_evidence
        self.lines = 0
        self.nccl_lines = 0
        self.bad_lines = 0
        self.sources: list[str] = []
        self.versions: dict[str, int] = {}
        self.backend: str | None = None
        self.rccl: dict = {}
        self.cuda_driver: int | None = None
        self.hosts: set[str] = set()
        self.processes: set[tuple] = set()
        self.ips: set[str] = set()
        self.ranks: dict[tuple, dict] = {}
        self.comms: dict[str, dict] = {}
        self.nnodes = 0
        self.rings: dict[tuple, list] = {}
        self.trees: dict[str, Any] = {"lines": 0, "channels": 0, "roots": set(), "examples": [], "notation": None}
        self.summary: dict[str, int] = {}
        self.peers: dict[tuple, dict] = {}
        self.peers_dropped = 0
        self.pxn = 0
        self.by_kind: dict[str, int] = {}
        self.net_used: dict[str, int] = {}
        self.nics: list[str] = []
        self.interfaces: dict[tuple[str, str, str], str] = {}  # (role, name, address) -> first line
        self.nvls: dict[str, Any] = {"available": set(), "unavailable": set(), "heads": 0}
        self.collnet_lines = 0
        self.env: dict[str, str] = {}
        self.colls: dict[str, dict] = {}
        self.coll_raw: dict[tuple, int] = {}
        self.coll_comms: set[tuple] = set()
        self.opc_last: dict[str, str] = {}
        self.opcounts: dict[str, int] = {}
        self.tune_choices: dict[tuple, dict] = {}
        self.tune_table: dict[str, dict] = {}
        self.table_cols: list[tuple[str, str]] = []
        self.table_algos: list[str] = []
        self.warn_kinds: dict[str, dict] = {}
        self.warn_total = 0
        self.chains: dict[tuple, dict] = {}
        self.open_chain: dict[tuple, list] = {}
        self.chain_warn: dict[tuple, str] = {}  # thread -> the WARN line its open chain followed
        self.last_warn: dict[tuple, str] = {}  # thread -> its last WARN line not yet followed by a chain
        self.timeouts: dict[tuple, dict] = {}
        self.wd_state: dict[tuple, dict] = {}
        self.desync_reports: list[dict] = []
        self.fr: dict[str, Any] = {"entries": 0, "states": {}, "ops": {}, "pg_status": {}, "analysis": []}
        self.fr_cur: dict | None = None
        self.inspector: dict[str, Any] = {"records": 0, "colls": {}, "n_ranks": None, "nnodes": None}
        self.insp_cur: dict[str, Any] = {}
        self.signals: dict[str, _Bucket] = {}
        self.prefix_cache: dict[str, tuple] = {}

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

    def prefix(self, pre: str) -> tuple:
        hit = self.prefix_cache.get(pre)
        if hit is not None:
            return hit
        m = _PREFIX.search(pre[-PREFIX_SPAN:])
        if m:
            hit = (m.group("host"), m.group("pid"), m.group("tid"), int(m.group("dev")), m.group("loc"))
        else:
            hit = (None, None, None, None, None)
        if len(self.prefix_cache) >= MAX_CACHE:
            self.prefix_cache.clear()
        self.prefix_cache[pre] = hit
        host, pid = hit[0], hit[1]
        if host is not None and len(self.hosts) < MAX_SET:
            self.hosts.add(host)
            if pid is not None:
                self.processes.add((host, pid))
        return hit

    def note_version(self, name: str, version: str, line: str) -> None:
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

    def bucket(self, name: str) -> _Bucket:
        b = self.signals.get(name)
        if b is None:
            b = self.signals[name] = _Bucket(self.cap)
        return b
