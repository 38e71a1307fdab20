"""The grammar of NCCL, RCCL and PyTorch log lines: limits, enumerations, the regular
expressions of every line kind, and the bulk pattern that splits a chunk of bytes into
its frequent lines. Shared by the parser's parts (log.py, log_bulk.py, log_errors.py,
log_document.py); nothing here holds state.
"""

from __future__ import annotations

import re
from functools import lru_cache
from operator import itemgetter

# /2: the signals the finding rules read are facts of the document, and the findings are the
# diagnosis's (diag.analyzers.diagnosis.nccl_log), made from them; /1 carried its findings.
SCHEMA = "diag.nccl_log/2"
_NONE3 = (None,) * 3

MAX_EVIDENCE = 5


MAX_WARN_KINDS = 200


MAX_PEERS = 20000


MAX_RANKS = 100000


MAX_COMMS = 10000


MAX_CHAINS = 200


MAX_CACHE = 50000


MAX_SET = 100000


MAX_INTERFACES = 256  # (role, interface, address) triples kept


MAX_LINE = 1 << 20  # characters kept of one line


# ncclDataType_t and ncclRedOp_t (stable since NCCL 2.0; bfloat16 2.10, fp8 2.24).
DATATYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
             5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8),
             9: ("bfloat16", 2), 10: ("float8e4m3", 1), 11: ("float8e5m2", 1)}


REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


# Numeric algorithm / protocol ids of the TUNING lines (NCCL >= 2.12 order).
ALGOS = {0: "Tree", 1: "Ring", 2: "CollNetDirect", 3: "CollNetChain", 4: "NVLS", 5: "NVLSTree", 6: "PAT"}


PROTOS = {0: "LL", 1: "LL128", 2: "Simple"}


# A line prefix is host:pid:tid [dev] and a source location, far shorter than this; it is
# matched in the prefix's last PREFIX_SPAN characters, as a search from every start of a
# long one would take time quadratic in its length.
PREFIX_SPAN = 512
_PREFIX = re.compile(
    r"(?:(?<![^\s:\[\]()])(?P<host>[^\s:\[\]()]+)(?::(?P<pid>\d+):(?P<tid>\d+))?\s+)?\[(?P<dev>\d+)\]\s*+"
    r"(?P<loc>[^\s]{1,512}\.(?:cc|cpp|c|h|cu|hpp):\d+)?\s*$"
)


# Before NCCL 2.3 a line had no "NCCL" tag: "host:pid:tid [dev] INFO msg" and
# "host:pid:tid [dev] file.cu:line WARN msg" (its include/debug.h), and before that
# "WARN file.cu:line msg" on its own.
_OLD_LEVEL = re.compile(r"\[\d{1,4}\] (?:\S{1,512}\.(?:cc|cpp|c|h|cu|hpp):\d+ )?(INFO|WARN) ")
_OLDEST_WARN = re.compile(r"WARN (\S{1,512}\.(?:cc|cpp|c|h|cu|hpp):\d+) ")


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
    r"(?:(?<!\w)(\w+):\s*)?(?<!\d)(\d+) Bytes -> Algo (\w+) proto (\w+)(?: time (-?[\d.]+))?"
    r"(?: channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?"
)


_SUMMARY = re.compile(r"(?<!\d)(\d+) (coll|collnet|nvls|p2p) channels(?! per)")


_CHAIN = re.compile(r"^(\S+\.(?:cc|cpp|c|h|cu|hpp)):(\d+) -> (\d+)(.*)$")


_ENV = re.compile(r"^(N?CCL_\w+|RCCL_\w+) set (?:by environment )?to (.*?)\.?\s*$")


_VERSION = re.compile(r"\b([NR]CCL) version\s*:?\s*(\d[\w.+\-:]*)")


_IP = re.compile(r"(?<![\w.\-])(?:\[0\])?[\w.\-]{1,64}:([0-9a-fA-F.:]{1,45})<\d+>")


