"""The measuring half of `diag nccl`: it runs inside every rank and times collectives like nccl-tests.

One process per GPU (or per CPU worker on gloo). For each collective, data type and
reduction op it sweeps message sizes from min_bytes to max_bytes and, at each size,
measures an out-of-place and an in-place run, following nccl-tests' `BenchTime`:

  fill the buffers -> one untimed call -> barrier -> `iters` timed calls -> wait for the
  device -> per-rank time per call -> combined across ranks (`average`: 1 = mean, the
  nccl-tests default; 0 = rank 0, 2 = min, 3 = max) -> algbw, busbw -> optional check.

Before measuring, every size from min_bytes to max_bytes by a factor of 2 is called
`warmup_iters` times, as nccl-tests has done since 2025. max_bytes is first lowered to what
every rank's memory holds, by nccl-tests' rule (`memory_limit`), and the check compares a
chunk at a time, so `-e 8G -c 1` fits where nccl-tests' does.

Byte counts follow nccl-tests' `getCollByteCount`: all_gather, reduce_scatter and alltoall
split the buffer into per-rank slices aligned to 16 bytes, so the `count` column holds the
per-rank element count and `size` the whole buffer. algbw = size / time (decimal GB/s);
busbw = algbw x factor, with factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and alltoall, 1 for broadcast, reduce and sendrecv.

Timing: on GPUs, CUDA events recorded on the current stream around the timed loop (the
process group makes the current stream wait for its own); on CPUs, the wall clock
(`time.perf_counter`) after a barrier. `nccl_comm.Timer` is the only difference between the two
paths: buffers, calls, checks and bookkeeping are shared.

torch.distributed offers all_reduce, broadcast and reduce in place only. Their
"out-of-place" column therefore times the same call on a separate receive buffer, which
the check seeds from the send buffer; alltoall and sendrecv in place run with one buffer
for input and output, as nccl-tests does, and are not checked (#wrong N/A).

Failures: a backend that lacks an operation or data type (gloo has no uint32/uint64
reductions, for example) raises on the first call; the test is reported as skipped with
the backend's message and the run goes on. Any other error (a peer that died, a
collective that timed out) ends the run: the rows measured so far are kept and the test
is reported with status "partial". A watchdog thread guarantees that no rank waits more
than about twice `timeout` without progress, even where the backend itself would hang.

Fault injection, for the test-suite only: DIAG_NCCL_TEST_FAULT="exit:RANK:N" makes rank
RANK leave abruptly (os._exit) after it measured N rows; "hang:RANK:N" makes it stop
responding after N rows, so that the timeout and the watchdog can be exercised.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from diag.collectors import launch_env
from diag.collectors.nccl_case import Case
from diag.collectors.nccl_comm import Comm, Timer, Watchdog, fault, watchdog_limit
from diag.collectors.nccl_sizes import (  # the public names of __all__ among them
    COLLECTIVES,
    DTYPES,
    GIB,
    REDUCING,
    ROOTED,
    bandwidths,
    bus_factor,
    coll_counts,
    memory_limit,
    memory_of,
    normalize_collective,
    normalize_dtype,
    parse_size,
    sweep_sizes,
    warmup_sizes,
)

SCHEMA = "diag.nccl_bench/1"
REDOPS = ("sum", "prod", "max", "min", "avg")
AVERAGE_MODES = {0: "rank0", 1: "avg", 2: "min", 3: "max"}
SETUP_TIMEOUT = 120.0  # seconds for every rank to join the process group

# Messages with which backends refuse an operation, a data type or a reduction op.
_UNSUPPORTED = re.compile(
    r"not supported|unsupported|invalid scalar type|cannot use reduceop|not implemented|"
    r"does not support|no support|only supports|can't be cast|cannot be cast", re.IGNORECASE
)


class BenchError(Exception):
    """A run that cannot continue (peer failure, timeout, termination)."""


class _Unsupported(Exception):
    pass


# ---------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    collectives: list[str] = field(default_factory=lambda: ["all_reduce"])
    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    step_factor: int = 1
    step_bytes: int = 1 << 20
    dtypes: list[str] = field(default_factory=lambda: ["float"])
    redops: list[str] = field(default_factory=lambda: ["sum"])
    root: int = 0
    warmup_iters: int = 1  # nccl-tests' default since it warms every size
    iters: int = 20
    check: int = 1
    average: int = 1
    timeout: float = 300.0
    backend: str | None = None  # None: nccl when CUDA is available, else gloo

    def sizes(self) -> list[int]:
        return sweep_sizes(self.min_bytes, self.max_bytes, self.step_factor, self.step_bytes)

    def params(self) -> dict:
        return {
            "nthread": 1, "ngpus": 1, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
            "step_factor": self.step_factor if self.step_factor > 1 else 0,
            "step_bytes": self.step_bytes if self.step_factor <= 1 else 0,
            "warmup_iters": self.warmup_iters, "iters": self.iters, "agg_iters": 1,
            "check": self.check, "graph": 0, "average": AVERAGE_MODES.get(self.average, "avg"),
            "dtypes": list(self.dtypes), "redops": list(self.redops), "root": self.root,
            "timeout_s": self.timeout,
        }

    def row_count(self) -> int:
        per = len(self.sizes()) * len(self.dtypes)
        return sum(per * (len(self.redops) if c in REDUCING else 1) for c in self.collectives)


class Reporter(Protocol):
    """What rank 0 is told while it measures; the command prints from these calls."""

    def start(self, doc: dict) -> None: ...
    def test_start(self, test: dict) -> None: ...
    def row(self, test: dict, row: dict) -> None: ...
    def note(self, test: dict, message: str) -> None: ...
    def test_end(self, test: dict) -> None: ...


# ---------------------------------------------------------------- the run


def rendezvous_env(info: launch_env.LaunchInfo, env=None) -> dict:
    """The env:// variables torch.distributed needs, for launchers that do not set them.

    torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself. Under srun and
    mpirun the rank comes from their variables; the master is MASTER_ADDR when given,
    else the first node of the Slurm allocation, else this host when the whole job runs
    on it. The port is MASTER_PORT, else one derived from the job id so that concurrent
    jobs on a node do not collide.
    """
    env = os.environ if env is None else env
    out = {"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size), "LOCAL_RANK": str(info.local_rank),
           "LOCAL_WORLD_SIZE": str(info.local_world_size)}
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        hosts = launch_env.expand_slurm_nodelist(nodelist) if nodelist else []
        if hosts:
            addr = hosts[0]
        elif info.local_world_size >= info.world_size:
            addr = "127.0.0.1"
        else:
            raise BenchError(f"{info.launcher} launch across nodes: set MASTER_ADDR (and MASTER_PORT) to rank 0's host")
    port = env.get("MASTER_PORT")
    if not port:
        job = re.sub(r"\D", "", info.job_id or "")
        port = str(29500 + (int(job) % 10000 if job else 0))
    out.update(MASTER_ADDR=addr, MASTER_PORT=port)
    return out


def _init_process_group(cfg: BenchConfig, info: launch_env.LaunchInfo):
    import datetime

    import torch
    import torch.distributed as dist

    backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise BenchError("the nccl backend needs CUDA (or ROCm) devices; none is visible")
        # Let NCCL errors and timeouts surface as exceptions instead of hanging the stream.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device = torch.device("cuda", info.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    created = not dist.is_initialized()
    if created and info.launcher not in ("torchrun", "none"):
        os.environ.update(rendezvous_env(info))
    if created:
        # Joining waits for the slowest rank to start (importing torch on a loaded node takes
        # seconds), so it gets a generous timeout; the measurements use their own group below.
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=max(cfg.timeout, SETUP_TIMEOUT))}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    if backend == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    return backend, device, group, created


def _device_entry(rank: int, device) -> dict:
    entry = {"rank": rank, "group": 0, "pid": os.getpid(), "host": socket.gethostname(),
             "device": -1, "bus_id": 0, "name": "cpu"}
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        entry.update(device=device.index, name=props.name,
                     bus_id=int(getattr(props, "pci_bus_id", 0) or 0),
                     memory_bytes=int(props.total_memory))
        if getattr(torch.version, "hip", None):
            entry["runtime"] = "rocm"
    else:
        entry["name"] = _cpu_name()
    return entry


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "CPU"


def _first_line(exc: BaseException) -> str:
    """One readable line: gloo prefixes its messages with a source location and ends them in jokes."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", lines[0] if lines else "")
    text = re.sub(r"\s*GLHF!.*$", "", text)
    return f"{type(exc).__name__}: {text}".strip()


