"""`diag demo`: a small DDP job on gloo in N CPU processes, trained under the agent.

Each bottleneck is induced the way it happens in real jobs:
- data: a dataset whose __getitem__ waits on slow storage, read with num_workers=0;
- comm: a wide model on a tiny batch, so gradient all-reduce dwarfs the arithmetic;
- compute: large matrix multiplications;
- memory: a model of long elementwise chains over large activations;
- host: a Python loop over a tensor's elements, each pulled to Python with .item() (a sync each);
- none: a healthy compute-bound MLP fed by an in-memory DataLoader that gathers whole batches.

The ranks are started with torch.multiprocessing and the torchrun environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), so the agent sees them as any launched
job. The parent claims the run directory first and hands its id to the ranks, so a
demo never overwrites an earlier run.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.diagnosis_document import Diagnosis
from diag.errors import DiagRunError

BOTTLENECKS = ("data", "comm", "compute", "memory", "host", "none")
DEFAULT_STEPS = 32
# Induced stragglers: one rank's batches arrive late, as from a slow or skewed input pipeline.
STRAGGLERS = ("persistent", "rotating", "transient")
ROTATE_EVERY = 3  # rotating: the late rank moves on every this many steps


def late_rank(kind: str | None, step: int, world: int, steps: int) -> int | None:
    """The rank whose batch of `step` arrives late: rank 1 throughout (persistent), each rank in
    turn (rotating), or the last rank for a sixth of the run from its middle (transient)."""
    if kind == "persistent":
        return 1 % world
    if kind == "rotating":
        return (step // ROTATE_EVERY) % world
    if kind == "transient":
        start = steps // 2
        return world - 1 if start <= step < start + max(3, steps // 6) else None
    return None


# How late a straggler's batch arrives. Of two ranks the late one leads their median by half
# of it; beside a CPU-bound job the run's own noise band reached 43 ms, above the 25 ms that
# 50 ms gave, and the rotating demo found no episode.
LATE_BATCH_S = 0.15


def _late_batches(batches, kind: str, rank: int, world: int, steps: int):
    """The batches, each LATE_BATCH_S late where `late_rank` names this rank."""
    for step, batch in enumerate(batches):
        if late_rank(kind, step, world, steps) == rank:
            time.sleep(LATE_BATCH_S)
        yield batch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(steps: int) -> dict:
    """Profiler windows that fit the demo: skip start-up, then a few windows of 3 steps."""
    skip = 3 if steps < 40 else 5
    every = max(8, (steps - skip) // 3)
    return {"skip_first": skip, "warmup": 1, "active": 3, "every": every}


# -- the workloads ---------------------------------------------------------------------------


class SlowStorage:
    """A map-style dataset whose every sample is a read from slow storage (a network file
    system, an object store): 4 ms of waiting, little CPU. At module level, so that DataLoader
    workers started by spawn can unpickle it."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        import torch

        time.sleep(0.004)
        g = torch.Generator().manual_seed(i)
        return torch.randn(256, generator=g), int(i % 10)


def _build(bottleneck: str, rank: int, workers: int = 0):
    """(model, batches iterable, step function(model, batch) -> loss tensor, samples per step);
    `workers` is the data workload's DataLoader num_workers."""
    import torch
    from torch import nn

    torch.manual_seed(1234 + rank)

    if bottleneck == "data":
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
        # `workers` applies the data cause's action: worker processes that outlive each epoch.
        loader = torch.utils.data.DataLoader(SlowStorage(), batch_size=32, num_workers=workers,
                                             persistent_workers=workers > 0)
        return model, loader, _classify, 32

    if bottleneck == "comm":
        # A recommender-style embedding table with dense gradients: 8M parameters (32 MB of
        # gradient to all-reduce every step) for a handful of lookups and a tiny head.
        class Recommender(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = nn.Embedding(1 << 18, 32)
                self.head = nn.Linear(32, 1)

            def forward(self, ids):
                return self.head(self.table(ids).mean(dim=1))

        g = torch.Generator().manual_seed(rank)
        batches = _repeat([(torch.randint(0, 1 << 18, (64, 8), generator=g), torch.randn(64, 1, generator=g))])
        return Recommender(), batches, _regress, 64

    if bottleneck == "compute":
        # Many FLOPs per parameter (a large batch through square layers), so the gradient
        # all-reduce stays small beside the matrix multiplications.
        model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 1024))
        batches = _repeat([(torch.randn(1024, 1024), torch.randn(1024, 1024))])
        return model, batches, _regress, 1024

    if bottleneck == "memory":

        class Elementwise(nn.Module):
            # Per-feature scales and shifts between activations, as in norm-heavy blocks
            # before fusion: every op reads and writes the whole activation.
            def __init__(self, width: int, depth: int):
                super().__init__()
                self.scale = nn.Parameter(torch.ones(depth, width))
                self.shift = nn.Parameter(torch.zeros(depth, width))

            def forward(self, x):
                for k in range(self.scale.shape[0]):
                    x = torch.nn.functional.gelu(x * self.scale[k] + self.shift[k])
                    x = x - x.mean(dim=-1, keepdim=True)
                return x

        model = Elementwise(8192, 6)
        batches = _repeat([(torch.randn(128, 8192), torch.randn(128, 8192))])
        return model, batches, _regress, 128

    if bottleneck == "host":
        model = nn.Linear(32, 32)
        batches = _repeat([(torch.randn(12, 32), torch.randn(12, 32))])
        return model, batches, _host_step, 12

    # none: a healthy run — compute dominates, data is prefetched in memory.
    # An in-memory dataset indexed a whole batch at a time (one gather, no per-sample collate).
    # A large batch through narrow layers: many FLOPs per byte of gradient, so the all-reduce
    # stays a small part of the step even when the two ranks' cores are busy elsewhere.
    data = torch.utils.data.TensorDataset(torch.randn(16384, 512), torch.randint(0, 10, (16384,)))
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), 2048, drop_last=True)
    loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=None)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, _cycle(loader), _classify, 2048


def _repeat(batches):
    while True:
        yield from batches


def _cycle(loader):
    while True:
        yield from loader


def _classify(model, batch):
    import torch

    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _regress(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def _host_step(model, batch):
    """A per-element Python loop with a .item() on every iteration: host-bound by design."""
    import math

    x, y = batch
    out = model(x)
    loss = (out - y).pow(2).mean()
    acc = 0.0
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            # A host sync on every element, and the arithmetic in Python.
            acc += math.tanh(out[i, j].item() * 0.5 + y[i, j].item())
    return loss + 0.0 * acc


# -- one rank ---------------------------------------------------------------------------------


def _rank_main(local_rank: int, cfg: dict, done=None) -> None:
    env = {
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cfg["ranks"]),
        "LOCAL_WORLD_SIZE": str(cfg["ranks"]),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(cfg["port"]),
        "DIAG_RUN_ID": cfg["run_id"],
    }
    os.environ.update(env)
    # Kineto prints a "USDT: ... profiler_start/stop" line to stderr at every profiler
    # window; from several ranks at once the lines interleave into broken and blank lines.
    # The demo's windows are the agent's own business: keep its terminal output clean.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # SIGTERM ends the rank as Ctrl-C does: the agent closes the run as interrupted, and
    # a lingering endpoint stops serving at once. SIGINT is how the demo stops its ranks, so a
    # rank takes it even where the demo was started with it ignored (nohup, a background job).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    import torch.distributed as dist

    import diag

    torch.set_num_threads(cfg["threads"])
    steps = cfg["steps"]
    sched = schedule(steps)
    with diag.Agent(
        run_dir=cfg["run_dir"],
        device=None,  # the demo trains on the CPU even where a GPU exists
        export=cfg["export"],
        export_port_base=cfg.get("port_base"),
        report_wait_s=60.0,
        # On a small machine the ranks have no spare core: analysing a window during the
        # run slows one rank and makes it a straggler. Live analysis feeds the live
        # metrics, so without the exporter the windows are analysed at exit instead.
        analyse_during_run=cfg["export"] or (os.cpu_count() or 1) > 2 * cfg["ranks"],
        heartbeat_s=2.0,
        export_linger_s=cfg.get("linger_s", 0.0),
        # `diag top`'s `p` over the demo's endpoints: its ranks run on this machine only.
        profile_on_demand=bool(cfg["export"]),
        # Rank 0 closes last (it waits for its peers and writes the report): then the
        # parent can print the verdict while the endpoints linger.
        on_closed=(lambda _agent: done.set()) if done is not None and local_rank == 0 else None,
        verbose=cfg["verbose"],
        thresholds=cfg["thresholds"] or None,
        **sched,
    ) as agent:
        # The agent starts before the process group, so NCCL logging (on GPU jobs) is set up.
        dist.init_process_group("gloo", rank=local_rank, world_size=cfg["ranks"],
                                timeout=__import__("datetime").timedelta(seconds=120))
        model, batches, step_fn, samples = _build(cfg["bottleneck"], local_rank, cfg.get("loader_workers") or 0)
        if cfg.get("straggler"):
            batches = _late_batches(batches, cfg["straggler"], local_rank, cfg["ranks"], steps)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        agent.watch(ddp, opt)  # parameters, gradients and optimizer state, for the memory section and `diag plan --run`
        # The DataLoader itself, not an iterator over it: the agent records its settings.
        slow_down = float(cfg.get("slow_down") or 0.0)
        for _, batch in zip(range(steps), agent.loader(batches)):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = step_fn(ddp, batch)
            loss.backward()
            opt.step()
            if slow_down:  # an induced regression: the step's own work takes (1 + slow_down) times as long
                time.sleep(slow_down * (time.perf_counter() - t0))
            agent.step(samples=samples)
        dist.barrier()
    dist.destroy_process_group()


# -- the parent -------------------------------------------------------------------------------


def default_run_dir() -> Path:
    return Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass(frozen=True)
class DemoSettings:
    """What the demo job trains and how it is watched."""
    bottleneck: str = "none"
    ranks: int = 2
    steps: int = DEFAULT_STEPS
    run_dir: str | os.PathLike | None = None  # None: runs/demo-<time>
    export: bool = True  # each rank serves Prometheus metrics
    port_base: int | None = None  # rank r serves on port_base + r (None: free ports)
    verbose: bool = False
    linger_s: float = 0.0  # keep the endpoints serving this long after the report
    thresholds: dict | None = None  # decision-tree thresholds for diag.Agent
    slow_down: float = 0.0  # an induced regression: each step's work is followed by this fraction of it, idle
    straggler: str | None = None  # an induced straggler, one of STRAGGLERS
    loader_workers: int = 0  # the data workload's DataLoader num_workers (its cause's action)


def run_demo(settings: DemoSettings = DemoSettings(), on_ready=None) -> dict:
    """Run the demo job; returns {"run_dir", "diagnosis", "report", "elapsed_s", "endpoints"}.

    The diagnosis is the one rank 0 wrote into summary.json with the report (None when no
    report was written).

    With `linger_s`, the ranks keep their Prometheus endpoints serving that long after
    training and the report; `on_ready(result)` is called as soon as the report is
    written (before the linger), and SIGINT or SIGTERM ends the linger at once.
    """
    bottleneck, ranks, export, linger_s = settings.bottleneck, settings.ranks, settings.export, settings.linger_s
    if bottleneck not in BOTTLENECKS:
        raise ValueError(f"unknown bottleneck {bottleneck!r}; choose from {', '.join(BOTTLENECKS)}")
    import torch.multiprocessing as mp

    from diag.collectors.run_writer import resolve_run_dir
    from diag.report import SUMMARY_JSON, read_diagnosis

    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    base = Path(settings.run_dir) if settings.run_dir is not None else default_run_dir()
    path = resolve_run_dir(base, f"diag:{run_id}", True, rank=0)
    cfg: dict[str, Any] = {
        "bottleneck": bottleneck,
        "ranks": ranks,
        "steps": settings.steps,
        "run_dir": str(path),
        "run_id": run_id,
        "port": free_port(),
        "threads": max(1, (os.cpu_count() or 2) // ranks),
        "export": export,
        "port_base": settings.port_base,
        "verbose": settings.verbose,
        "linger_s": max(float(linger_s or 0.0), 0.0) if export else 0.0,
        "thresholds": dict(settings.thresholds or {}),
        "slow_down": float(settings.slow_down),
        "straggler": settings.straggler,
        "loader_workers": settings.loader_workers,
    }
    # fork is fast (no re-import of torch) and safe here: the parent has run no torch ops.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    done = mp.get_context(method).Event()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None  # SIGTERM: as Ctrl-C
    try:
        procs = mp.start_processes(_rank_main, args=(cfg, done), nprocs=ranks, join=False, start_method=method)
        try:
            while not _joined(procs, path) and not done.is_set():
                pass
        except KeyboardInterrupt:
            _stop_ranks(procs)
            raise

        report = path / "report.html"
        result = {
            "run_dir": path,
            "diagnosis": read_diagnosis(path / SUMMARY_JSON),
            "report": report if report.exists() else None,
            "elapsed_s": time.monotonic() - t0,
            "endpoints": _endpoints(path, ranks) if cfg["linger_s"] > 0 else [],
        }
        if on_ready is not None:
            on_ready(result)
        try:
            while not _joined(procs, path):
                pass
        except KeyboardInterrupt:  # the linger ends early; training is over, nothing is lost
            _stop_ranks(procs)
        return result
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _joined(procs, path: Path) -> bool:
    """Whether every rank has ended, waiting up to half a second; a rank that died (a signal,
    an exception) ends the others and the demo with one line that says which and how."""
    import torch.multiprocessing as mp

    try:
        return procs.join(timeout=0.5)
    except mp.ProcessExitedException as exc:
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with status {exc.exit_code}"
        failed = exc.error_index
    except mp.ProcessRaisedException as exc:
        lines = [x for x in str(exc).splitlines() if x.strip()]
        how, failed = f"failed: {lines[-1].strip()[:300] if lines else 'an exception'}", exc.error_index
    _stop_ranks(procs)
    raise DiagRunError(f"rank {failed} of the demo {how}; the other ranks were stopped. What the ranks recorded "
                       f"is in {path} (diag report {path}).")


def _stop_ranks(procs, timeout_s: float = 30.0) -> None:
    """Interrupt the rank processes still running and wait for them (bounded), then kill."""
    live = [p for p in procs.processes if p.is_alive()]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs.processes):
        if p not in live:
            continue
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            print(f"diag demo: rank {i} did not stop within {timeout_s:.0f} s of SIGINT; killing it", file=sys.stderr,
                  flush=True)
            p.kill()
            p.join(5.0)


def _endpoints(path: Path, ranks: int) -> list[str]:
    """host:port of each rank's metrics endpoint, from the rank.json files."""
    from diag import atomic_io, rundir

    out = []
    for r in range(ranks):
        info = atomic_io.read_json(path / rundir.rank_dir_name(r) / rundir.RANK_FILE) or {}
        port = (info.get("collectors") or {}).get("exporter_port")
        if port:
            out.append(f"{info.get('host') or 'localhost'}:{port}")
    return out


def headline(diagnosis: Diagnosis | None) -> str:
    """The diagnosis's verdict sentence (diag.analyzers.diagnosis.document)."""
    text = diagnosis.headline.get("text") if diagnosis is not None else None
    return text if isinstance(text, str) and text else "No verdict: not enough evidence was recorded."
