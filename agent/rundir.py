"""The run directory: the versioned on-disk format between the agent and everything that reads it.

Layout (schema "diag.run/3"; a /2 run, whose step records and window summaries also carried
verdicts, and a /1 run, without open segments, read the same). It holds facts only: what
was measured, never a verdict (the live views judge the facts as they come, the analysis
afterwards).

    RUN_DIR/
      manifest.json                 job-level facts, written by rank 0 (MANIFEST_SCHEMA)
      decision_tree.json            the thresholds and what-if changes the agent resolved
                                    (diag.tree_settings/1), created once by the first rank
      rank-00000/
        rank.json                   this rank's facts (RANK_SCHEMA); on a CPU host with a
                                    `diag calibrate` file, its peaks ("host_peaks")
        live.json                   the last steps and sample, rewritten every live_s while
                                    the rank runs (diag.live/1), for `diag top`
        steps/steps-000000.jsonl    one JSON object per training step (STEP_FIELDS);
        steps/steps-000001.jsonl.open   the segment being appended to (sealed every 10 s)
        samples/samples-000000.jsonl  device and host metric samples, ~1 Hz
        events/events-000000.jsonl  the agent's own log: collectors switched off, windows, faults
        windows/window-000120.json  analysis summary of the profiler window starting at step 120
        traces/*.pt.trace.json.gz   Kineto traces of profiler windows, within a size budget
        nccl/                       NCCL_DEBUG_FILE output
      profile.trigger               touched to ask every rank for a profiler window
      nccl_bench.json               `diag nccl --run-dir` results (NCCL_BENCH)
      nccl_log.json                 the job's NCCL logs parsed by `diag run` (NCCL_LOG_DOC)
      rank-00001/ ...

Every document is written whole to a temporary name and renamed into place, so a reader
never sees half a file and a crash never corrupts what was already written. Record
streams (steps, samples, events) are sequences of segment files read in index order: each
is appended to as an open segment every `flush_s` (so a rank killed without warning loses
about a second) and sealed by a rename; a reader leaves out an open segment's cut-off last
line.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

RUN_SCHEMA = "diag.run/3"
RANK_SCHEMA = "diag.rank/1"
MANIFEST = "manifest.json"
RANK_FILE = "rank.json"
# The rank's latest steps and sample, rewritten every `live_s` for `diag top` (diag.live/1).
LIVE_FILE = "live.json"
# Touched (its modification time changes) to ask every rank for a profiler window.
TRIGGER_FILE = "profile.trigger"
STREAMS = ("steps", "samples", "events")
WINDOWS = "windows"
TRACES = "traces"
NCCL = "nccl"
# The decision-tree settings (thresholds, what-if changes) the agent resolved; every later
# analysis of the run judges by them unless told otherwise (diag.tree_settings/1).
TREE_SETTINGS = "decision_tree.json"
# `diag nccl --run-dir`'s measured bus bandwidth (diag.nccl_bench/1), and the NCCL logs of a
# `diag run` job parsed into one document of facts (diag.nccl_log/2).
NCCL_BENCH = "nccl_bench.json"
NCCL_LOG_DOC = "nccl_log.json"

# No training counts this many steps; a larger step number is damage (it would not fit the
# analysis's 64-bit columns either).
MAX_STEP = 1 << 48
# No step holds more: a batch of a billion samples, a trillion tokens. A count past these (or
# negative, or not a finite number) is a mistake in what the job passed to agent.step().
MAX_STEP_COUNTS = {"samples": 1e9, "tokens": 1e12}


def plausible_count(value, field: str) -> bool:
    """Whether `value` can be the `field` ("samples", "tokens") of one step: None (not given),
    or a finite number from 0 to MAX_STEP_COUNTS[field]."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return bool(math.isfinite(value) and 0 <= value <= MAX_STEP_COUNTS[field])

# How a rank's run ended (rank.json's status once it is not "running"): terminated is a stop
# from outside (SIGTERM), interrupted a Ctrl-C or an exit without closing the agent.
FINAL_STATUSES = ("completed", "failed", "interrupted", "terminated")

