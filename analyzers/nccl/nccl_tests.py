"""Parse saved nccl-tests / rccl-tests output into `diag.nccl_bench/1` documents.

Handles every format generation seen in the wild (2018-2025):

- tables with `#wrong` (2.13+) or the older `error` column (a max delta, not a count),
  with or without the `redop` and `root` columns, `N/A` cells, rccl-tests asterisks;
- the `# Out of bounds values` / `# Avg bus bandwidth` footer, several tests per file
  (split at headers, `# Collective test starting/concluded` and `*_perf` command lines);
- launcher prefixes (OpenMPI `[1,0]<stdout>:`, `srun --label` `0: ` or `[0]`, Ray
  worker tags, timestamps, Markdown quotes) and lost leading `#` characters;
- failing runs (`Test NCCL failure`, `Test CUDA failure`, segfaults, MPI abort banners,
  `#wrong` > 0, `Out of bounds values : N FAILED`) and partial runs (cut mid-table,
  no footer, truncated JSON), each with its error lines;
- the JSON line of the nccl-tests `--json` fork (pull request 318), even when cut short.

When a saved excerpt lacks the header, the collective and world size are inferred from
the table itself (element counts and the busbw/algbw factor) and listed in `inferred`.

`backend` is "rccl" for rccl-tests output (its banner and RCCL-only lines), the backend
named by the `# diag nccl: backend <name>` line of diag's own tables (gloo on CPU), and
"nccl" otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

from diag import inflate
from diag.analyzers.nccl.launcher_prefix import shared_prefix, strip_prefix
from diag.analyzers.nccl.tests_inference import COLLECTIVES, collective_from_binary, infer
from diag.analyzers.nccl.tests_json import json_line
from diag.errors import DiagInputError

SCHEMA = "diag.nccl_bench/1"
MAX_ERROR_LINES = 50

_TAG = re.compile(r"\[\d+\]")
_PARAM = re.compile(
    r"(warmup iters|agg iters|iters|validation|graph|step|nThread|nGpus|minBytes|maxBytes):?\s+(\S+)"
)
_RANK = re.compile(
    r"^#?\s*Rank\s+(\d+)\s+(?:Group\s+(\d+)\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)\s+\[([^\]]*)\]\s*(.*?)\s*$"
)
_BINARY = re.compile(r"(?:^|[\s/.:])(?:nccl_|rccl_)?([a-z_]+?)_perf(?:_mpi)?\b")
_VERSION = re.compile(r"\b([NR]CCL) version\s*:?\s*(\S+)")
_AVG = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*(\S+)")
_OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(\d+)\s+(\w+)")
_CONCLUDED = re.compile(r"^#?\s*Collective test (starting|concluded):\s*(\S+)")
_FAILURE = re.compile(
    r"\bTest (?:NCCL |CUDA |HIP |MPI )?failure\b|(?:^|\s|: )NCCL failure \S+|\bCUDA failure\b"
    r"|Segmentation fault|\bSIGSEGV\b|signal 11\b|Caught signal|\bBus error\b|core dumped"
    r"|mpirun detected that one or more processes exited with non-zero status"
    r"|mpirun noticed that process|exited on signal|^srun: error:|Primary job\s+terminated"
    r"|\bterminate called after\b|\bout of memory\b",
    re.I,
)
_WARN = re.compile(r"\bNCCL WARN\b")
# rccl-tests' own lines (not a "# source:" note about them)
_RCCL_TEXT = re.compile(r"^(?!# source:)[^\n]*?(?:RCCL version|Errors with asterisks|HIP version|rccl-tests)", re.M)
_DIAG_BACKEND = re.compile(r"^#\s*diag nccl: backend (\w+)")
_TYPE_WIDTH_HEADER = re.compile(r"\bcount(\s+)type\b")
_TYPE_WIDTH_ROW = re.compile(r"^\s*\d+\s+\d+(\s+)([A-Za-z]\w*)\s")
# "host: Test NCCL failure ..." and " .. host pid 123: Test failure ..." name the failing host.
_FAILED_HOST = re.compile(r"^(?:\.\. )?([\w.\-]+)(?: pid \d+)?: Test (?:\w+ )?failure")
_CMD_ARG = re.compile(r"(?:^|\s)(-g|--ngpus|-t|--nthreads|-np|-n|--np)[\s=](\d+)")


MAX_CELL = 64  # characters of a table cell read as a number


def _num(tok: str):
    """A table cell as float/int, None for N/A; raises ValueError for non-numbers."""
    tok = tok.rstrip("*")
    if tok in ("N/A", "n/a", "-"):
        return None
    if len(tok) > MAX_CELL:
        raise ValueError("a table cell longer than any number nccl-tests prints")
    v = float(tok)
    # Integers within int64 stay exact; longer runs of digits are no count nccl-tests prints.
    return int(tok) if len(tok) <= 18 and re.fullmatch(r"-?\d+", tok) else v


_PARAM_NAMES = {"nThread": "nthread", "nGpus": "ngpus", "minBytes": "min_bytes", "maxBytes": "max_bytes",
                "warmup iters": "warmup_iters", "iters": "iters", "agg iters": "agg_iters",
                "validation": "check", "graph": "graph"}


def _typed_params(pairs) -> dict:
    """The `# nThread ...` header as ints, with the runner's key names (step_factor | step_bytes)."""
    out: dict = {}
    for k, v in pairs:
        if k == "step":
            m = re.match(r"(\d+)\((factor|bytes)\)", v)
            if m:
                out["step_factor" if m.group(2) == "factor" else "step_bytes"] = int(m.group(1))
        elif k in _PARAM_NAMES and v.isdigit():
            out[_PARAM_NAMES[k]] = int(v)
    return out


