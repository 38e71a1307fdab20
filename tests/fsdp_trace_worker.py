"""Two gloo ranks train a 4-block model sharded with FSDP2 (`fully_shard`) under
torch.profiler and write each rank's trace (used by test_overlap.py). The third argument holds
flags, comma-separated: "forward", each block prefetches the next one's all-gather in forward
too; "nosync", gradients are not reduced (as on the micro-batches of an accumulation), so
the all-gathers are the only collectives."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import profile, schedule

BLOCKS = 4
# Few rows against wide blocks: the shards gathered (4 bytes a weight, whatever the batch) take
# most of the step, so the collectives stay exposed however busy the machine running it.
WIDTH, ROWS = 1024, 8


def _rank(rank: int, port: int, out: str, flags: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    if "forward" in flags:
        for block, after in zip(model[:-1], model[1:]):
            block.set_modules_to_forward_prefetch([after])
    if "nosync" in flags:
        model.set_requires_gradient_sync(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(ROWS, WIDTH)
    with profile(schedule=schedule(wait=0, warmup=1, active=2),
                 on_trace_ready=lambda p: p.export_chrome_trace(f"{out}/rank-{rank}.json")) as prof:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")), nprocs=2)