def _new_test(collective: str, comm: Comm, cfg: BenchConfig, timer_kind: str) -> dict:
    return {
        "collective": collective, "world_size": comm.world, "backend": comm.backend, "rows": [],
        "avg_busbw_gbps": None, "status": "ok", "errors": [], "skipped": False, "skipped_cases": [],
        "timer": timer_kind, "dtypes": list(cfg.dtypes),
        "redops": list(cfg.redops) if collective in REDUCING else ["none"],
        "root": cfg.root if collective in ROOTED else -1,
    }


def _finish_test(test: dict) -> None:
    values = [
        (row.get(k) or {}).get("busbw_gbps") for row in test["rows"] for k in ("out_of_place", "in_place")
    ]
    values = [v for v in values if v is not None]
    test["avg_busbw_gbps"] = sum(values) / len(values) if values else None


class _Run:
    def __init__(self, cfg: BenchConfig, comm: Comm, reporter: Reporter | None):
        self.cfg = cfg
        self.comm = comm
        self.reporter = reporter
        self.timer = Timer(comm)
        self.rows_done = 0
        self.fault = fault(comm.rank)

    def bench_time(self, case: Case, in_place: bool, watchdog: Watchdog) -> dict:
        cfg, comm = self.cfg, self.comm
        if cfg.check:
            case.prepare(in_place)
        send, recv = case.views(in_place)
        case.call(send, recv)
        comm.sync()
        self.timer.start()
        for _ in range(cfg.iters):
            case.call(send, recv)
            watchdog.last = time.monotonic()
        seconds = self.timer.stop() / max(cfg.iters, 1)
        per_rank = comm.gather_floats(seconds)
        mode = cfg.average
        if mode == 0:
            combined = per_rank[0]
        elif mode == 2:
            combined = min(per_rank)
        elif mode == 3:
            combined = max(per_rank)
        else:
            combined = sum(per_rank) / len(per_rank)
        algbw, busbw = bandwidths(case.collective, case.counts, case.elt, combined, comm.world)
        wrong: int | None = None
        if cfg.check and case.checkable(in_place):
            wrong = 0
            for _ in range(cfg.check):
                expected = case.prepare(in_place)
                case.call(*case.views(in_place))
                comm.sync()
                wrong = comm.sum_int(case.count_wrong(expected, in_place))
                if wrong:
                    break
        return {
            "time_us": combined * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            "wrong": wrong,
            "rank_time_us": [t * 1e6 for t in per_rank],
        }

    def maybe_fault(self) -> None:
        if self.fault and self.rows_done >= self.fault[1]:
            if self.fault[0] == "exit":
                os._exit(17)
            while True:  # "hang": stop responding; the watchdog or the launcher ends us
                time.sleep(3600)

    def run_case(self, test: dict, case: Case, watchdog: Watchdog) -> None:
        cfg = self.cfg
        sizes = cfg.sizes()
        if case.collective == "sendrecv" and self.comm.world == 1 and self.comm.backend == "gloo":
            raise _Unsupported("gloo cannot send to its own rank, so a 1-rank ring has no link to measure")
        watchdog.kick(f"{case.collective} warm-up")
        # Every size from the smallest to the largest by a factor of 2, out of place, like
        # nccl-tests. The first call is always made (even with -w 0): a backend refuses what it
        # lacks there.
        for index, size in enumerate(warmup_sizes(sizes[0], sizes[-1])):
            case.setup(size)
            send, recv = case.views(False)
            for i in range(max(cfg.warmup_iters, 1) if index == 0 else cfg.warmup_iters):
                try:
                    case.call(send, recv)
                except Exception as exc:
                    if index == 0 and i == 0 and _UNSUPPORTED.search(str(exc)):
                        raise _Unsupported(str(exc).strip().splitlines()[0]) from exc
                    raise
            self.comm.sync()
        for size in sizes:
            self.maybe_fault()
            counts = case.setup(size)
            watchdog.kick(f"{case.collective} {case.dtype_name} {case.redop_name} size {size}")
            row = {
                "size_bytes": counts.table_bytes(case.elt),
                "count": counts.param,
                "dtype": case.dtype_name,
                "redop": case.redop_name,
                "root": case.root,
            }
            row["out_of_place"] = self.bench_time(case, False, watchdog)
            row["in_place"] = self.bench_time(case, True, watchdog)
            test["rows"].append(row)
            self.rows_done += 1
            if self.reporter:
                self.reporter.row(test, row)

    def run_test(self, test: dict, watchdog: Watchdog) -> dict:
        cfg, comm = self.cfg, self.comm
        collective = test["collective"]
        if self.reporter:
            self.reporter.test_start(test)
        redops = cfg.redops if collective in REDUCING else ["sum"]
        try:
            for dtype in cfg.dtypes:
                for redop in redops:
                    case = None
                    try:
                        case = Case(comm, collective, dtype, redop, cfg.root, cfg.max_bytes)
                        self.run_case(test, case, watchdog)
                    except _Unsupported as exc:
                        what = f"{collective} with {dtype}" + (f" and {redop}" if collective in REDUCING else "")
                        msg = f"the {comm.backend} backend does not support {what}: {exc}; skipped"
                        test["skipped_cases"].append(msg)
                        if self.reporter:
                            self.reporter.note(test, msg)
                    finally:
                        del case  # free this case's buffers before the next one allocates its own
        except BaseException as exc:
            test["errors"].append(_first_line(exc) if not isinstance(exc, BenchError) else str(exc))
            test["status"] = "partial" if test["rows"] else "failed"
            _finish_test(test)
            raise BenchError(test["errors"][-1]) from exc
        if not test["rows"] and test["skipped_cases"]:
            test["status"] = "failed"
            test["skipped"] = True
            test["errors"].extend(test["skipped_cases"])
        _finish_test(test)
        return test


# Printed above the tables of a GPU run: where its times differ from nccl-tests' by design.
LATENCY_NOTE = ("times include torch.distributed's per-call overhead (Python, the process group's work "
                "object, stream ordering), which nccl-tests does not pay: below about 1 MB the time column "
                "reads higher and busbw lower than nccl-tests' on the same GPUs; large sizes compare directly")


def _within_memory(cfg: BenchConfig, comm: Comm, info: launch_env.LaunchInfo, doc: dict) -> BenchConfig:
    """The configuration with maxBytes lowered to what every rank's memory allows (nccl-tests' rule)."""
    total, free = memory_of(comm.device, info.local_world_size)
    limit = int(min(comm.gather_floats(float(memory_limit(total, free, cfg.check > 0)))))
    doc["memory_limit_bytes"] = limit
    if cfg.max_bytes <= limit:
        return cfg
    if limit <= 0:
        raise BenchError(f"not enough memory for any message on at least one rank by nccl-tests' rule "
                         f"({free / GIB:.1f} GiB free of {total / GIB:.1f} GiB on rank {comm.rank})")
    cfg = dataclasses.replace(cfg, max_bytes=limit, min_bytes=min(cfg.min_bytes, limit))
    doc["params"] = cfg.params()
    doc["notes"].append(f"Reducing maxBytes to {limit} due to memory limitation")
    return cfg


