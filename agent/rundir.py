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
        steps/steps-000000.jsonl    one JSON object per training step (step_record.py);
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

Every document is written whole to a temporary name and renamed into place (atomic_io.py),
so a reader never sees half a file and a crash never corrupts what was already written.
Record streams (steps, samples, events) are sequences of segment files read in index order
(segments.py): each is appended to as an open segment every `flush_s` (so a rank killed
without warning loses about a second) and sealed by a rename; a reader leaves out an open
segment's cut-off last line.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from diag.atomic_io import read_json
from diag.run_documents import RankRecords, WindowSummary, window_summary
from diag.segments import read_records
from diag.step_record import StepRecord, from_json_record

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

# How a rank's run ended (rank.json's status once it is not "running"): terminated is a stop
# from outside (SIGTERM), interrupted a Ctrl-C or an exit without closing the agent.
FINAL_STATUSES = ("completed", "failed", "interrupted", "terminated")

_RANK_DIR = re.compile(r"^rank-(\d+)$")


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


def expected_world_size(manifest: dict, rank_infos: list[dict | None]) -> int | None:
    """The largest world size the manifest or any rank.json states; None where none does."""
    sizes = [manifest.get("world_size")] + [(info or {}).get("world_size") for info in rank_infos]
    known = [s for s in map(world_size_number, sizes) if s is not None]
    return max(known) if known else None


def missing_ranks(world: int | None, present: list[int]) -> list[int]:
    """The ranks below the world size without a folder of their own."""
    have = set(present)
    return [r for r in range(world or 0) if r not in have]


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


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
        return expected_world_size(self.manifest(), [self.rank_info(r) for r in self.ranks()])

    def missing_ranks(self) -> list[int]:
        return missing_ranks(self.expected_world_size(), self.ranks())

    def rank_path(self, rank: int) -> Path:
        return self.path / rank_dir_name(rank)

    def rank_info(self, rank: int) -> dict | None:
        return read_json(self.rank_path(rank) / RANK_FILE, self.problems)

    def records(self, rank: int, stream: str) -> Iterator[dict]:
        return read_records(self.rank_path(rank) / stream, stream, self.problems)

    def steps(self, rank: int) -> list[StepRecord]:
        """The rank's step records, their types settled (step_record.from_json_record): one whose
        step number is no count of steps is damage, left out and noted."""
        recs = (from_json_record(raw, self.problems, f"rank {rank}: ") for raw in self.records(rank, "steps"))
        return [r for r in recs if r is not None]

    def samples(self, rank: int) -> list[dict]:
        return list(self.records(rank, "samples"))

    def events(self, rank: int) -> list[dict]:
        return list(self.records(rank, "events"))

    def rank_records(self, rank: int) -> RankRecords:
        """What the rank wrote besides its step records and traces (read by the run analysis
        itself, one rank at a time), each file read once."""
        return RankRecords(info=self.rank_info(rank) or {},
                           samples=[s for s in self.samples(rank) if type(s) is dict],
                           events=[e for e in self.events(rank) if type(e) is dict],
                           windows=self.windows(rank), traces=len(self.traces(rank)),
                           nccl_logs=len(self.nccl_logs(rank)))

    def windows(self, rank: int) -> list[WindowSummary]:
        """The rank's window summaries in file-name (first step) order, their types settled."""
        d = self.rank_path(rank) / WINDOWS
        out = [window_summary(read_json(p, self.problems)) for p in sorted(d.glob("window-*.json"))] \
            if d.is_dir() else []
        return [w for w in out if w is not None]

    def traces(self, rank: int) -> list[Path]:
        d = self.rank_path(rank) / TRACES
        return sorted(p for p in d.iterdir() if ".json" in p.name) if d.is_dir() else []

    def nccl_logs(self, rank: int) -> list[Path]:
        d = self.rank_path(rank) / NCCL
        return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []
