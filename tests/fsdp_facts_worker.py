"""Two gloo ranks train one step of a model sharded with FSDP2 (`fully_shard`) and Adam, then
write what diag's model facts read on each rank (used by test_model_facts.py)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    from diag.collectors.model_facts import describe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(describe(model, opt), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