def _bus_number(pci: str) -> int | None:
    """PCI bus number of "[0x0f]" (older nccl-tests) or "[0000:01:00]" (domain:bus:device)."""
    try:
        return int(pci, 16) if pci.lower().startswith("0x") else int(pci.split(":")[-2], 16)
    except (ValueError, IndexError):
        return None


class _Test:
    def __init__(self, backend_hint: str | None):
        self.collective: str | None = None
        self.binary: str | None = None
        self.params: dict = {}
        self.devices: list[dict] = []
        self.headers = 0
        self.columns: list[str] | None = None  # names of the columns before the first "time"
        self.error_column: str | None = None  # "#wrong" or "error"
        self.type_width: int | None = None  # printf width of the type column: 8, or 6 in the oldest versions
        self.rows: list[dict] = []
        self.avg: list[float] = []
        self.oob: int | None = None
        self.oob_failed = False
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.failed = False
        self.truncated = False
        self.backend = backend_hint
        self.nccl_version: str | None = None
        self.cmd_world: int | None = None
        self.done = False  # a footer closed the table

    @property
    def has_content(self) -> bool:
        return bool(self.headers or self.rows or self.avg or self.errors or self.columns)


def _add_line(lst: list[str], line: str) -> None:
    if len(lst) < MAX_ERROR_LINES and line not in lst:
        lst.append(line)


