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

Every document is written whole to a temporary name and renamed into place (atomic_io.py),
so a reader never sees half a file and a crash never corrupts what was already written.
Record streams (steps, samples, events) are sequences of segment files read in index order
(segments.py): each is appended to as an open segment every `flush_s` (so a rank killed
without warning loses about a second) and sealed by a rename; a reader leaves out an open
segment's cut-off last line.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from diag.atomic_io import read_json
from diag.segments import read_records

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
    return bool(math.isfinite(value) and 0 <= float(value) <= MAX_STEP_COUNTS[field])

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
