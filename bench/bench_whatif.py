"""What-if predictions against the fix actually applied: 2-rank CPU jobs on gloo under the agent.

    python bench/bench_whatif.py [--steps 128] [--repeat 2] [--json FILE]

Each scenario is one job that runs with a cause, then with that cause removed, in
alternating blocks of 8 steps with one profiler window in each. diag analyses the job;
from the profiled steps with the cause it predicts the step time without it (the job's
what-if entry for the matching change), and the profiled steps without the cause measure
it. One job for both sides keeps the processes and their placement the same, and the
alternation spreads the machine's slow spells over both sides: on two shared cores the
same matrix multiply takes 3.8 ms in one window and 6.8 ms in another, and identical
runs differ by ±10%, which must not pass for prediction error.

- slow_data:  a dataset whose every batch waits on slow storage, against the same batches
              held in memory; change no_data_wait;
- allreduce:  a blocking all-reduce of every gradient after backward, against no
              communication at all; change no_exposed_comm;
- straggler:  rank 1 does extra matrix work every step, against none; change no_straggler.

And one per cause rule that a CPU job can show (the causes' own changes):
- sync_points:  3000 .item() calls on one value per step, against one; change no_sync_points;
- elementwise:  a chain of 8 elementwise multiplications of a 16 MB tensor, against one
                multiplication that does the same (one pass, as a fused kernel would);
                change fuse_elementwise_chain;
- allreduce_bytes: a blocking all-reduce of every gradient after backward, against the
                same calls on half of each gradient (the bytes the bf16 compression hook
                sends); change compressed_collective.

A side's step time is the job's profiled steps (the slowest rank's step, median over the
steps), as every what-if entry's baseline_step_ms holds it; beside it, the noise band of
that measurement from its own steps. The target is an error within 15% on each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCENARIOS = {
    # name: (the change that removes the cause, the cause)
    "slow_data": ("no_data_wait", "slow_data"),
    "allreduce": ("no_exposed_comm", "allreduce"),
    "straggler": ("no_straggler", "straggler"),
    "sync_points": ("no_sync_points", "sync_points"),
    "elementwise": ("fuse_elementwise_chain", "elementwise"),
    "allreduce_bytes": ("compressed_collective", "allreduce_bytes"),
}
SYNC_CALLS = 3000
CHAIN_OPS, CHAIN_NUMEL = 8, 4 << 20
WIDTH, DEPTH, BATCH = 768, 4, 256
# One short profiler window in every block of 8 steps: two ranks on two cores make
# single steps noisy, so both sides rest on as many profiled steps as the run can give.
SCHEDULE = {"skip_first": 2, "warmup": 1, "active": 4, "every": 8}
STORAGE_WAIT_S = 0.03  # the slow dataset's wait per batch


def _rank(local_rank: int, cfg: dict) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"]),
                       "DIAG_RUN_ID": cfg["run_id"], "KINETO_LOG_LEVEL": "6"})
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    import diag

    torch.set_num_threads(1)
    torch.manual_seed(7)
    cause = cfg["cause"]
    with diag.Agent(run_dir=cfg["run_dir"], device=None, export=False, analyse_during_run=False,
                    report_wait_s=60.0, **SCHEDULE) as agent:
        dist.init_process_group("gloo", rank=local_rank, world_size=2, timeout=datetime.timedelta(seconds=120))
        model = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        # The all-reduce scenario reduces gradients itself; the others overlap them with DDP.
        net = model if cause.startswith("allreduce") else torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        batches = [torch.randn(BATCH, WIDTH) for _ in range(4)]
        extra = torch.randn(WIDTH, WIDTH)
        table = torch.randn(CHAIN_NUMEL)

        def feed():
            for i in range(cfg["steps"]):
                if cause == "slow_data" and with_cause(i):
                    time.sleep(STORAGE_WAIT_S)  # each batch waits on slow storage
                yield batches[i % len(batches)]

        for i, x in enumerate(agent.loader(feed())):
            opt.zero_grad(set_to_none=True)
            if cause == "sync_points":
                value = x.sum()
                for _ in range(SYNC_CALLS if with_cause(i) else 1):
                    value.item()  # one value pulled to the host again and again
            if cause == "elementwise":
                z = table
                if with_cause(i):
                    for _ in range(CHAIN_OPS):
                        z = z * 1.0001  # each op reads and writes the whole tensor
                else:
                    z = z * (1.0001 ** CHAIN_OPS)  # the same result in one pass
            net(x).square().mean().backward()
            if cause == "allreduce" and with_cause(i):
                for p in model.parameters():
                    dist.all_reduce(p.grad)  # blocking, one gradient at a time
            if cause == "allreduce_bytes":
                for p in model.parameters():
                    g = p.grad.view(-1)
                    dist.all_reduce(g if with_cause(i) else g[: g.numel() // 2])  # half the bytes
            if cause == "straggler" and local_rank == 1 and with_cause(i):
                y = x
                for _ in range(6):
                    y = torch.tanh(y @ extra)  # the straggler's extra work
            opt.step()
            agent.step(samples=BATCH)
        dist.barrier()
    dist.destroy_process_group()


def run_job(cause: str, steps: int, run_dir: Path) -> dict:
    import uuid

    import torch.multiprocessing as mp

    from diag.analyzers.analyze import analyze_run_dir
    from diag.demo import free_port

    cfg = {"cause": cause, "steps": steps, "run_dir": str(run_dir),
           "run_id": uuid.uuid4().hex[:12], "port": free_port()}
    mp.start_processes(_rank, args=(cfg,), nprocs=2, join=True, start_method="fork")
    return analyze_run_dir(run_dir)


def with_cause(step: int) -> bool:
    """Blocks of one profiler period: the cause is on in the even ones."""
    return (step // SCHEDULE["every"]) % 2 == 0


def side_steps(doc, cause: bool) -> list[float]:
    """The job's profiled steps on one side (the slowest rank's duration of each step)."""
    by_step: dict[int, float] = {}
    for r in doc.ranks:
        for s in r.facts.steps:
            if s.get("evidence") == "trace" and with_cause(s["step"]) == cause:
                by_step[s["step"]] = max(by_step.get(s["step"], 0.0), s["duration_ms"])
    return list(by_step.values())


def noise_band(jobs: list[list[float]]) -> float:
    """1.96 standard errors of the measured side's mean of job medians, the spread of single
    steps estimated robustly (1.4826 MAD): how far the measurement itself may be off."""
    se2 = []
    for steps in jobs:
        med = statistics.median(steps)
        mad = statistics.median(abs(x - med) for x in steps)
        se2.append((1.4826 * mad) ** 2 / len(steps))
    return 1.96 * (sum(se2) ** 0.5) / len(jobs)


def half(doc, change: str, cause: bool) -> dict:
    """The job's what-if entry for `change` over the profiled steps with (or without) the cause."""
    import msgspec

    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.whatif.job import job_what_if

    ranks = [msgspec.structs.replace(r.facts, steps=[s for s in r.facts.steps if with_cause(s["step"]) == cause])
             for r in doc.ranks]
    _, entries = job_what_if(ranks, load_tree().what_if)
    return next(e for e in entries if e["change"] == change)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=128, help="steps per job, in blocks of 8 with and without the cause")
    ap.add_argument("--repeat", type=int, default=2, help="jobs per scenario (default 2)")
    ap.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="diag-bench-whatif-") as scratch:
        tmp = args.keep or scratch
        for name in args.only or SCENARIOS:
            change, cause = SCENARIOS[name]
            preds, befores, measured, job_steps = [], [], [], []
            for i in range(args.repeat):
                doc = run_job(cause, args.steps, Path(tmp) / f"{name}-{i}")
                before = half(doc, change, True)
                befores.append(before["baseline_step_ms"])
                measured.append(half(doc, change, False)["baseline_step_ms"])
                job_steps.append(side_steps(doc, False))
                if before["predicted_step_ms"] is not None:
                    preds.append(before["predicted_step_ms"])
            pred = {"baseline_step_ms": statistics.fmean(befores), "note": before.get("note"),
                    "predicted_step_ms": statistics.fmean(preds) if preds else None}
            measured = statistics.fmean(measured)
            err = (pred["predicted_step_ms"] - measured) / measured if pred["predicted_step_ms"] else None
            noise = noise_band(job_steps) / measured
            rows.append({"scenario": name, "change": change, "before_ms": pred["baseline_step_ms"],
                         "predicted_ms": pred["predicted_step_ms"], "measured_ms": measured, "error": err,
                         "measured_noise": noise, "repeats": args.repeat})
            print(f"{name:10s} {change:16s} before {pred['baseline_step_ms']:7.1f} ms  predicted "
                  f"{pred['predicted_step_ms'] or float('nan'):7.1f} ms  measured {measured:7.1f} ms "
                  f"(noise +-{noise:.1%})  error {err:+.1%}" if err is not None
                  else f"{name}: no prediction ({pred.get('note')})", flush=True)
    worst = max(abs(r["error"]) for r in rows if r["error"] is not None) if rows else None
    print(f"worst error {worst:.1%} (target: within 15% on each)" if worst is not None else "no predictions")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "worst_error": worst}, indent=2))
    return 0 if worst is not None and worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
