"""Record streams (steps, samples, events) as segment files: written by SegmentWriter, read in order.

Each stream is appended to as an open segment (a journal) every `flush_s`, so a rank killed
without warning loses about a second, and sealed by a rename; a reader leaves out an open
segment's cut-off last line and notes every other damaged line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from diag.atomic_io import json_default, open_regular

_decode = msgspec.json.Decoder().decode  # several times faster than json.loads on big runs

JOURNAL_SUFFIX = ".open"  # a segment still being appended to: "steps-000003.jsonl.open"


class SegmentWriter:
    """Buffers records and writes them as segment files.

    `sync` appends the buffered records to the stream's open segment (a journal,
    `<name>.jsonl.open`), so a process killed without warning (SIGKILL, the OOM killer) loses
    only what it buffered since the last sync; the agent syncs every second. A journal is
    sealed, renamed to `<name>.jsonl`, once it holds `flush_records` records or is
    `flush_seconds` old, and at `flush`; a journal that a killed process left is sealed by
    the next writer of the stream. Readers read sealed segments and journals alike (a
    journal's last line may be cut off: it is left out). Memory is bounded by
    `flush_records`; disk by `max_bytes`, past which the writer drops records and reports it
    once through `on_full` (the training goes on).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        stream: str,
        flush_records: int = 200,
        flush_seconds: float = 10.0,
        max_bytes: int = 256 << 20,
        on_full=None,
    ):
        self.directory = Path(directory)
        self.stream = stream
        self.flush_records = flush_records
        self.flush_seconds = flush_seconds
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.bytes_written = 0
        self.dropped = 0
        self._buf: list[str] = []
        self._journal: int | None = None  # the open segment's descriptor
        self._journal_records = 0
        self._journal_opened = time.monotonic()
        self._seal_left_journals()
        self._index = self._next_index()

    def _segments(self) -> list[Path]:
        return segment_files(self.directory, self.stream)

    def _next_index(self) -> int:
        existing = self._segments()
        return segment_index(existing[-1]) + 1 if existing else 0

    def _seal_left_journals(self) -> None:
        """Seal the journals a killed process left, less a last line it cut off: their records
        are whole segments now."""
        for p in self._segments():
            if p.name.endswith(JOURNAL_SUFFIX):
                sealed = p.with_name(p.name[: -len(JOURNAL_SUFFIX)])
                if not sealed.exists():
                    _cut_partial_line(p)
                    os.replace(p, sealed)

    def _path(self) -> Path:
        return self.directory / f"{self.stream}-{self._index:06d}.jsonl"

    def write(self, record: dict) -> None:
        self._buf.append(json.dumps(record, separators=(",", ":"), default=json_default))
        if len(self._buf) >= self.flush_records:
            self.sync()

    def sync(self) -> None:
        """Append the buffered records to the open segment; seal it once full or old."""
        if self._buf:
            data = ("\n".join(self._buf) + "\n").encode("utf-8")
            n = len(self._buf)
            self._buf = []
            if self.bytes_written + len(data) > self.max_bytes:
                self.dropped += n
                if self.on_full is not None and self.dropped == n:
                    self.on_full(f"{self.stream}: size budget of {self.max_bytes} bytes reached; dropping records")
            else:
                self._append(data)
                self._journal_records += n
                self.bytes_written += len(data)
        if self._journal is not None and (self._journal_records >= self.flush_records
                                          or time.monotonic() - self._journal_opened >= self.flush_seconds):
            self._seal()

    def _append(self, data: bytes) -> None:
        if self._journal is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self._path().with_name(self._path().name + JOURNAL_SUFFIX)
            # O_NOFOLLOW: a link planted under the journal's name is refused, not written through.
            self._journal = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                                    0o644)
            self._journal_records, self._journal_opened = 0, time.monotonic()
        view = memoryview(data)
        while view:
            view = view[os.write(self._journal, view):]

    def _seal(self) -> None:
        fd, self._journal = self._journal, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        path = self._path()
        os.replace(path.with_name(path.name + JOURNAL_SUFFIX), path)
        self._index += 1

    def flush(self) -> None:
        """Everything buffered written, and the open segment sealed."""
        self.sync()
        self._seal()


def _cut_partial_line(path: Path, tail: int = 1 << 20) -> None:
    """Truncate a file after its last newline (within its last `tail` bytes; a file with no
    newline there is left whole, for the reader to note)."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return
        start = max(0, size - tail)
        f.seek(start)
        data = f.read()
        if data.endswith(b"\n"):
            return
        at = data.rfind(b"\n")
        if at >= 0:
            f.truncate(start + at + 1)
        elif start == 0:
            f.truncate(0)


def segment_index(path: Path) -> int:
    """The index in a segment's name: "steps-000012.jsonl" or its journal, "...jsonl.open"."""
    return int(path.name.split(".", 1)[0].rsplit("-", 1)[1])


def segment_files(directory: str | os.PathLike, stream: str) -> list[Path]:
    """A stream's segments, sealed and open, in the order they were written."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.glob(f"{stream}-*.jsonl*"):
        if not (p.name.endswith(".jsonl") or p.name.endswith(".jsonl" + JOURNAL_SUFFIX)):
            continue
        try:
            found.append((segment_index(p), p.name.endswith(JOURNAL_SUFFIX), p))
        except ValueError:
            continue  # not a name the writer gives
    return [p for _, _, p in sorted(found)]


def read_records(directory: str | os.PathLike, stream: str, problems: list | None = None) -> Iterator[dict]:
    """All records of a stream in order, from its sealed segments and its open one (whose last
    line a killed writer may have cut off: left out unnoted). Other unreadable lines are
    skipped and noted in `problems`."""
    for seg in segment_files(directory, stream):
        yield from read_segment(seg, problems, open_journal=seg.name.endswith(JOURNAL_SUFFIX))


# No record the agent writes comes near this; a longer line is damage, skipped unread.
MAX_RECORD_BYTES = 1 << 20


def read_segment(segment: str | os.PathLike, problems: list | None = None,
                 open_journal: bool = False) -> Iterator[dict]:
    """The records of one segment file, read line by line; damaged lines (not JSON, invalid
    UTF-8, nested too deep, longer than MAX_RECORD_BYTES) are skipped and noted in `problems`,
    except, in an open journal, a last line without its newline (a write cut off)."""
    try:
        f = open_regular(segment)
    except OSError as exc:
        if problems is not None:
            problems.append(f"{segment}: unreadable ({exc.strerror or exc})")
        return
    with f:
        i = 0
        while True:
            try:
                line = f.readline(MAX_RECORD_BYTES + 1)
            except OSError as exc:
                if problems is not None:
                    problems.append(f"{segment}: unreadable after line {i} ({exc.strerror or exc})")
                return
            if not line:
                return
            i += 1
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of the overlong line
                    line = f.readline(MAX_RECORD_BYTES)
                if problems is not None:
                    problems.append(f"{segment}:{i}: a line longer than {MAX_RECORD_BYTES >> 20} MiB, skipped")
                continue
            rec = _record(line)
            if rec is _DAMAGED and open_journal and not line.endswith(b"\n"):
                return  # the journal's last write, cut off
            if rec is _DAMAGED:
                if problems is not None:
                    problems.append(f"{segment}:{i}: not a JSON record")
            elif isinstance(rec, dict):
                yield rec


_DAMAGED = object()


def _record(line: bytes):
    if not line.strip():
        return None
    try:
        return _decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    # json writes NaN/Infinity literals, which msgspec rejects; json reads them back.
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return _DAMAGED
