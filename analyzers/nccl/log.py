"""Stream NCCL_DEBUG=INFO logs (and RCCL, PyTorch watchdog, flight-recorder and NCCL
Inspector output) into one `diag.nccl_log/2` document of facts; the findings are the
diagnosis's (diag.analyzers.diagnosis.nccl_log).

The parser is a state (log_state.LogState) and a table of line handlers, functions over it:
INFO lines by the first word of their message (log_info.INFO_HANDLERS; collectives, tuning
and transports in log_collectives), WARN lines, error chains and the lines that are not
NCCL's own in log_errors, whole chunks of bytes in log_bulk; log_document turns the state
into the document. It reads line by line and keeps only aggregates: counts, per-peer transports,
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

from collections.abc import Iterable
from pathlib import Path

from diag import inflate
from diag.analyzers.nccl import log_bulk, log_document
from diag.analyzers.nccl.log_errors import close_chains, other, warn
from diag.analyzers.nccl.log_grammar import _LINE_ERRORS, _OLD_LEVEL, _OLDEST_WARN, MAX_EVIDENCE
from diag.analyzers.nccl.log_info import INFO_HANDLERS, info, info_other
from diag.analyzers.nccl.log_state import LogState
from diag.errors import DiagInputError


class NcclLogParser(LogState):
    """Feed lines with `feed`, `feed_all` or `feed_bytes`, get the document with `result()`.
    Bounded memory."""

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
            info(self, line, line[:j], msg)
            return
        j = line.find("NCCL WARN ")
        if j >= 0:
            self.nccl_lines += 1
            warn(self, line.rstrip(), line[:j], line[j + 10:].rstrip())
            return
        if ("INFO " in line or "WARN " in line) and self._untagged(line):
            return
        if ("CCL" in line or "atchdog" in line or "ollective" in line or '"' in line or "opCount" in line
                or "ersion" in line or "ccl" in line or "rank" in line):
            other(self, line.rstrip())

    def _untagged(self, line: str) -> bool:
        """A line of NCCL before 2.3, without the "NCCL" tag (log_grammar._OLD_LEVEL): read as
        its INFO or WARN; False where the line is not one."""
        m = _OLD_LEVEL.search(line, max(0, line.find("[")))
        if m is not None:
            self.nccl_lines += 1
            pre, msg = line[:m.start(1)], line[m.end():].rstrip()
            if m.group(1) == "INFO":
                info(self, line, pre, msg)
            else:
                warn(self, line.rstrip(), pre, msg)
            return True
        m = _OLDEST_WARN.match(line.lstrip())
        if m is not None:
            self.nccl_lines += 1
            warn(self, line.rstrip(), m.group(1) + " ", line.lstrip()[m.end():].rstrip())
            return True
        return False

    def feed_all(self, lines: Iterable[str]) -> None:
        """`feed` for every line; the INFO path is inlined because it carries most lines."""
        feed = self.feed
        cache = self.prefix_cache
        prefix = self.prefix
        dispatch = INFO_HANDLERS
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
                    info_other(self, line, pfx, msg, sp)
            except _LINE_ERRORS:
                self.bad_lines += 1  # a mangled line must not stop the parse
        self.lines += n
        self.nccl_lines += n

    def feed_bytes(self, chunk: bytes) -> None:
        """`feed_all` for a chunk of whole lines, each ending in a newline (the undecoded file)."""
        log_bulk.feed_bytes(self, chunk)

    def close_chains(self) -> None:
        """End the open error chains: chains never span files."""
        close_chains(self)

    def merge(self, part: LogState) -> None:
        """Fold the state of a parser that read a later part of the input into this one."""
        log_document.merge(self, part)

    def result(self) -> dict:
        """The diag.nccl_log/2 document."""
        return log_document.result(self)


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
                p.close_chains()
                p.merge(par.parse_large_file(path, max_evidence, jobs))
        except DiagInputError as exc:
            errors.append({"source": str(path), "error": str(exc)})
            continue
        except OSError as exc:
            errors.append({"source": str(path), "error": f"{path}: cannot read: {exc}"})
            continue
        p.close_chains()  # chains never span files
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

