"""Stream NCCL_DEBUG=INFO logs (and RCCL, PyTorch watchdog, flight-recorder and NCCL
Inspector output) into one `diag.nccl_log/1` document with findings.

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

import gzip
import io
import json
import re
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from itertools import compress
from operator import itemgetter
from pathlib import Path

from diag.analyzers.nccl.ib_status import ib_status_by_name, nccl_result
from diag.errors import DiagInputError

SCHEMA = "diag.nccl_log/1"

MAX_EVIDENCE = 5
MAX_WARN_KINDS = 200
MAX_PEERS = 20000
MAX_RANKS = 100000
MAX_COMMS = 10000
MAX_CHAINS = 200
MAX_CACHE = 50000
MAX_SET = 100000
MAX_LINE = 1 << 20  # characters kept of one line

# ncclDataType_t and ncclRedOp_t (stable since NCCL 2.0; bfloat16 2.10, fp8 2.24).
DATATYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
             5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8),
             9: ("bfloat16", 2), 10: ("float8e4m3", 1), 11: ("float8e5m2", 1)}
REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
# Numeric algorithm / protocol ids of the TUNING lines (NCCL >= 2.12 order).
ALGOS = {0: "Tree", 1: "Ring", 2: "CollNetDirect", 3: "CollNetChain", 4: "NVLS", 5: "NVLSTree", 6: "PAT"}
PROTOS = {0: "LL", 1: "LL128", 2: "Simple"}

_PREFIX = re.compile(
    r"(?:(?P<host>[^\s:\[\]()]+)(?::(?P<pid>\d+):(?P<tid>\d+))?\s+)?\[(?P<dev>\d+)\]\s*"
    r"(?P<loc>[^\s]+\.(?:cc|cpp|c|h|cu|hpp):\d+)?\s*$"
)
_VIA = re.compile(
    r"^(?:Channel|Ring) (\d+)(?:/(\d+))? : (\d+)(?:\[([0-9a-fA-F]+)\])? -> (\d+)(?:\[([0-9a-fA-F]+)\])?"
    r"(?: \[(send|receive)\])? via (.+?)\s*$"
)
_RING = re.compile(r"^Channel (\d+)/(\d+) :((?:\s+-?\d+)+)\s*$")
_INIT = re.compile(
    r"comm (0x[0-9a-fA-F]+) rank (\d+) n[Rr]anks (\d+)(?: nNodes (\d+) localRanks (\d+) localRank (\d+))?"
    r"(?: cudaDev (\d+))?(?: nvmlDev (\d+))?(?: busId ([0-9a-fA-F]+))?(?: commId (0x[0-9a-fA-F]+))?"
    r"(?:.*- (Init \w+))?"
)
_COLL_REST = re.compile(
    r"opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) op (\d+) "
    r"root (-?\d+) comm (0x[0-9a-fA-F]+|\(nil\)) \[nranks=(\d+)\]"
)
_TUNE = re.compile(
    r"(?:(\w+):)?\s*(\d+) Bytes -> Algo (\w+) proto (\w+)(?: time (-?[\d.]+))?"
    r"(?: channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?"
)
_SUMMARY = re.compile(r"(\d+) (coll|collnet|nvls|p2p) channels(?! per)")
_CHAIN = re.compile(r"^(\S+\.(?:cc|cpp|c|h|cu|hpp)):(\d+) -> (\d+)(.*)$")
_ENV = re.compile(r"^(N?CCL_\w+|RCCL_\w+) set (?:by environment )?to (.*?)\.?\s*$")
_VERSION = re.compile(r"\b([NR]CCL) version\s*:?\s*(\d[\w.+\-:]*)")
_IP = re.compile(r"(?:\[0\])?[\w.\-]+:([0-9a-fA-F.:]+)<\d+>")
_IB_COMPLETION = re.compile(
    r"Got completion (?:from peer (\S+) )?with (?:error |status=)(?:(IBV_WC_\w+)\()?(\d+)\)?"
    r"(?:.*?opcode[ =](?:\w+\()?(\d+)\)?)?(?:.*?vendor[ _]err[ =]?(\d+))?"
)
_WATCHDOG = re.compile(
    r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(-?\d+), OpType=(\w+)"
    r"(?:, NumelIn=(-?\d+), NumelOut=(-?\d+))?, Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds"
)
_WORK_KV = re.compile(r"(\w+(?:\(ms\))?)=([^,)\s]+)")
_RANK_TAG = re.compile(r"\[Rank (\d+)\]")
_RAN_FOR = re.compile(r"ran for (\d+) milliseconds")
_WD_STATE = re.compile(
    r"\[(?:PG (?:ID )?(\S+)(?: PG GUID (\S+))? )?Rank (\d+)\] (?:Exception \(either an error or timeout\) "
    r"detected by watchdog at work|Timeout at NCCL work): (\d+), last enqueued NCCL work: (-?\d+), "
    r"last completed NCCL work: (-?\d+)"
)
_DESYNC_JOINED = re.compile(r"\[([\d,\s]+)\] joined but didn't finish collective #(\d+)")
_DESYNC_FINISHED = re.compile(r"\[([\d,\s]+)\] finished collective #(\d+), but didn't join collective #(\d+)")
_DESYNC_LAGGING = re.compile(r"ranks \[([\d,\s]+)\] are the lagging ranks")
_FR_NOT_ALL = re.compile(r"Not all ranks joining collective (\d+) at entry (\d+)")
_FR_MISSING = re.compile(r"missing ranks: \{([\d,\s]*)\}")
_JSON_KV = re.compile(r'^\s*"(\w+)"\s*:\s*(.*?),?\s*$')
_PROM = re.compile(r"^(nccl_\w+)\{([^}]*)\}\s+(\S+)")
_PROM_LABEL = re.compile(r'(\w+)="([^"]*)"')
_LOC_END = re.compile(r"(\S+\.(?:cc|cpp|c|h|cu|hpp):\d+)\s*$")
_LOC_START = re.compile(r"\[?(\S+\.(?:cc|cpp|c|h|cu|hpp):\d+)\]?:?\s+")

_SOCKET_WORDS = ("Connection closed by remote peer", "Connection refused", "Connection reset",
                 "socketFinalizeAccept", "socketProgress", "socketPoll", "Broken pipe", "Net : Connection",
                 "Call to connect", "Call to recv", "socketStartConnect", "socketWait")

_FR_KEYS = {"profiling_name", "collective_seq_id", "state", "timeout_ms", "last_enqueued_collective",
            "last_started_collective", "last_completed_collective", "is_p2p", "pg_config", "entries"}
_INSPECTOR_KEYS = {"coll", "coll_sn", "coll_msg_size_bytes", "coll_exec_time_us", "coll_algobw_gbs",
                   "coll_busbw_gbs", "n_ranks", "nnodes", "hostname", "inspector_output_format_version"}


def _add_counts(into: dict, other: dict) -> None:
    for k, v in other.items():
        into[k] = into.get(k, 0) + v


def _ranks_list(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _has_giant_line(data: bytes) -> bool:
    """Whether `data` may hold a line longer than MAX_LINE: such a line covers a whole aligned
    window of MAX_LINE/2 bytes, so a few newline searches decide it without a scan."""
    half = MAX_LINE // 2
    return any(data.find(b"\n", off, off + half) < 0 for off in range(0, len(data) - half + 1, half))


@lru_cache(maxsize=4096)
def _transport_kind(via: str) -> tuple:
    """(kind, label, gdrdma, pxn, finding signal) of a `via` string such as "NET/IB/0/GDRDMA",
    "NET/IB/0(4)/GDRDMA" (PXN through rank 4's NIC), "P2P/CUMEM/read", "SHM/direct/direct"."""
    parts = via.split("/")
    head = parts[0]
    gdrdma = pxn = False
    sig = None
    if head == "NET" and len(parts) > 1:
        kind = "NET/" + parts[1]
        gdrdma = "GDRDMA" in parts
        pxn = len(parts) > 2 and "(" in parts[2]
        if kind == "NET/Socket":
            sig = "via_net_socket"
        elif not gdrdma:
            sig = "ib_no_gdrdma" if kind.startswith("NET/IB") else "net_no_gdrdma"
    elif head == "P2P" and len(parts) > 1:
        kind = "P2P/direct" if parts[1].startswith("direct") else "P2P/" + parts[1]
    elif head.startswith("SHM"):
        kind = "SHM"
        sig = "via_shm"
    else:
        kind = head
    return kind, kind + ("/GDRDMA" if gdrdma else ""), gdrdma, pxn, sig


_TUNE_KEY = itemgetter(0, 1, 2, 3, 5, 6)  # op, bytes, algo, proto, channel lo, hi (not the time)

# Bulk mode (`NcclLogParser.feed_bytes`): one pattern over a whole chunk of bytes, each match
# one whole line: a standard prefix (`host:pid:tid [dev] ` after an optional srun/Ray/quote
# lead, or the redacted `node [0] ` / `[0] `), the tag, then one of the frequent message kinds.
# Each alternative accepts only what the per-line parser reads identically (ASCII classes
# are subsets of the str ones), so anything else falls through to the per-line parser.
_B_LINE = re.compile(
    # possessive quantifiers: each class stops at a character it cannot hold, so no backtracking
    rb"\n((?:[\w.\-]++(?::\d++:\d++)? )?\[\d++\] |(?:\([^)\n]*+\) |\[\d++\] |> |\d++: )"
    rb"(?:[\w.\-]++(?::\d++:\d++)? )?\[\d++\] )NCCL INFO (?:"
    # 2-6 COLL: op, opCount, "count N datatype D op R" (one group: fewer objects), comm, nranks
    rb"(\w++): opCount ([0-9a-fA-F]++) sendbuff [!-~]++ recvbuff [!-~]++ (count \d++ datatype \d++ op \d++) "
    rb"root -?\d++ comm (0x[0-9a-fA-F]++|\(nil\)) \[nranks=(\d++)\][^\n]*+"
    # 7-11 transport: channel, from, to, direction, via (the rest of the line, trailing blanks off)
    rb"|(?:Channel|Ring) (\d++)(?:/\d++)? : (\d++)(?:\[[0-9a-fA-F]++\])? -> (\d++)(?:\[[0-9a-fA-F]++\])?"
    rb"(?: \[(send|receive)\])? via ([!-~](?:[^\n]*[!-~])?)[ \t\r\f\v]*(?=\n)"
    # 12-17 per-call TUNING: op, bytes, algo, proto, channel lo, hi (not a COLL line)
    rb"|(\w++): (\d++) Bytes -> Algo (\w++) proto (\w++)(?: time -?[\d.]++)?"
    rb"(?: channel\{Lo\.\.Hi\}=\{(\d++)\.\.(\d++)\})?(?![^\n]*: opCount )[^\n]*+"
    # 18 INFO lines whose first word the per-line parser ignores
    rb"|(Setting|P2P|threadThresholds|DMA-BUF|TUNER/Plugin:|Launch|NET/Plugin:?)(?= |\n)[^\n]*+)"
)
_B_K = _B_LINE.groups + 1  # items per match in _B_LINE.split(): the text before it, then the groups
_NONE3 = (None,) * 3
_LINE_ERRORS = (ValueError, IndexError, KeyError, TypeError, AttributeError)


class _Bucket:
    """A counter with at most `cap` example lines."""

    __slots__ = ("count", "lines", "cap", "data", "full")

    def __init__(self, cap: int):
        self.count = 0
        self.lines: list[str] = []
        self.cap = cap
        self.data: dict = {}
        self.full = cap <= 0


class NcclLogParser:
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
        m = _PREFIX.search(pre)
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
        if ("CCL" in line or "atchdog" in line or "ollective" in line or '"' in line or "opCount" in line
                or "ersion" in line or "ccl" in line or "rank" in line):
            self._other(line.rstrip())

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

    # -- bulk mode: the frequent line kinds of a large log, a whole chunk at a time ------------
    def feed_bytes(self, chunk: bytes, _glued: bool = True) -> None:
        """`feed_all` for a chunk of whole lines, each ending in a newline (the undecoded file).

        One compiled regular expression splits the chunk in C: COLL, transport, per-call
        TUNING and no-op INFO lines with a standard prefix come out as field tuples that are
        counted with a Counter, so Python runs once per distinct tuple instead of once per
        line and only distinct values are decoded. Every other line (init, WARN, errors,
        watchdog, odd prefixes) is decoded and goes to the per-line parser."""
        if _has_giant_line(chunk):
            self._feed_text(chunk)  # cut lines exactly as the per-line reader does
            return
        buf = b"\n" + chunk
        parts = _B_LINE.split(buf)
        n = len(parts) // _B_K
        if not n:
            self._feed_text(chunk)
            return
        rest = b"".join(parts[::_B_K])
        if buf.count(b"NCCL INFO ") != rest.count(b"NCCL INFO ") + n:
            # a matched line holds a second tag (lines glued by concurrent writers), which the
            # per-line parser reads from its last tag: that line goes to it, in order
            if _glued:
                self._feed_glued(chunk)
            else:
                self._feed_text(chunk)
            return
        self.lines += n
        self.nccl_lines += n
        cache, prefix = self._prefix_cache, self._prefix
        for pre in set(parts[1::_B_K]):
            pre = pre.decode("utf-8", "replace")
            if pre not in cache:
                prefix(pre)
        want: set[str] = set()  # signals counted in bulk whose evidence has room
        if any(parts[2::_B_K]):
            self._coll_bulk(parts)
        if any(parts[7::_B_K]):
            self._via_bulk(parts, want)
        if any(parts[12::_B_K]):
            self._tune_bulk(parts, want)
        if want:
            self._bulk_evidence(buf, want)
        if len(rest) > 1:
            self._feed_text(rest[1:])

    def _feed_glued(self, chunk: bytes) -> None:
        """`feed_bytes` for a chunk holding lines with two or more INFO tags: the runs of
        lines between them in bulk, those lines one by one, in file order."""
        start = pos = 0
        for ln in chunk.split(b"\n")[:-1]:
            end = pos + len(ln) + 1
            if ln.count(b"NCCL INFO ") > 1:
                if pos > start:
                    self.feed_bytes(chunk[start:pos], _glued=False)
                self._feed_text(chunk[pos:end])
                start = end
            pos = end
        if start < len(chunk):
            self.feed_bytes(chunk[start:], _glued=False)

    def _feed_text(self, chunk: bytes) -> None:
        lines = chunk.decode("utf-8", errors="replace").split("\n")
        if lines[-1] == "":
            lines.pop()
        if lines and max(map(len, lines)) > MAX_LINE:
            lines = [ln[:MAX_LINE] for ln in lines]
        self.feed_all(lines)

    def _coll_bulk(self, parts: list) -> None:
        # the columns hold None for the matches of other kinds: counted too, then dropped
        ops, opcs, comms = parts[2::_B_K], parts[3::_B_K], parts[5::_B_K]
        keys = Counter(zip(ops, parts[4::_B_K], parts[6::_B_K]))
        keys.pop(_NONE3, None)
        raw = self._coll_raw
        for (op, mid, nranks), n in keys.items():
            _, count, _, dt, _, red = mid.decode().split(" ")
            key = (op.decode(), count, dt, red, nranks.decode())
            raw[key] = raw.get(key, 0) + n
        if len(self._coll_comms) < MAX_COMMS:
            self._coll_comms.update((op.decode(), comm.decode()) for op, comm in set(zip(ops, comms)) if op)
        last = dict(zip(comms, opcs))
        last.pop(None, None)
        self._opc_last.update((comm.decode(), opc.decode()) for comm, opc in last.items())
        if len(raw) >= MAX_CACHE:
            self._flush_colls()

    def _via_bulk(self, parts: list, want: set) -> None:
        sel = parts[7::_B_K]
        tuples = compress(zip(sel, *(parts[i::_B_K] for i in range(8, 12))), sel)
        for (ch, src, dst, direction, via), n in Counter(tuples).items():
            sig = self._add_transport(ch.decode(), src.decode(), dst.decode(),
                                      direction.decode() if direction else None, via.decode("utf-8", "replace"), n)
            if sig is not None:
                b = self._bucket(sig)
                b.count += n
                if not b.full:
                    want.add(sig)

    def _tune_bulk(self, parts: list, want: set) -> None:
        sel = parts[12::_B_K]
        tuples = list(compress(zip(sel, *(parts[i::_B_K] for i in range(13, 18))), sel))
        for fields, n in Counter(tuples).items():
            self._add_tune(tuple(x.decode() if x is not None else None for x in fields), n)
        b = self._bucket("tuning_choice")
        b.count += len(tuples)
        if not b.full:
            want.add("tuning_choice")

    def _bulk_evidence(self, buf: bytes, want: set) -> None:
        """The first bulk-counted lines as evidence of the signals in `want` (counts are already
        in). Runs only while one of their buckets has room: over the first chunks of a file."""
        for m in _B_LINE.finditer(buf):
            if m.group(7):
                sig = _transport_kind(m.group(11).decode("utf-8", "replace"))[4]
            elif m.group(12):
                sig = "tuning_choice"
            else:
                continue
            if sig in want:
                b = self.signals[sig]
                b.lines.append(m.group(0)[1:].decode("utf-8", "replace").rstrip()[:1000])
                b.full = len(b.lines) >= b.cap
                if b.full:
                    want.discard(sig)
                    if not want:
                        return

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
        elif msg.startswith("NET/IB") and "No device found" in msg:
            self.signal("ib_no_device", line)
        elif msg.startswith("NET/Socket") and "Using" in msg:
            m = _IP.search(msg)
            if m and len(self.ips) < MAX_SET:
                self.ips.add(m.group(1))
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

    def _chain(self, line: str, pfx: tuple, m: re.Match) -> None:
        file, lineno, code, rest = m.groups()
        tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
        frames = self._open_chain.get(tkey)
        if frames is None:
            if len(self._open_chain) >= MAX_CACHE:
                self._open_chain.clear()
            frames = self._open_chain[tkey] = []
        if len(frames) < 64:
            frames.append((f"{file}:{lineno}", int(code), "[Async thread]" in rest or "[Proxy Thread]" in rest))
        b = self.signal("error_chain", line)
        b.data["last_code"] = int(code)
        if file.endswith(("init.cc", "bootstrap.cc")) or file.startswith("init"):
            self.signal("init_failure", line)

    def _close_chains(self) -> None:
        for frames in self._open_chain.values():
            self._record_chain(frames)
        self._open_chain.clear()

    def _record_chain(self, frames: list) -> None:
        """One finished `file.cc:line -> code` chain (innermost frame first), counted by its frames."""
        if not frames:
            return
        key = tuple(f for f, _, _ in frames)
        c = self.chains.get(key)
        if c is None:
            if len(self.chains) >= MAX_CHAINS:
                return
            code = frames[0][1]
            c = self.chains[key] = {"code": code, "code_name": nccl_result(code)["name"], "frames": list(key),
                                    "origin": key[0], "async": any(a for _, _, a in frames), "count": 0}
        c["count"] += 1

    # -- NCCL WARN -------------------------------------------------------------------------
    def _warn(self, line: str, pre: str, msg: str) -> None:
        self.warn_total += 1
        pfx = self._prefix(pre)
        loc = pfx[4]
        if loc is None:
            # location after odd prefixes, or at the start of the message ("[file.cc:12] ...")
            m = _LOC_END.search(pre) or _LOC_START.match(msg)
            loc = m.group(1) if m else None
            if m is not None and m.re is _LOC_START:
                msg = msg[m.end():]
        short = loc.split("/src/", 1)[-1] if loc else None
        kind = short or re.sub(r"\d+", "N", msg[:60])
        w = self.warn_kinds.get(kind)
        if w is None:
            if len(self.warn_kinds) >= MAX_WARN_KINDS:
                kind = "other"
                w = self.warn_kinds.get(kind)
            if w is None:
                w = self.warn_kinds[kind] = {"kind": kind, "location": short, "message": msg[:300], "count": 0,
                                             "hosts": [], "evidence": []}
        w["count"] += 1
        if pfx[0] and pfx[0] not in w["hosts"] and len(w["hosts"]) < 64:
            w["hosts"].append(pfx[0])
        if len(w["evidence"]) < self.cap:
            w["evidence"].append(line[:1000])
        # a WARN starts a new error chain on this thread
        tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
        if tkey in self._open_chain:
            self._record_chain(self._open_chain.pop(tkey))
        self._classify_warn(line, msg, short)

    def _classify_warn(self, line: str, msg: str, loc: str | None) -> None:
        if "Got completion" in msg:
            m = _IB_COMPLETION.search(msg)
            if m:
                peer, sname, code, opcode, vendor = m.groups()
                code = int(code)
                if sname and ib_status_by_name(sname) is not None:
                    code = ib_status_by_name(sname)
                self.signal("ib_completion_error", line, statuses=[code], peers=[peer] if peer else None,
                            vendor=[int(vendor)] if vendor else None)
                return
        if ("socket" in (loc or "")) or any(w in msg for w in _SOCKET_WORDS):
            self.signal("socket_error", line)
            if "bootstrap" in msg.lower():
                self.signal("init_failure", line)
            return
        if "libibverbs" in msg:
            self.signal("ibverbs_missing", line)
        elif "iommu" in msg:
            self.signal("rocm_iommu", line)
        elif "Failed to find CUDA library" in msg or "libcuda" in msg:
            self.signal("cuda_library_missing", line)
        elif "Could not find a path" in msg or "falling back" in msg:
            self.signal("topology_fallback", line)
        elif "async fatal event" in msg or "NET/IB" in msg:
            self.signal("ib_error", line)
        elif "Cuda failure" in msg or "CUDA failure" in msg or "Hip failure" in msg:
            self.signal("cuda_failure", line)
        elif loc and (loc.endswith(("init.cc", "bootstrap.cc")) and ("fail" in msg.lower() or "error" in msg.lower())):
            self.signal("init_failure", line)
        elif "Timeout" in msg or "timeout" in msg:
            self.signal("nccl_timeout_warn", line)

    # -- lines without an NCCL INFO/WARN tag ----------------------------------------------
    def _other(self, line: str) -> None:
        s = line.strip()
        if "Watchdog caught collective operation timeout" in s or "WorkNCCL(" in s:
            self._watchdog(s)
            return
        if "detected by watchdog at work" in s or "Timeout at NCCL work" in s:
            m = _WD_STATE.search(s)
            if m:
                pg, guid, rank, work, enq, done = m.groups()
                key = (pg or "?", int(rank))
                if key in self.wd_state or len(self.wd_state) < MAX_RANKS:
                    self.wd_state[key] = {"pg": pg, "rank": int(rank), "work": int(work),
                                          "last_enqueued": int(enq), "last_completed": int(done)}
                self.signal("watchdog_state", s)
            return
        if "joined but didn't finish" in s or "but didn't join collective" in s or "lagging ranks" in s:
            self._desync_report(s)
            return
        if "Not all ranks joining collective" in s or "missing ranks:" in s:
            self._fr_analysis(s)
            return
        if ": opCount " in s:
            self.nccl_lines += 1
            self._coll(s, s)
            return
        if "CCL version" in s:
            m = _VERSION.search(s)
            if m:
                self.nccl_lines += 1
                self._version(m.group(1), m.group(2), s)
            return
        if s.startswith(("HIP version", "ROCm version", "Librccl path")):
            k, _, v = s.partition(":")
            self.rccl[k.strip().lower().replace(" ", "_")] = v.strip()
            return
        if "NCCL error" in s or "DistBackendError" in s or "ncclSystemError" in s or "ncclRemoteError" in s \
                or "ncclInternalError" in s or "ncclUnhandledCudaError" in s or "NCCL failure" in s:
            self.nccl_lines += 1
            self.signal("nccl_error", s)
            if "Test NCCL failure" in s or "NCCL failure" in s:
                self.signal("test_failure", s)
            return
        if s.startswith("nccl_") and "{" in s:
            self._prometheus(s)
            return
        if '"' in s:
            if s.startswith("{") and '"coll_perf"' in s:
                self._inspector_json(s)
                return
            m = _JSON_KV.match(s)
            if m:
                self._json_kv(m.group(1), m.group(2), s)
            return
        if "collective state:" in s or s.startswith(("collective:", "expected ranks:", "group info:")):
            self._fr_analysis(s)

    def _watchdog(self, s: str) -> None:
        m = _WATCHDOG.search(s)
        if m:  # the usual layout, one regex
            rank, seq, op, numel_in, numel_out, timeout, ran = m.groups()
            fields = None
        else:  # other field orders / extra fields
            i = s.find("WorkNCCL(")
            if i < 0:
                return
            fields = dict(_WORK_KV.findall(s[i + 9:i + 400]))
            rank_m, ran_m = _RANK_TAG.search(s), _RAN_FOR.search(s)
            rank = rank_m.group(1) if rank_m else None
            ran = ran_m.group(1) if ran_m else None
            seq, op = fields.get("SeqNum", "-1"), fields.get("OpType", "?")
            numel_in, numel_out, timeout = fields.get("NumelIn"), fields.get("NumelOut"), fields.get("Timeout(ms)")
        try:
            key = (op, int(seq), int(timeout) if timeout else None)
        except ValueError:
            return
        t = self.timeouts.get(key)
        if t is None:
            if len(self.timeouts) >= 1000:
                return
            t = self.timeouts[key] = {"op": op, "seq": key[1], "timeout_ms": key[2], "ran_ms": None,
                                      "numel_in": None, "numel_out": None, "ranks": set(), "count": 0}
        t["count"] += 1
        if rank is not None and len(t["ranks"]) < MAX_SET:
            t["ranks"].add(int(rank))
        if ran is not None:
            t["ran_ms"] = max(t["ran_ms"] or 0, int(ran))
        if numel_in is not None and numel_in.lstrip("-").isdigit():
            t["numel_in"] = int(numel_in)
        if numel_out is not None and numel_out.lstrip("-").isdigit():
            t["numel_out"] = int(numel_out)
        self.signal("collective_timeout", s)

    def _desync_report(self, s: str) -> None:
        rep = None
        m = _DESYNC_JOINED.search(s)
        if m:
            rep = {"kind": "joined_not_finished", "ranks": _ranks_list(m.group(1)), "seq": int(m.group(2))}
        m = m or _DESYNC_FINISHED.search(s)
        if rep is None and m:
            rep = {"kind": "finished_not_joined", "ranks": _ranks_list(m.group(1)), "seq": int(m.group(3))}
        if rep is None:
            m = _DESYNC_LAGGING.search(s)
            if m:
                rep = {"kind": "never_joined", "ranks": _ranks_list(m.group(1)), "seq": None}
        if rep is not None and len(self.desync_reports) < 100:
            rep["ranks"] = rep["ranks"][:1000]
            self.desync_reports.append(rep)
        self.signal("desync_report", s)

    def _fr_analysis(self, s: str) -> None:
        m = _FR_NOT_ALL.search(s)
        if m:
            if len(self.fr["analysis"]) < 100:
                self.fr["analysis"].append({"collective_seq": int(m.group(1)), "entry": int(m.group(2)),
                                            "missing_ranks": [], "collective": None, "state": None})
            self.signal("fr_mismatch", s)
            return
        if not self.fr["analysis"]:
            return
        cur = self.fr["analysis"][-1]
        m = _FR_MISSING.search(s)
        if m:
            cur["missing_ranks"] = _ranks_list(m.group(1))[:1000]
            self.signal("fr_mismatch", s)
        elif s.startswith("collective:"):
            cur["collective"] = s.split(":", 1)[1].strip()
        elif s.startswith("collective state:"):
            cur["state"] = s.split(":", 1)[1].strip()
        elif s.startswith("expected ranks:"):
            try:
                cur["expected_ranks"] = int(s.split(":", 1)[1])
            except ValueError:
                pass
        elif s.startswith("group info:"):
            cur["group"] = s.split(":", 1)[1].strip()

    def _json_kv(self, key: str, raw: str, s: str) -> None:
        if key in _FR_KEYS:
            self._fr_kv(key, raw, s)
        if key in _INSPECTOR_KEYS:
            self._insp_kv(key, raw, s)

    @staticmethod
    def _scalar(raw: str):
        raw = raw.strip().rstrip(",")
        try:
            return json.loads(raw)
        except ValueError:
            return raw.strip('"')

    def _fr_kv(self, key: str, raw: str, s: str) -> None:
        v = self._scalar(raw)
        fr = self.fr
        fr["seen"] = True
        if key == "profiling_name":
            fr["entries"] += 1
            fr["ops"][v] = fr["ops"].get(v, 0) + 1 if len(fr["ops"]) < 256 or v in fr["ops"] else 0
            self._fr_cur = {"op": v}
        elif key == "state" and self._fr_cur is not None:
            fr["states"][str(v)] = fr["states"].get(str(v), 0) + 1
            if v not in ("completed",):
                self.signal("fr_incomplete", s)
        elif key == "collective_seq_id" and self._fr_cur is not None:
            self._fr_cur["seq"] = v
            if isinstance(v, int):
                fr["max_seq"] = max(fr.get("max_seq", -1), v)
        elif key == "timeout_ms":
            fr["timeout_ms"] = v
        elif key.startswith("last_"):
            fr["pg_status"][key] = v
        self.signal("flight_recorder", s)

    def _insp_kv(self, key: str, raw: str, s: str) -> None:
        v = self._scalar(raw)
        cur = self._insp_cur
        if key == "n_ranks":
            self.inspector["n_ranks"] = v
        elif key == "nnodes":
            self.inspector["nnodes"] = v
        elif key == "hostname" and isinstance(v, str) and len(self.hosts) < MAX_SET:
            self.hosts.add(v)
        elif key == "inspector_output_format_version":
            self.inspector["format"] = v
        else:
            cur[key] = v
            if key == "coll_busbw_gbs":
                self._insp_record(dict(cur), s)
                cur.clear()

    def _inspector_json(self, s: str) -> None:
        try:
            obj = json.loads(s)
        except ValueError:
            return
        hdr = obj.get("header", {}) if isinstance(obj, dict) else {}
        meta = obj.get("metadata", {}) if isinstance(obj, dict) else {}
        if hdr.get("n_ranks") is not None:
            self.inspector["n_ranks"] = hdr["n_ranks"]
        if meta.get("hostname") and len(self.hosts) < MAX_SET:
            self.hosts.add(meta["hostname"])
        perf = obj.get("coll_perf") if isinstance(obj, dict) else None
        if isinstance(perf, dict):
            self._insp_record(perf, s)

    def _insp_record(self, rec: dict, s: str) -> None:
        coll = str(rec.get("coll", "?"))
        a = self.inspector["colls"].get(coll)
        if a is None:
            if len(self.inspector["colls"]) >= 64:
                return
            a = self.inspector["colls"][coll] = {"coll": coll, "count": 0, "busbw_sum": 0.0, "busbw_max": None,
                                                 "max_msg_size_bytes": 0, "exec_time_us_sum": 0.0}
        self.inspector["records"] += 1
        a["count"] += 1
        bw = rec.get("coll_busbw_gbs")
        if isinstance(bw, int | float):
            a["busbw_sum"] += bw
            a["busbw_max"] = bw if a["busbw_max"] is None else max(a["busbw_max"], bw)
        size = rec.get("coll_msg_size_bytes") or rec.get("message_size")
        if isinstance(size, int):
            a["max_msg_size_bytes"] = max(a["max_msg_size_bytes"], size)
        t = rec.get("coll_exec_time_us")
        if isinstance(t, int | float):
            a["exec_time_us_sum"] += t
        self.signal("inspector", s)

    def _prometheus(self, s: str) -> None:
        m = _PROM.match(s)
        if not m:
            return
        name, labels, value = m.groups()
        lab = dict(_PROM_LABEL.findall(labels))
        try:
            v = float(value)
        except ValueError:
            return
        if lab.get("node") and len(self.hosts) < MAX_SET:
            self.hosts.add(lab["node"])
        if name == "nccl_bus_bandwidth_gbs":
            self._insp_record({"coll": lab.get("collective", "?"), "coll_busbw_gbs": v}, s)
            if lab.get("nranks", "").isdigit():
                self.inspector["n_ranks"] = self.inspector["n_ranks"] or int(lab["nranks"])
        else:
            self.signal("inspector", s)

    # -- merging (parallel parsing of one large file in byte ranges) ---------------------
    def merge(self, o: NcclLogParser) -> None:
        """Fold the state of a parser that read a later part of the input into this one."""
        o._close_chains()
        o._flush_colls()
        self._flush_colls()
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
        self.env.update(o.env)
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
    def result(self) -> dict:
        from diag.analyzers.nccl.findings import evaluate

        self._close_chains()
        self._flush_colls()
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
        peers = sorted(({**p, "channels": sorted(int(c) for c in p["channels"])} for p in self.peers.values()),
                       key=lambda p: (p["from"], p["to"], p["via"]))
        net_kinds = {k: v for k, v in self.by_kind.items() if k.startswith("NET/")}
        transports = {
            "connections": sum(self.by_kind.values()),
            "by_kind": dict(sorted(self.by_kind.items(), key=lambda kv: -kv[1])),
            "network": sorted(self.net_used, key=lambda n: -self.net_used[n]),
            "nics": self.nics,
            "gdrdma": sum(v for k, v in net_kinds.items() if k.endswith("/GDRDMA")),
            "no_gdrdma": sum(v for k, v in net_kinds.items() if not k.endswith("/GDRDMA")),
            "pxn": self.pxn,
            "peers": peers,
            "peers_dropped": self.peers_dropped,
        }
        rings = [{"channel": ch, "channels": n, "order": order} for (ch, n), order in sorted(self.rings.items())]
        tuning = {
            "choices": sorted(self.tune_choices.values(), key=lambda c: -c["calls"]),
            "table": self.tune_table,
            "env": {k: v for k, v in self.env.items() if k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS",
                                                               "NCCL_MIN_NCHANNELS", "NCCL_TUNER_PLUGIN")},
        }
        timeouts = [{**{k: v for k, v in t.items() if k != "ranks"}, "ranks": sorted(t["ranks"])}
                    for t in sorted(self.timeouts.values(), key=lambda t: (t["seq"], t["op"]))]
        insp = None
        if self.inspector["records"]:
            insp = {"records": self.inspector["records"], "n_ranks": self.inspector["n_ranks"],
                    "nnodes": self.inspector["nnodes"], "format": self.inspector.get("format"),
                    "collectives": [{"coll": a["coll"], "count": a["count"],
                                     "avg_busbw_gbps": a["busbw_sum"] / a["count"] if a["count"] else None,
                                     "max_busbw_gbps": a["busbw_max"],
                                     "max_msg_size_bytes": a["max_msg_size_bytes"] or None,
                                     "avg_exec_time_us": a["exec_time_us_sum"] / a["count"] if a["count"] else None}
                                    for a in self.inspector["colls"].values()]}
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
            "error_chains": sorted(self.chains.values(), key=lambda c: -c["count"]),
            "timeouts": timeouts,
            "watchdog": sorted(self.wd_state.values(), key=lambda w: (str(w["pg"]), w["rank"])),
            "desync_reports": self.desync_reports,
            "flight_recorder": fr,
            "inspector": insp,
            "errors": [],
        }
        doc["findings"] = evaluate(doc, self.signals)
        return doc

    def _node_count(self) -> int | None:
        """Nodes in the job: the topology line, else distinct hosts / bootstrap addresses."""
        n = max(self.nnodes, len(self.hosts), len(self.ips))
        return n or None



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