# Keys of one steps record. Optional values are null when not measured.
STEP_FIELDS = {
    "step": "step number, the same on every rank",
    "start_unix": "wall-clock start of the step, seconds since the epoch",
    "duration_s": "step wall time from a monotonic clock",
    "data_wait_s": "time spent waiting for the next batch (null without agent.loader())",
    "collate_s": "of the data wait, collating batches in this process: a DataLoader with num_workers=0 (else null)",
    "cpu_s": "the process's CPU time over the step, all its threads (time.process_time)",
    "data_wait_cpu_s": "of cpu_s, the CPU time during the data wait (null without agent.loader())",
    "samples": "samples in the step, from agent.step(samples=...)",
    "tokens": "tokens in the step, from agent.step(tokens=...)",
    "peak_mem_bytes": "the device's peak allocated memory so far (the allocator's, never reset by diag), where available",
    "device_s": "device time between timing events at the step's boundaries (null without a CUDA/HIP device)",
    "data_idle_s": "the device's idle time within the step's data waits, from timing events (null without them)",
    "profiled": "true when a torch.profiler window covered the step",
    "shares": "the step's time by class (data, host, comm, memory, compute; null where unknown): its data wait "
              "and the latest window's split of the rest",
    "evidence": "trace | sampled: what the step's shares rest on",
}

_RANK_DIR = re.compile(r"^rank-(\d+)$")
_decode = msgspec.json.Decoder().decode  # several times faster than json.loads on big runs


# Ranks are numbered below this (the largest jobs run some 10^5 GPUs). A rank or world size
# beyond it, or not an integer, comes from a damaged file: loops over the ranks of a job
# take their length from these numbers.
MAX_WORLD_SIZE = 1 << 20


def rank_number(v) -> int | None:
    """v when it can be a rank: an integer in [0, MAX_WORLD_SIZE); else None."""
    return v if type(v) is int and 0 <= v < MAX_WORLD_SIZE else None


def world_size_number(v) -> int | None:
    """v when it can be a world size: an integer in [1, MAX_WORLD_SIZE]; else None."""
    return v if type(v) is int and 0 < v <= MAX_WORLD_SIZE else None


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _written_beside(path: Path, data: bytes, durable: bool = True) -> str:
    """`data` in a temporary file next to `path` (same file system), flushed to disk when `durable`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """`data` at `path`, whole or not at all for any reader; `durable=False` skips the flush to
    disk, for a file rewritten every second whose loss in a crash costs nothing (live.json)."""
    tmp = _written_beside(Path(path), data, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def create_exclusive(path: str | os.PathLike, data: bytes) -> bool:
    """Create `path` holding `data`, whole or not at all; False when it exists already.

    Claims and agreements between ranks rest on this. O_EXCL alone creates the file empty
    and fills it afterwards, and a peer reading in between sees a partial claim. Here the
    data is written under a temporary name first and hard-linked into place, which fails
    if the name is taken. File systems without hard links get an exclusive lock directory
    (`<name>.lock`, mkdir is atomic everywhere) and an atomic rename instead.
    """
    path = Path(path)
    tmp = _written_beside(path, data)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # no hard links here (some FUSE and object-store mounts)
        try:
            os.mkdir(path.with_name(path.name + ".lock"))
        except FileExistsError:
            return False
        if path.exists():
            return False
        os.replace(tmp, path)
        return True
    finally:
        _unlink(tmp)


def is_claim_part(name: str, claim: str) -> bool:
    """The claim file itself or a temporary or lock of `create_exclusive` for it."""
    return name == claim or name == claim + ".lock" or (name.startswith(f".{claim}.") and name.endswith(".tmp"))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, default=_json_default) + "\n").encode("utf-8"), durable)


def _json_default(obj):
    # numpy scalars and paths appear in records; everything else is a bug worth seeing.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


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
        self._buf.append(json.dumps(record, separators=(",", ":"), default=_json_default))
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


def open_regular(path: str | os.PathLike):
    """A regular file opened for reading, binary. A device, FIFO or socket (a link to /dev/zero,
    a named pipe) is refused with OSError before any read: its size says nothing of how much
    it yields, and a FIFO's open would block until a writer came."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


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


# The run directory's JSON documents are a few kB; one this large is not the agent's.
MAX_JSON_BYTES = 64 << 20


def read_json(path: str | os.PathLike, problems: list | None = None, max_bytes: int = MAX_JSON_BYTES) -> dict | None:
    try:
        with open_regular(path) as f:
            # Read no more than the bound, whatever the size says (a file can grow while read).
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"larger than {max_bytes >> 20} MiB")
        obj = json.loads(data)
        return obj if isinstance(obj, dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json can follow
        if problems is not None:
            problems.append(f"{path}: unreadable JSON ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})")
        return None


def is_run_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).exists() or any(_RANK_DIR.match(c.name) for c in p.iterdir()))


