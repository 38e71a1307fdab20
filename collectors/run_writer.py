"""Creates or joins the run directory and writes this rank's part of it.

Ranks of one launch must land in the same directory, and an earlier run must never be
overwritten. Both rest on a claim file (`.diag-claim.json`) created with O_EXCL: the
first rank to reach a free directory claims it for the launch's run id, the others
join it when the ids match, and a directory claimed by another run is passed over for
the next free sibling (`runs/exp1`, `runs/exp1-2`, ...).

The run id comes from the launcher (TORCHELASTIC_RUN_ID, SLURM_JOB_ID + step, the
OpenMPI/PMIx job id). When only MASTER_ADDR:MASTER_PORT is known the key is not unique
over time, so a rank joins such a claim only while it is fresh and only when its own
rank folder is not there yet; a second launch on the same port goes to a new directory.

Writing never hurts the training: the first OSError (disk full, read-only file system,
a file where a folder should be) switches writing off and is logged once.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from diag import atomic_io, rundir, segments
from diag.collectors.launch_env import LaunchInfo
from diag.collectors.loader_facts import cpu_facts

CLAIM = ".diag-claim.json"
# A claim keyed only by MASTER_ADDR:MASTER_PORT is joined within this many seconds.
JOIN_WINDOW_S = 600.0
FINAL_STATUSES = rundir.FINAL_STATUSES


def launcher_run_id(env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """(run id, unique) from the launcher's environment.

    `unique` is False for the MASTER_ADDR:MASTER_PORT fallback, which a later launch on
    the same port repeats.
    """
    env = os.environ if env is None else env
    if env.get("DIAG_RUN_ID"):
        return f"diag:{env['DIAG_RUN_ID']}", True
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic.lower() != "none":
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"torchelastic:{elastic}:{restart}", True
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "batch"
        return f"slurm:{env['SLURM_JOB_ID']}.{step}", True
    for name in ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"):
        if env.get(name):
            return f"mpi:{env[name]}", True
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        key = f"master:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        if elastic:  # torchrun without --rdzv-id: keep the restart apart
            key += f":{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return key, False
    return None, True


def default_base(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("DIAG_RUN_DIR"):
        return Path(env["DIAG_RUN_DIR"])
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else "run"
    return Path("runs") / (script or "run")


# A claim that cannot be parsed is read again this often (it is written whole, so only a
# claim from a foreign tool or a damaged disk stays unreadable), then taken as foreign.
CLAIM_READ_TRIES = 50
CLAIM_READ_PAUSE_S = 0.01


def _read_claim(path: Path) -> dict | None:
    """The claim of a directory; None when there is none, {} when it stays unreadable."""
    for attempt in range(CLAIM_READ_TRIES):
        try:
            with open(path / CLAIM, encoding="utf-8") as f:
                obj = json.load(f)
            return obj if isinstance(obj, dict) else {}
        except FileNotFoundError:
            return None
        except OSError:
            return {}  # unreadable (a file where a folder should be, no permission): not ours
        except ValueError:
            if attempt + 1 < CLAIM_READ_TRIES:
                time.sleep(CLAIM_READ_PAUSE_S)
    return {}


def _claim_of_winner(path: Path) -> dict | None:
    """The claim of the peer that won the race for `path`: present at once with hard links,
    a moment later on file systems where the claim is renamed into place under a lock."""
    for _ in range(CLAIM_READ_TRIES):
        current = _read_claim(path)
        if current is not None:
            return current
        time.sleep(CLAIM_READ_PAUSE_S)
    return None


def _try_claim(path: Path, claim: dict) -> bool:
    return atomic_io.create_exclusive(path / CLAIM, json.dumps(claim).encode("utf-8"))


def _is_earlier_content(path: Path) -> bool:
    """A directory holding anything but a claim (or a claim being made) belongs to someone else."""
    try:
        return any(not atomic_io.is_claim_part(c.name, CLAIM) for c in path.iterdir())
    except FileNotFoundError:
        return False


def resolve_run_dir(
    base: str | os.PathLike,
    run_id: str,
    unique: bool,
    rank: int,
    overwrite: bool = False,
    max_tries: int = 1000,
) -> Path:
    """The directory this launch writes to: `base` or the first free `base-N`."""
    base = Path(base)
    claim = {"run_id": run_id, "unique": unique, "claimed_unix": time.time(), "claimed_by_rank": rank}
    if overwrite:
        current = _read_claim(base)
        if current is None or current.get("run_id") != run_id:
            base.mkdir(parents=True, exist_ok=True)
            atomic_io.atomic_write_json(base / CLAIM, claim)
        _clear_stale(base, run_id, rank)
        return base
    for i in range(1, max_tries + 1):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        current = _read_claim(path)
        if current is None:
            if path.exists() and _is_earlier_content(path):
                continue  # an earlier run, or a folder diag did not create
            if _try_claim(path, claim):
                return path
            current = _claim_of_winner(path)
        if current and current.get("run_id") == run_id:
            if unique:
                return path
            fresh = time.time() - float(current.get("claimed_unix", 0)) < JOIN_WINDOW_S
            if fresh and not (path / rundir.rank_dir_name(rank)).exists():
                return path
    raise OSError(f"{base}: no free run directory after {max_tries} tries")


def _clear_stale(path: Path, run_id: str, rank: int) -> None:
    """overwrite=True: remove what an earlier run left in our own rank folder (and, on rank 0,
    the job-level files). Peers clear their own folders, so no rank deletes a live one."""
    own = path / rundir.rank_dir_name(rank)
    info = atomic_io.read_json(own / rundir.RANK_FILE) or {}
    if own.exists() and info.get("run_id") != run_id:
        shutil.rmtree(own, ignore_errors=True)
    if rank == 0:
        manifest = atomic_io.read_json(path / rundir.MANIFEST) or {}
        if manifest.get("run_id") not in (None, run_id):
            for name in (rundir.MANIFEST, "report.html", "report.md", "summary.json"):
                try:
                    (path / name).unlink()
                except OSError:
                    pass


def library_versions() -> dict:
    out: dict[str, str | None] = {"python": platform.python_version()}
    try:
        from diag import __version__

        out["diag"] = __version__
    except Exception:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = getattr(torch, "__version__", None)
        out["cuda"] = getattr(torch.version, "cuda", None)
        out["hip"] = getattr(torch.version, "hip", None)
        try:
            if torch.cuda.is_available():
                v = torch.cuda.nccl.version()
                out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    return out


# live.json's encoder; anything not JSON (a numpy number, a path) is written as its text.
_LIVE_ENCODER = msgspec.json.Encoder(enc_hook=str)


class RunWriter:
    """This rank's writer: rank.json, the record streams, window summaries, the manifest.

    Thread-safe; every write goes through `_guard`, which turns the first OSError into
    "writing off" for the rest of the run.
    """

    def __init__(
        self,
        path: Path,
        launch: LaunchInfo,
        run_id: str,
        config: dict | None = None,
        log: Callable[[str], None] | None = None,
        max_stream_bytes: int = 256 << 20,
    ):
        self.path = Path(path)
        self.launch = launch
        self.rank = launch.rank
        self.run_id = run_id
        self.config = dict(config or {})
        self.rank_path = self.path / rundir.rank_dir_name(self.rank)
        self._log = log or (lambda msg: print(f"diag: {msg}", file=sys.stderr))
        self._lock = threading.RLock()
        self.enabled = True
        self.error: str | None = None
        self.started_unix = time.time()
        self.info: dict = {
            "schema": rundir.RANK_SCHEMA,
            "run_id": run_id,
            "rank": launch.rank,
            "world_size": launch.world_size,
            "local_rank": launch.local_rank,
            "local_world_size": launch.local_world_size,
            "node_rank": launch.node_rank,
            "host": launch.hostname,
            "launcher": launch.launcher,
            "pid": os.getpid(),
            "backend": None,  # torch.distributed's backend once the process group exists
            "device": None,
            "cpu": cpu_facts(),
            "status": "running",
            "started_unix": self.started_unix,
            "updated_unix": self.started_unix,
            "ended_unix": None,
            "steps": 0,
            "last_step": None,
            "error": None,
            "collectors": {},
        }
        self._streams: dict[str, segments.SegmentWriter] = {}
        self._guard(self._open, max_stream_bytes)

    @classmethod
    def open(
        cls,
        base: str | os.PathLike | None,
        launch: LaunchInfo,
        run_id: str | None = None,
        overwrite: bool = False,
        config: dict | None = None,
        log: Callable[[str], None] | None = None,
    ) -> RunWriter:
        """Resolve the directory for this launch and open this rank's writer.

        Never raises: a directory that cannot be created gives a writer that is off.
        """
        env_id, unique = launcher_run_id()
        if run_id is not None:
            rid, unique = f"user:{run_id}", True
        elif env_id is not None:
            rid = env_id
        elif launch.world_size <= 1:
            rid, unique = f"local:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}", True
        else:
            rid, unique = f"unknown:{launch.world_size}", False
        base = Path(base) if base is not None else default_base()
        try:
            path = resolve_run_dir(base, rid, unique, launch.rank, overwrite=overwrite)
        except OSError as exc:
            writer = cls.__new__(cls)
            writer._init_disabled(base, launch, rid, config, log, exc)
            return writer
        return cls(path, launch, rid, config=config, log=log)

    def _init_disabled(self, base, launch, rid, config, log, exc) -> None:
        self.path = Path(base)
        self.launch = launch
        self.rank = launch.rank
        self.run_id = rid
        self.config = dict(config or {})
        self.rank_path = self.path / rundir.rank_dir_name(self.rank)
        self._log = log or (lambda msg: print(f"diag: {msg}", file=sys.stderr))
        self._lock = threading.RLock()
        self.started_unix = time.time()
        self.info = {"rank": launch.rank, "status": "running", "steps": 0}
        self._streams = {}
        self.enabled = False
        self.error = f"{base}: cannot create the run directory ({_describe(exc)}); the run is not recorded"
        self._log(self.error)

    def _open(self, max_stream_bytes: int) -> None:
        self.rank_path.mkdir(parents=True, exist_ok=True)
        for stream in rundir.STREAMS:
            self._streams[stream] = segments.SegmentWriter(
                self.rank_path / stream,
                stream,
                max_bytes=max_stream_bytes,
                on_full=self._log,
            )
        (self.rank_path / rundir.WINDOWS).mkdir(exist_ok=True)
        (self.rank_path / rundir.TRACES).mkdir(exist_ok=True)
        atomic_io.atomic_write_json(self.rank_path / rundir.RANK_FILE, self.info)
        if self.rank == 0:
            atomic_io.atomic_write_json(self.path / rundir.MANIFEST, self._manifest("running"))

    # -- the guard ------------------------------------------------------------------

    def _guard(self, fn, *args):
        if not self.enabled:
            return None
        try:
            with self._lock:
                return fn(*args)
        except OSError as exc:
            self.enabled = False
            self.error = f"{self.rank_path}: writing failed ({_describe(exc)}); the agent stops writing, training goes on"
            self._log(self.error)
        return None

    # -- records --------------------------------------------------------------------

    def write_record(self, stream: str, record: dict) -> None:
        w = self._streams.get(stream)
        if w is not None:
            self._guard(w.write, record)

    def flush(self) -> None:
        """Every stream's records written and its open segment sealed."""
        for w in list(self._streams.values()):
            self._guard(w.flush)

    def sync(self) -> None:
        """Every stream's buffered records appended to its open segment (what a killed rank
        keeps), cheaply: no segment sealed before it is full or old."""
        for w in list(self._streams.values()):
            self._guard(w.sync)

    def record_tree_settings(self, settings: dict) -> None:
        """The run's decision-tree settings, written once: the first rank to get here records them."""
        data = json.dumps(settings, sort_keys=True).encode("utf-8")
        self._guard(atomic_io.create_exclusive, self.path / rundir.TREE_SETTINGS, data)

    def update_info(self, **fields) -> None:
        self.info.update(fields)

    def heartbeat(self, **fields) -> None:
        self.info.update(fields)
        self.info["updated_unix"] = time.time()
        self._guard(atomic_io.atomic_write_json, self.rank_path / rundir.RANK_FILE, dict(self.info))

    def write_live(self, doc: dict) -> None:
        # Every second: encoded in C (the json module's pretty printer takes a millisecond of GIL),
        # renamed into place whole but not flushed to disk (a crash loses nothing that matters, and a
        # flush a second per rank would load a shared file system).
        data = _LIVE_ENCODER.encode(doc) + b"\n"
        self._guard(atomic_io.atomic_write_bytes, self.rank_path / rundir.LIVE_FILE, data, False)

    def close(self, status: str, error: str | None = None) -> None:
        self.flush()
        now = time.time()
        self.heartbeat(status=status, ended_unix=now, error=error)

    # -- the manifest (rank 0) ------------------------------------------------------

    def _manifest(self, status: str, peers: dict | None = None) -> dict:
        ranks = peers or {self.rank: self.info}
        hosts = sorted({str(i.get("host")) for i in ranks.values() if i and i.get("host")})
        devices = [
            {"rank": r, "host": i.get("host"), "device": i.get("device")}
            for r, i in sorted(ranks.items())
            if i
        ]
        # The process group's backend and size, as the ranks recorded them (None: no group).
        backends = [i.get("backend") for _, i in sorted(ranks.items()) if i and i.get("backend")]
        return {
            "schema": rundir.RUN_SCHEMA,
            "run_id": self.run_id,
            "world_size": int(self.info.get("world_size") or self.launch.world_size),
            "backend": backends[0] if backends else None,
            "launcher": self.launch.launcher,
            "job_id": self.launch.job_id,
            "master": f"{self.launch.master_addr}:{self.launch.master_port}" if self.launch.master_addr else None,
            "hosts": hosts,
            "ranks": [
                {"rank": r, "host": i.get("host"), "local_rank": i.get("local_rank"), "status": i.get("status")}
                for r, i in sorted(ranks.items())
                if i
            ],
            "devices": devices,
            "versions": library_versions(),
            "command": list(sys.argv),
            "config": self.config,
            "started_unix": self.started_unix,
            "ended_unix": None if status == "running" else time.time(),
            "status": status,
        }

    def read_peers(self) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        for r in range(max(self.launch.world_size, 1)):
            if r == self.rank:
                out[r] = dict(self.info)
            else:
                out[r] = atomic_io.read_json(self.path / rundir.rank_dir_name(r) / rundir.RANK_FILE)
        return out

    def wait_for_peers(self, timeout_s: float, stale_s: float, poll_s: float = 0.5) -> dict[int, dict | None]:
        """Wait (bounded) until every rank's rank.json shows a final status.

        A rank whose heartbeat stops moving for `stale_s` is given up on: it was killed
        or hangs, and the job report names it.
        """
        deadline = time.monotonic() + max(timeout_s, 0.0)
        seen: dict[int, tuple[float, float]] = {}
        peers = self.read_peers()
        while self.enabled:
            pending = []
            now = time.monotonic()
            for r, info in peers.items():
                if info and info.get("status") in FINAL_STATUSES:
                    continue
                beat = float((info or {}).get("updated_unix") or 0.0)
                last_beat, since = seen.get(r, (None, now))
                if last_beat != beat:
                    seen[r] = (beat, now)
                    since = now
                if now - since < stale_s:
                    pending.append(r)
            if not pending or now >= deadline:
                break
            time.sleep(poll_s)
            peers = self.read_peers()
        return peers

    def write_manifest(self, status: str, peers: dict | None = None) -> None:
        if self.rank != 0:
            return
        doc = self._manifest(status, peers)
        lost = sorted(r for r, i in (peers or {}).items() if not i or i.get("status") not in FINAL_STATUSES)
        doc["lost_ranks"] = lost
        self._guard(atomic_io.atomic_write_json, self.path / rundir.MANIFEST, doc)


def _describe(exc: OSError) -> str:
    return getattr(exc, "strerror", None) or str(exc)