def _open_text(path: Path):
    """A text stream over a plain or gzipped log; DiagInputError for empty/binary files."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError as exc:
        raise DiagInputError(f"cannot read: {exc.strerror or exc}", source=str(path)) from None
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as fh:
                head = fh.read(65536)
        except (OSError, EOFError):
            raise DiagInputError("not a readable gzip file", source=str(path)) from None
        opener = gzip.open
    else:
        opener = open
    if not head.strip():
        raise DiagInputError("empty file", source=str(path))
    if _looks_binary(head):
        raise DiagInputError("binary data, not a text log", source=str(path))
    return opener(path, "rt", encoding="utf-8", errors="replace")


def parse_lines(lines: Iterable[str], source: str | None = None, max_evidence: int = MAX_EVIDENCE) -> dict:
    """The diag.nccl_log/1 document of one stream of lines."""
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
        try:
            with _open_text(path) as fh:
                plain = isinstance(getattr(fh, "buffer", None), io.BufferedReader)  # not gzip
                big = jobs > 1 and plain and path.stat().st_size >= par.MIN_PARALLEL_BYTES
                if not big:  # undecoded chunks of whole lines (gzip: of the decompressed stream)
                    for chunk in par.line_chunks(fh.buffer, 0, None):
                        p.feed_bytes(chunk)
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


def summarize_for_diagnosis(log_doc: dict) -> list[str]:
    """Short sentences for the job report and the comm-bound diagnosis, most severe first,
    e.g. "NCCL fell back to TCP sockets between nodes"."""
    from diag.analyzers.nccl.findings import summary_sentences

    return summary_sentences(log_doc)