def _group(tokens: list[str], error_column: str | None) -> tuple[dict | None, bool]:
    """One out-of-place / in-place cell group (time, algbw, busbw, wrong|error)."""
    if len(tokens) < 4:
        return None, True
    time_us, algbw, busbw = (_num(t) for t in tokens[:3])
    raw = tokens[3]
    err = _num(raw)
    g = {"time_us": time_us, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": None}
    count_column = error_column == "#wrong" or (error_column is None and (err is None or isinstance(err, int)))
    if count_column and (err is None or isinstance(err, int)):
        g["wrong"] = err
    else:
        g["error"] = None if err is None else float(err)
    if raw.endswith("*"):
        g["error_exceeded"] = True
    return g, False


def _parse_row(tokens: list[str], test: _Test) -> dict | None:
    """A results row, or None when the tokens are not one."""
    if len(tokens) < 3 or not tokens[0].isdigit() or not tokens[1].isdigit() or not tokens[2][:1].isalpha():
        return None
    cols = test.columns
    if cols is None:
        n = len(tokens)
        if n >= 13:
            cols = ["size", "count", "type", "redop", "root"]
        elif n == 12:
            fourth = tokens[3].lstrip("-")
            cols = ["size", "count", "type", "root" if fourth.isdigit() else "redop"]
        elif n == 11:
            cols = ["size", "count", "type"]
        elif n > 5 and tokens[3].isalpha() and tokens[4].lstrip("-").isdigit():
            cols = ["size", "count", "type", "redop", "root"]
        else:
            return None
        if n >= 11:
            test.columns = cols
    if "redop" in cols and "root" in cols and len(tokens) == len(cols) + 7 and tokens[3].lstrip("-").isdigit():
        # A blank reduction cell: the operation has none and this layout prints it as spaces
        # ("%6s" of an empty name, alltoall in older nccl-tests), so the root is the fourth token.
        cols = [c for c in cols if c != "redop"]
    k = len(cols)
    head = dict(zip(cols, tokens[:k]))
    try:
        root = head.get("root")
        row = {
            "size_bytes": int(head["size"]),
            "count": int(head["count"]),
            "dtype": head["type"],
            "redop": head.get("redop"),
            "root": int(root) if root is not None and root.lstrip("-").isdigit() else None,
        }
        oop, cut1 = _group(tokens[k:k + 4], test.error_column)
        ip, cut2 = _group(tokens[k + 4:k + 8], test.error_column)
    except (ValueError, KeyError, IndexError):  # a damaged or foreign row is not a row
        return None
    row["out_of_place"] = oop
    row["in_place"] = ip
    if cut1 or cut2:
        row["truncated"] = True
    return row


def _parse_json_line(line: str, test: _Test) -> bool:
    """The JSON object printed by the nccl-tests --json fork; salvages a truncated line."""
    found = json_line(line)
    if found is None:
        return False
    rows, complete, version = found
    test.rows.extend(rows)
    if not complete:
        test.truncated = True
        _add_line(test.notes, "JSON output is cut short; the rows before the cut are kept")
    elif version:
        test.nccl_version = test.nccl_version or version
    test.headers = max(test.headers, 1)
    return True


def _finish(test: _Test, source: str | None) -> dict:
    rows = test.rows
    failed = test.failed or test.oob_failed
    for r in rows:
        for g in (r["out_of_place"], r["in_place"]):
            if g and ((g.get("wrong") or 0) > 0 or g.get("error_exceeded")):
                failed = True
        if r.get("truncated"):
            test.truncated = True
    if any((g.get("wrong") or 0) > 0 for r in rows for g in (r["out_of_place"], r["in_place"]) if g):
        _add_line(test.errors, "results differ from the expected values (#wrong > 0)")
    # Rows whose first cell group was cut off carry no measurement.
    kept = [r for r in rows if r["out_of_place"] is not None]
    if len(kept) < len(rows):
        test.truncated = True
    if failed:
        status = "failed"
    elif test.truncated or not test.avg or not kept:
        status = "partial"
    else:
        status = "ok"
    if status == "partial" and not test.avg:
        _add_line(test.notes, "output ends before the '# Avg bus bandwidth' footer")
    ids = [d["rank"] for d in test.devices]
    copies = max(test.headers, len(test.avg))
    if copies > 1 or len(ids) != len(set(ids)):
        what = ("result footers" if len(test.avg) > 1 else "headers, with ranks numbered from 0 in each,")
        test.warnings.append(
            f"nccl-tests printed {copies} {what}: every process ran its own independent test instead of one "
            "job across all processes (nccl-tests built without MPI=1, or run with a different MPI than it "
            "was built with)"
        )
    distinct = {d["rank"] for d in test.devices}
    world = None
    per_proc = None
    if "nthread" in test.params and "ngpus" in test.params:
        per_proc = test.params["nthread"] * test.params["ngpus"]
    if distinct or per_proc:
        world = max(len(distinct), per_proc or 0)
    elif test.cmd_world:
        world = test.cmd_world
    out = {
        "collective": test.collective,
        "world_size": world,
        "backend": test.backend or "nccl",
        "rows": kept,
        "avg_busbw_gbps": test.avg[0] if test.avg else None,
        "status": status,
        "errors": list(test.errors),
        "source": source,
        "binary": test.binary,
        "nccl_version": test.nccl_version,
        "params": test.params,
        "devices": test.devices,
        "hosts": sorted({d["host"] for d in test.devices}),
        "out_of_bounds": test.oob,
        "max_busbw_gbps": max(
            (g["busbw_gbps"] for r in kept for g in (r["out_of_place"], r["in_place"])
             if g and g["busbw_gbps"] is not None), default=None),
        "warnings": test.warnings,
        "notes": test.notes,
        "failed_hosts": sorted({m.group(1) for e in test.errors for m in [_FAILED_HOST.search(e)] if m}),
        # the table's layout, so that it can be printed again as that generation did
        "layout": {"columns": list(test.columns) if test.columns is not None else None,
                   "error_column": test.error_column, "type_width": test.type_width},
    }
    if len(test.avg) > 1:
        out["avg_busbw_gbps_per_process"] = list(test.avg)
    infer(test.rows, out)
    return out


def parse_text(text: str, source: str | None = None) -> list[dict]:
    """Every nccl-tests run found in `text`, as test dicts of diag.nccl_bench/1."""
    return _TextParser(text).parse(source)


MAX_LINE = 1 << 16


class _TextParser:
    """nccl-tests output, line by line: each kind of line is read by one method, which says
    whether the line was its kind. State carried between lines: the test being read, and what
    was seen before its header (binary, errors, warnings, library version, world size)."""

    def __init__(self, text: str):
        self.text = text
        self.tests: list[_Test] = []
        self.backend = "rccl" if _RCCL_TEXT.search(text) else None
        self.cur: _Test | None = None
        self.pending_binary: str | None = None
        self.pending_errors: list[str] = []
        self.pending_warn: list[str] = []
        self.pending_version: str | None = None
        self.cmd_world: int | None = None

    def parse(self, source: str | None) -> list[dict]:
        kinds = (self._diag_backend, self._version, self._json, self._concluded, self._params, self._rank,
                 self._columns, self._avg, self._oob)
        # Each line up to MAX_LINE characters: nccl-tests writes lines of a few hundred, and
        # the patterns below must not search megabytes of one damaged line.
        lines = [strip_prefix(x[:MAX_LINE]) for x in self.text.splitlines()]
        extra = shared_prefix(lines)
        for line in lines:
            if extra is not None:
                line = extra.sub("", line, count=1)
            s = line.strip()
            if not s or s.startswith("# source:"):
                continue
            body = s.lstrip("#").strip()
            if any(kind(s, body, line) for kind in kinds) or s.startswith("#"):
                continue
            if self._row(s, line) or self._warning(s) or self._failure(s) or "NCCL INFO" in s:
                continue
            self._command(s)
        if self.pending_errors:
            self._new_test()
        docs = []
        for t in self.tests:
            if t.has_content or t.errors:
                if t.failed:
                    for w in t.warnings:
                        _add_line(t.errors, w)
                docs.append(_finish(t, source))
        return docs

    def _new_test(self) -> _Test:
        t = _Test(self.backend)
        if self.pending_binary:
            t.binary = self.pending_binary
            t.collective = collective_from_binary(self.pending_binary)
        t.cmd_world = self.cmd_world
        t.nccl_version = self.pending_version
        for e in self.pending_errors:
            _add_line(t.errors, e)
        t.failed = bool(self.pending_errors)
        for w in self.pending_warn:
            _add_line(t.warnings, w)
        self.pending_binary, self.pending_errors, self.pending_warn = None, [], []
        self.tests.append(t)
        self.cur = t
        return t

    def _current(self, fresh_header: bool = False) -> _Test:
        # A header after rows or a footer starts the next test.
        cur = self.cur
        if cur is None or (fresh_header and (cur.rows or cur.done)):
            return self._new_test()
        return cur

    def _diag_backend(self, s: str, body: str, line: str) -> bool:
        m = _DIAG_BACKEND.match(s)
        if m:  # diag's own table: the backend it measured (gloo, nccl, rccl)
            self.backend = m.group(1)
            if self.cur is not None and not self.cur.rows and not self.cur.done:
                self.cur.backend = self.backend
        return bool(m)

    def _version(self, s: str, body: str, line: str) -> bool:
        m = _VERSION.search(s)
        if m:
            self.pending_version = m.group(2)
            if m.group(1) == "RCCL":
                self.backend = "rccl"
            if self.cur is not None and self.cur.nccl_version is None:
                self.cur.nccl_version = m.group(2)
        return bool(m)

    def _json(self, s: str, body: str, line: str) -> bool:
        if s.startswith("{") and ('"benchmark"' in s or '"identifier"' in s):
            _parse_json_line(s, self._current(fresh_header=True))
            return True
        return False

    def _concluded(self, s: str, body: str, line: str) -> bool:
        m = _CONCLUDED.match(s)
        if m:
            stem = _BINARY.search(" " + m.group(2))
            stem = stem.group(1) if stem else m.group(2)
            if m.group(1) == "starting":
                self.pending_binary = stem
                if self.cur is not None and (self.cur.rows or self.cur.done):
                    self.cur = None
            elif self.cur is not None:
                self.cur.binary = self.cur.binary or stem
                self.cur.collective = self.cur.collective or collective_from_binary(stem)
        return bool(m)

    def _params(self, s: str, body: str, line: str) -> bool:
        if not body.startswith("nThread"):
            return False
        t = self._current(fresh_header=True)
        if t.headers and not t.rows and not t.done:
            t.headers += 1  # the same header again: another process of a non-MPI build
        else:
            t.headers = max(t.headers, 1)
        t.params = _typed_params(_PARAM.findall(body))
        return True

    def _rank(self, s: str, body: str, line: str) -> bool:
        if not (body.startswith("Rank") and "Pid" in body):
            return False
        m = _RANK.match(body)
        if m:
            self._current().devices.append({
                "rank": int(m.group(1)), "group": int(m.group(2)) if m.group(2) else 0, "pid": int(m.group(3)),
                "host": m.group(4), "device": int(m.group(5)), "bus_id": _bus_number(m.group(6)),
                "pci_id": m.group(6), "name": m.group(7) or None})
        return True

    def _columns(self, s: str, body: str, line: str) -> bool:
        names = body.split()  # "time" as a column of its own: a damaged header is not a table's
        if not (body.startswith("size") and "time" in names and ("algbw" in body or "busbw" in body)):
            return False
        t = self._current(fresh_header=True)
        t.columns = names[:names.index("time")]
        t.error_column = "#wrong" if "#wrong" in names else ("error" if "error" in names else None)
        m = _TYPE_WIDTH_HEADER.search(line)
        if m:
            t.type_width = len(m.group(1)) + 2  # "count" + spaces + "type": %Ns with N = spaces + 4 - 2
        return True

    def _avg(self, s: str, body: str, line: str) -> bool:
        m = _AVG.match(s)
        if m:
            t = self._current()  # a second footer without new rows: another process's copy (see _finish)
            try:
                t.avg.append(float(m.group(1)))
            except ValueError:
                pass
            t.done = True
        return bool(m)

    def _oob(self, s: str, body: str, line: str) -> bool:
        m = _OOB.match(s)
        if m:
            t = self._current()
            t.oob = int(m.group(1))
            if m.group(2).upper() != "OK":
                t.oob_failed = True
                _add_line(t.errors, s)
        return bool(m)

    def _row(self, s: str, line: str) -> bool:
        tokens = _TAG.sub(" ", s).split() if "[" in s else s.split()
        if not (tokens and tokens[0].isdigit()):
            return False
        t_probe = self.cur if self.cur is not None and not self.cur.done else None
        probe = t_probe or _Test(self.backend)
        row = _parse_row(tokens, probe)
        if row is None:
            return False
        t = t_probe or self._new_test()
        if t is not probe:
            t.columns = t.columns or probe.columns
        t.rows.append(row)
        if t.type_width is None:
            m = _TYPE_WIDTH_ROW.match(line)
            if m:
                t.type_width = len(m.group(1)) + len(m.group(2)) - 2  # "  %Ns" after the count
        return True

    def _warning(self, s: str) -> bool:
        if not _WARN.search(s):
            return False
        if self.cur is not None:
            _add_line(self.cur.warnings, s)
        else:
            self.pending_warn.append(s)
        return True

    def _failure(self, s: str) -> bool:
        if not _FAILURE.search(s):
            return False
        if self.cur is not None:
            self.cur.failed = True
            for w in self.cur.warnings:
                _add_line(self.cur.errors, w)
            _add_line(self.cur.errors, s)
        else:
            _add_line(self.pending_errors, s)
        return True

    def _command(self, s: str) -> None:
        """A command line (mpirun ... all_reduce_perf -g 8) starts the next test."""
        m = _BINARY.search(s)
        if not (m and not s.startswith("=") and (m.group(1) in COLLECTIVES)):
            return
        self.pending_binary = m.group(1)
        # world size from the command: launcher options before the binary, -g/-t after it
        launcher, bench_args = s[:m.start()], s[m.end():]
        args = {k: int(v) for k, v in _CMD_ARG.findall(bench_args) if k in ("-g", "--ngpus", "-t", "--nthreads")}
        procs = {k: int(v) for k, v in _CMD_ARG.findall(launcher) if k in ("-np", "--np", "-n")}
        cw = 1
        for v in args.values():
            cw *= v
        if procs and re.search(r"\b(mpirun|mpiexec|srun|orterun)\b", launcher):
            cw *= next(iter(procs.values()))
        self.cmd_world = cw if (args or procs) else None
        cur = self.cur
        if cur is not None and (cur.rows or cur.done or cur.errors):
            self.cur = None
        elif cur is not None and not cur.has_content:
            cur.binary, cur.collective = self.pending_binary, collective_from_binary(self.pending_binary)


def _read_text(path: Path) -> str:
    try:
        data = inflate.read_all(path)  # gzip by its magic, within the ceiling
    except OSError as exc:
        raise DiagInputError(f"cannot read: {exc.strerror or exc}", source=str(path)) from None
    if not data.strip():
        raise DiagInputError("empty file", source=str(path))
    sample = data[:65536]
    if b"\x00" in sample or _binary_ratio(sample) > 0.10:
        raise DiagInputError("binary data, not nccl-tests text output", source=str(path))
    return data.decode("utf-8", errors="replace")


def _binary_ratio(sample: bytes) -> float:
    text = sample.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v\x1b"))
    return bad / max(1, len(text))


def parse_file(path) -> dict:
    """A `diag.nccl_bench/1` document for one saved output; DiagInputError when none is found."""
    path = Path(path)
    text = _read_text(path)
    tests = parse_text(text, source=str(path))
    if not tests:
        raise DiagInputError("no nccl-tests output found (no results table, header or footer)", source=str(path))
    return {"schema": SCHEMA, "source": str(path), "tests": tests}
