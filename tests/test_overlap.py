"""Collectives that start after the step's backward pass, on real 2-process gloo jobs.

Rank r trains a 4-layer MLP under torch.profiler. In "manual" each gradient is all-reduced by
hand after loss.backward(); with DDP and 1 MB buckets the buckets are reduced from autograd
hooks while backward still runs. The trace tells them apart by where each all-reduce starts
against the step's last autograd node.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, schedule

from diag.analyzers.trace.analysis import trace_facts
from diag.demo import free_port

STEPS = 4
pytestmark = pytest.mark.slow


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        for mode in ("manual", "ddp"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
            net = model if mode == "manual" else torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
            x = torch.randn(64, 512)
            path = f"{out}/{mode}_rank{rank}.json"
            with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=STEPS),
                         on_trace_ready=lambda p, path=path: p.export_chrome_trace(path)) as prof:
                for _ in range(STEPS + 1):
                    net(x).square().mean().backward()
                    if mode == "manual":
                        for p in model.parameters():
                            dist.all_reduce(p.grad)
                    prof.step()
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    return out


def _after(traces, mode: str) -> list:
    facts = trace_facts(str(traces / f"{mode}_rank0.json"))
    return [c["after_backward"] for c in facts["collectives"] if c["name"] == "all_reduce"]


def test_an_all_reduce_after_backward_has_lost_its_overlap(traces):
    after = _after(traces, "manual")
    assert len(after) == 8 * STEPS and all(after)  # 4 weights and 4 biases per step, by hand


def test_ddp_buckets_start_while_backward_runs(traces):
    after = _after(traces, "ddp")
    assert after and not all(after)
    assert any(a is False for a in after)