def is_leftover(name: str) -> bool:
    """A file's name while diag or Kineto writes it (`.NAME.XXXX.tmp`, `.window-N.tmp`,
    `.window-N.tmp.tmp`): a process killed mid-write leaves it behind."""
    return name.startswith(".") and name.endswith(".tmp")


def owner_gone(info: dict | None) -> bool:
    """Whether the process that wrote a rank is done writing: its rank closed, or it ran on this
    host and no longer exists. A rank on another host that never closed may still write."""
    if not isinstance(info, dict):
        return False
    if info.get("status") in FINAL_STATUSES:
        return True
    pid = info.get("pid")
    this_host = {socket.gethostname(), os.environ.get("SLURMD_NODENAME")}
    if info.get("host") not in this_host or type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists, owned by someone else
    return False


def remove_leftovers(run_dir: str | os.PathLike) -> int:
    """Delete the partial files of the ranks whose writers are gone (see owner_gone); their count.
    A rank still writing keeps its own."""
    rd, removed = RunDir(run_dir), 0
    for rank in rd.ranks():
        if not owner_gone(rd.rank_info(rank)):
            continue
        for folder, _, names in os.walk(rd.rank_path(rank)):
            for name in filter(is_leftover, names):
                try:
                    os.unlink(os.path.join(folder, name))
                    removed += 1
                except OSError:
                    pass
    return removed


class RunDir:
    """Read access to a run directory. Tolerant: what is damaged is listed in `problems`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.problems: list[str] = []

    def manifest(self) -> dict:
        return read_json(self.path / MANIFEST, self.problems) or {}

    def ranks(self) -> list[int]:
        if not self.path.is_dir():
            return []
        found = (_RANK_DIR.match(c.name) for c in self.path.iterdir() if c.is_dir())
        return sorted(r for m in found if m and (r := rank_number(int(m.group(1)))) is not None)

    def expected_world_size(self) -> int | None:
        sizes = [self.manifest().get("world_size")]
        sizes += [(self.rank_info(r) or {}).get("world_size") for r in self.ranks()]
        sizes = [s for s in map(world_size_number, sizes) if s is not None]
        return max(sizes) if sizes else None

    def missing_ranks(self) -> list[int]:
        world = self.expected_world_size()
        present = set(self.ranks())
        return [r for r in range(world or 0) if r not in present]

    def rank_path(self, rank: int) -> Path:
        return self.path / rank_dir_name(rank)

    def rank_info(self, rank: int) -> dict | None:
        return read_json(self.rank_path(rank) / RANK_FILE, self.problems)

    def records(self, rank: int, stream: str) -> Iterator[dict]:
        return read_records(self.rank_path(rank) / stream, stream, self.problems)

    def steps(self, rank: int) -> list[dict]:
        """The rank's step records; one whose step number is no count of steps (negative, not an
        integer, or past MAX_STEP) is damage, left out and noted."""
        out = []
        for rec in self.records(rank, "steps"):
            n = rec.get("step")
            if not (type(n) is int and 0 <= n <= MAX_STEP):
                if len(self.problems) < 1000:
                    self.problems.append(f"rank {rank}: a step record numbered {str(n)[:40]!r}, left out")
                continue
            for field in MAX_STEP_COUNTS:
                if not plausible_count(rec.get(field), field):
                    if len(self.problems) < 1000:
                        self.problems.append(f"rank {rank}: step {n} counts {str(rec.get(field))[:40]} {field}, "
                                             "no count one step holds; left out")
                    rec = {**rec, field: None}
            out.append(rec)
        return out

    def samples(self, rank: int) -> list[dict]:
        return list(self.records(rank, "samples"))

    def events(self, rank: int) -> list[dict]:
        return list(self.records(rank, "events"))

    def windows(self, rank: int) -> list[dict]:
        d = self.rank_path(rank) / WINDOWS
        out = [read_json(p, self.problems) for p in sorted(d.glob("window-*.json"))] if d.is_dir() else []
        return [w for w in out if w]

    def traces(self, rank: int) -> list[Path]:
        d = self.rank_path(rank) / TRACES
        return sorted(p for p in d.iterdir() if ".json" in p.name) if d.is_dir() else []

    def nccl_logs(self, rank: int) -> list[Path]:
        d = self.rank_path(rank) / NCCL
        return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []
