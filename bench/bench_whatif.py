"""What-if predictions against the fix actually applied: 2-rank CPU jobs on gloo under the agent.

    python bench/bench_whatif.py [--steps 64] [--repeat 1] [--json FILE]

Each scenario is one job that runs first with a cause and then, half-way, with that cause
removed. diag analyses the job; from the profiled steps before the switch it predicts the
step time with the cause removed (the job's what-if entry for the matching change), and
the profiled steps after the switch measure it. One job for both sides keeps the
processes, their placement and the machine's state the same, so that run-to-run noise
(±10% between identical runs on two shared cores) does not pass for prediction error.

- slow_data:  a dataset that decodes every batch in the loading process, against the same
              batches held in memory; change no_data_wait;
- allreduce:  a blocking all-reduce of every gradient after backward, against no
              communication at all; change no_exposed_comm;
- straggler:  rank 1 does extra matrix work every step, against none; change no_straggler.

A side's step time is the job's profiled steps (the slowest rank's step, median over the
steps), as every what-if entry's baseline_step_ms holds it. The target is an error within
15% on each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

SCENARIOS = {
    # name: (the change that removes the cause, the cause)
    "slow_data": ("no_data_wait", "slow_data"),
    "allreduce": ("no_exposed_comm", "allreduce"),
    "straggler": ("no_straggler", "straggler"),
}
WIDTH, DEPTH, BATCH = 768, 4, 256
# Short profiler windows, four on each side of the switch: two ranks on two cores make
# single steps noisy, so both sides rest on as many profiled steps as the run can give.
SCHEDULE = {"skip_first": 2, "warmup": 1, "active": 4, "every": 8}
DECODE_ROUNDS = 48  # the slow dataset's decoding work per batch (~25 ms here)


def _rank(local_rank: int, cfg: dict) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"]),
                       "DIAG_RUN_ID": cfg["run_id"], "KINETO_LOG_LEVEL": "6"})
    import datetime
    import zlib

    import torch
    import torch.distributed as dist
    from torch import nn

    import diag

    torch.set_num_threads(1)
    torch.manual_seed(7)
    cause, switch = cfg["cause"], cfg["switch"]
    with diag.Agent(run_dir=cfg["run_dir"], device=None, export=False, analyse_during_run=False,
                    report_wait_s=60.0, **SCHEDULE) as agent:
        dist.init_process_group("gloo", rank=local_rank, world_size=2, timeout=datetime.timedelta(seconds=120))
        model = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        # The all-reduce scenario reduces gradients itself; the others overlap them with DDP.
        net = model if cause == "allreduce" else torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        batches = [torch.randn(BATCH, WIDTH) for _ in range(4)]
        blob = zlib.compress(os.urandom(1 << 16) * 16)  # a compressed record on slow storage
        extra = torch.randn(WIDTH, WIDTH)

        def feed():
            for i in range(cfg["steps"]):
                if cause == "slow_data" and i < switch:
                    for _ in range(DECODE_ROUNDS):
                        zlib.decompress(blob)  # decoding each sample in the loading process
                yield batches[i % len(batches)]

        for i, x in enumerate(agent.loader(feed())):
            opt.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            if cause == "allreduce" and i < switch:
                for p in model.parameters():
                    dist.all_reduce(p.grad)  # blocking, one gradient at a time
            if cause == "straggler" and local_rank == 1 and i < switch:
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

    cfg = {"cause": cause, "steps": steps, "switch": steps // 2, "run_dir": str(run_dir),
           "run_id": uuid.uuid4().hex[:12], "port": free_port()}
    mp.start_processes(_rank, args=(cfg,), nprocs=2, join=True, start_method="fork")
    return analyze_run_dir(run_dir)


def half(doc: dict, change: str, before: bool, switch: int) -> dict:
    """The job's what-if entry for `change` over the profiled steps on one side of the switch."""
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.whatif.job import job_what_if

    ranks = [{**r, "steps": [s for s in r["steps"] if (s["step"] < switch) == before]} for r in doc["ranks"]]
    _, entries = job_what_if(ranks, load_tree().what_if)
    return next(e for e in entries if e["change"] == change)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="steps per job; the cause is removed half-way")
    ap.add_argument("--repeat", type=int, default=1, help="jobs per scenario (default 1)")
    ap.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="diag-bench-whatif-") as scratch:
        tmp = args.keep or scratch
        for name in args.only or SCENARIOS:
            change, cause = SCENARIOS[name]
            preds, befores, measured = [], [], []
            for i in range(args.repeat):
                doc = run_job(cause, args.steps, Path(tmp) / f"{name}-{i}")
                before = half(doc, change, True, args.steps // 2)
                befores.append(before["baseline_step_ms"])
                measured.append(half(doc, change, False, args.steps // 2)["baseline_step_ms"])
                if before["predicted_step_ms"] is not None:
                    preds.append(before["predicted_step_ms"])
            pred = {"baseline_step_ms": statistics.fmean(befores), "note": before.get("note"),
                    "predicted_step_ms": statistics.fmean(preds) if preds else None}
            measured = statistics.fmean(measured)
            err = (pred["predicted_step_ms"] - measured) / measured if pred["predicted_step_ms"] else None
            rows.append({"scenario": name, "change": change, "before_ms": pred["baseline_step_ms"],
                         "predicted_ms": pred["predicted_step_ms"], "measured_ms": measured, "error": err,
                         "repeats": args.repeat})
            print(f"{name:10s} {change:16s} before {pred['baseline_step_ms']:7.1f} ms  predicted "
                  f"{pred['predicted_step_ms'] or float('nan'):7.1f} ms  measured {measured:7.1f} ms  error "
                  f"{err:+.1%}" if err is not None else f"{name}: no prediction ({pred.get('note')})", flush=True)
    worst = max(abs(r["error"]) for r in rows if r["error"] is not None) if rows else None
    print(f"worst error {worst:.1%} (target: within 15% on each)" if worst is not None else "no predictions")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "worst_error": worst}, indent=2))
    return 0 if worst is not None and worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