def _run_tests(cfg: BenchConfig, comm, run, doc: dict, reporter, watchdog) -> bool:
    """Each configured collective's test, in order, into `doc`; False when one failed (the
    rest are not run)."""
    for collective in cfg.collectives:
        test = _new_test(collective, comm, cfg, run.timer.kind)
        doc["tests"].append(test)
        try:
            run.run_test(test, watchdog)
        except BenchError:
            doc["status"] = test["status"]
            if reporter:
                reporter.test_end(test)
            return False
        test["_done"] = True
        if reporter:
            reporter.test_end(test)
    return True


def run_rank(cfg: BenchConfig, reporter: Reporter | None = None, info: launch_env.LaunchInfo | None = None,
             on_abort=None) -> dict:
    """Measure every configured collective in this rank; every rank returns the document.

    Joins the process group from the launcher's environment, or uses the one already
    initialised (which it then leaves in place), and measures on a group of its own.

    `reporter` receives the rows as they are measured (pass one on rank 0 only). When a
    peer dies or a collective times out, the document comes back with the failing test
    marked "partial" (or "failed") and the remaining tests absent; `on_abort(doc)` is
    called with that document if the watchdog has to end the process instead.
    """
    info = info or launch_env.detect()
    for c in cfg.collectives:
        normalize_collective(c)
    cfg.sizes()  # validate before any process waits for another
    doc: dict[str, Any] = {
        "schema": SCHEMA, "source": "diag nccl", "tests": [], "status": "ok", "errors": [],
        "launcher": info.launcher, "world_size": info.world_size, "params": cfg.params(), "notes": [],
    }

    def expire(reason: str) -> None:
        doc["errors"].append(reason)
        doc["status"] = "partial" if any(t["rows"] for t in doc["tests"]) else "failed"
        for t in doc["tests"]:
            if t["status"] == "ok" and not t.get("_done"):
                t["status"] = "partial" if t["rows"] else "failed"
                t["errors"].append(reason)
                _finish_test(t)
        if on_abort is not None:
            on_abort(_public(doc))

    watchdog = Watchdog(watchdog_limit(max(cfg.timeout, SETUP_TIMEOUT)), expire)
    previous = _install_sigterm()
    try:
        try:
            backend, device, group, created = _init_process_group(cfg, info)
        except BenchError:
            raise
        except Exception as exc:
            raise BenchError(f"could not join the process group: {_first_line(exc)}") from exc
        watchdog.kick("start")
        watchdog.limit = watchdog_limit(cfg.timeout)
        import torch.distributed as dist

        comm = Comm(backend, device, group)
        cfg = _within_memory(cfg, comm, info, doc)
        if any(c in ROOTED for c in cfg.collectives) and not 0 <= cfg.root < comm.world:
            raise BenchError(f"root {cfg.root} is not a rank of this {comm.world}-rank job")
        run = _Run(cfg, comm, reporter)
        doc.update(world_size=comm.world, backend=backend, timer=run.timer.kind)
        if backend == "nccl":
            doc["notes"].append(LATENCY_NOTE)
        entries: list = [None] * comm.world
        dist.all_gather_object(entries, _device_entry(comm.rank, device), group=group)
        doc["devices"] = entries
        doc["hosts"] = sorted({e["host"] for e in entries if e})
        if reporter:
            reporter.start(doc)
        if _run_tests(cfg, comm, run, doc, reporter, watchdog):
            # Leave a process group the caller made (a training job, a benchmark) as it was.
            try:
                dist.destroy_process_group(None if created else group)
            except Exception:
                pass
    except (BenchError, _Terminated) as exc:
        doc["errors"].append(str(exc))
        doc["status"] = "partial" if any(t["rows"] for t in doc["tests"]) else "failed"
    finally:
        watchdog.stop()
        _restore_sigterm(previous)
    return _public(doc)


def _public(doc: dict) -> dict:
    out = dict(doc)
    out["tests"] = [{k: v for k, v in t.items() if not k.startswith("_")} for t in doc["tests"]]
    return out


class _Terminated(BaseException):
    pass


def _install_sigterm():
    """The launcher stops the survivors with SIGTERM when a peer fails: report, don't vanish."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise _Terminated("terminated by the launcher (SIGTERM): another rank failed")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return None


def _restore_sigterm(previous) -> None:
    if previous is not None:
        try:
            signal.signal(signal.SIGTERM, previous)
        except (ValueError, OSError):
            pass


__all__ = [
    "SCHEMA", "COLLECTIVES", "DTYPES", "REDOPS", "BenchConfig", "BenchError", "Reporter",
    "parse_size", "sweep_sizes", "bus_factor", "coll_counts", "bandwidths", "run_rank",
    "normalize_dtype", "normalize_collective",
]

if __name__ == "__main__":  # pragma: no cover - use `diag nccl`
    sys.exit("run `diag nccl` instead")