# "[Proxy Service 0] Failed to execute operation Close from rank 0, retcode 3": what the
# proxy thread was doing, and for which local rank.
_PROXY_OP = re.compile(r"Failed to execute operation (\w{1,40}) from rank (\d{1,7})")


# Every "name:address<port>" of a Bootstrap, NET/Socket or NET/IB OOB line: the interface
# NCCL chose and its address (IPv6 with a scope, "fe80::1%eth0", too).
_IFACE = re.compile(r"(?<![\w.\-])(?:\[\d{1,3}\])?([\w.\-]{1,64}):([0-9A-Za-z.:%\-]{1,64})<\d+>")


_IB_COMPLETION = re.compile(
    r"Got completion (?:from peer (\S+) )?with (?:error |status=)(?:(IBV_WC_\w+)\()?(\d+)\)?"
    r"(?:.*?opcode[ =](?:\w+\()?(\d+)\)?)?(?:.*?vendor[ _]err[ =]?(\d+))?"
)


_WATCHDOG = re.compile(
    r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(-?\d+), OpType=(\w+)"
    r"(?:, NumelIn=(-?\d+), NumelOut=(-?\d+))?, Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds"
)


_WORK_KV = re.compile(r"(?<!\w)(\w+(?:\(ms\))?)=([^,)\s]+)")


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


# The value is taken whole and its trailing comma and blanks cut in code (`json_value`): a
# lazy value before `,?\s*$` rescans a long run of blanks at every step.
_JSON_KV = re.compile(r'^\s*"(\w+)"\s*:\s*(.*)$')


def json_value(raw: str) -> str:
    """A `"key": value,` line's value without its trailing comma and blanks."""
    raw = raw.rstrip()
    return raw[:-1].rstrip() if raw.endswith(",") else raw


_PROM = re.compile(r"^(nccl_\w+)\{([^}]*)\}\s+(\S+)")


_PROM_LABEL = re.compile(r'(?<!\w)(\w+)="([^"]*)"')


_LOC_END = re.compile(r"(?<!\S)(\S+\.(?:cc|cpp|c|h|cu|hpp):\d+)\s*$")


_LOC_START = re.compile(r"(?<!\S)\[?(\S+\.(?:cc|cpp|c|h|cu|hpp):\d+)\]?:?\s+")


# A WARN that reports a failure: failed/error words, a non-zero retcode or res=, an error
# code at the end of a "-> N" chain. Plugin lookups NCCL falls back from are not failures.
_WARN_FAILURE = re.compile(r"fail|error|retcode\s*[:=]?\s*[1-9]|\bres\s*=\s*[1-9]|->\s*[1-9]\d*\s*$|unable to|"
                           r"cannot|could not|refused|abort", re.I)
_WARN_BENIGN = re.compile(r"Failed to (?:find|load|open) \S*plugin|NET/Plugin|nccl(?:Net|Tuner|CollNet)Plugin|"
                          r"Could not find real path|NCCL_\w+ set by environment", re.I)
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


_LINE_ERRORS = (ValueError, IndexError, KeyError, TypeError, AttributeError)


def warn_message(line: str) -> str:
    """A WARN line's own message, after its prefix and the "NCCL WARN" tag (or, before NCCL
    2.3, the bare "WARN" and the source location that came with it)."""
    if "NCCL WARN" in line:
        return line.split("NCCL WARN", 1)[-1].strip()
    m = _UNTAGGED_WARN.search(line)
    return line[m.end():].strip() if m else line.strip()


_UNTAGGED_WARN = re.compile(r"(?:^|\] )(?:\S{1,512}:\d+ )?WARN (?:\S{1,512}:\d+ )?")


class _Bucket:
    """A counter with at most `cap` example lines."""

    __slots__ = ("count", "lines", "cap", "data", "full")

    def __init__(self, cap: int):
        self.count = 0
        self.lines: list[str] = []
        self.cap = cap
        self.data: dict = {}
        self.full = cap <= 0
