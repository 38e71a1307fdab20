"""Gloo ranks train a small DDP model under diag.Agent, once per straggler pattern, each run in its own
run directory; one rank's batches are late by DELAY_S, collated in the training process (num_workers=0),
as a slow or skewed input pipeline makes them, on the steps `diag demo --straggler` makes late
(`diag.demo.late_rank`): rank 1 in every step (persistent), each rank in turn (rotating), the last rank
for a sixth of the run from its middle (transient).
Usage: python tests/straggler_worker.py OUT_DIR PORT WORLD KIND[,KIND...]"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 40
BATCH = 8
# Three ranks share two cores beside the rest of the suite: a rank there is late by scheduling
# alone in a few steps, by up to tens of ms (at 20 ms, one CI run counted 5 such steps of other
# ranks in a transient burst's episode and called it rotating).
DELAY_S = 0.06


def _rank(rank: int, world: int, port: int, out: str, kinds: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import diag
    from diag.demo import late_rank

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, 64))
    for kind in kinds:
        step = iter(range(1 << 30))

        def collate(batch, kind=kind, step=step):
            if late_rank(kind, next(step), world, STEPS) == rank:
                time.sleep(DELAY_S)
            return torch.utils.data.default_collate(batch)

        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=collate)
        with diag.Agent(run_dir=os.path.join(out, kind), run_id=f"straggler-{kind}", export=False, profile=False,
                        sampling=False, report=False, verbose=False, overwrite=True) as agent:
            for (x,) in agent.loader(loader):
                model(x).sum().backward()
                agent.step(samples=BATCH)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, port, world, kinds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    import torch._dynamo  # noqa: F401 - DDP imports it; once here, not once per forked rank

    import diag.agent  # noqa: F401 - likewise

    # Forked, not spawned: each rank would import torch again, seconds on a small machine.
    mp.start_processes(_rank, args=(world, port, out, kinds), nprocs=world, start_method="fork")
