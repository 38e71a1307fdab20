"""Who am I in the job? Rank, world size, local rank and node from the launcher's environment.

Launchers are tried from the most to the least specific: torchrun sets RANK even when
it runs under Slurm, and mpirun inside a Slurm allocation inherits SLURM_PROCID=0
from the batch script, so OpenMPI's variables must win over Slurm's.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import overload


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "torchrun", "openmpi", "pmi", "slurm" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    job_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def to_dict(self) -> dict:
        return asdict(self)


@overload
def _int(env: Mapping[str, str], *names: str, default: int) -> int: ...


@overload
def _int(env: Mapping[str, str], *names: str, default: None = None) -> int | None: ...


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def _slurm_tasks_on_first_node(spec: str | None) -> int | None:
    """SLURM_TASKS_PER_NODE looks like '4(x2),3' ; the local world size is the first count."""
    if not spec:
        return None
    m = re.match(r"\s*(\d+)", spec)
    return int(m.group(1)) if m else None


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    env = os.environ if env is None else env
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    port = _int(env, "MASTER_PORT")
    master = env.get("MASTER_ADDR")

    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", default=1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
        return LaunchInfo(
            launcher="torchrun",
            rank=_int(env, "RANK", default=0),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", default=0),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", "NODE_RANK", default=0),
            hostname=host,
            job_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID"),
            master_addr=master,
            master_port=port,
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", default=1)
        return LaunchInfo(
            launcher="openmpi",
            rank=_int(env, "OMPI_COMM_WORLD_RANK", default=0),
            world_size=world,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world),
            node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", default=0),
            hostname=host,
            job_id=env.get("SLURM_JOB_ID") or env.get("OMPI_MCA_ess_base_jobid"),
            master_addr=master,
            master_port=port,
        )
    if "PMI_RANK" in env or "PMIX_RANK" in env:
        world = _int(env, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        local = _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", default=0)
        return LaunchInfo(
            launcher="pmi",
            rank=_int(env, "PMI_RANK", "PMIX_RANK", default=0),
            world_size=world,
            local_rank=local,
            local_world_size=_int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", default=world),
            node_rank=0,
            hostname=host,
            job_id=env.get("SLURM_JOB_ID"),
            master_addr=master,
            master_port=port,
        )
    # srun sets SLURM_STEP_ID for each task; the batch script itself is not a rank.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        world = _int(env, "SLURM_NTASKS", "SLURM_NPROCS", default=1)
        local_world = _slurm_tasks_on_first_node(
            env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        )
        return LaunchInfo(
            launcher="slurm",
            rank=_int(env, "SLURM_PROCID", default=0),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            local_world_size=local_world or _int(env, "SLURM_NTASKS_PER_NODE", default=world),
            node_rank=_int(env, "SLURM_NODEID", default=0),
            hostname=host,
            job_id=env.get("SLURM_JOB_ID"),
            master_addr=master,
            master_port=port,
        )
    return LaunchInfo(
        launcher="none",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        hostname=host,
    )


def from_torch_distributed(fallback: LaunchInfo | None = None) -> LaunchInfo:
    """Prefer the initialised process group's view when there is one."""
    info = fallback or detect()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from dataclasses import replace

            return replace(info, rank=dist.get_rank(), world_size=dist.get_world_size())
    except Exception:
        pass
    return info


def expand_slurm_nodelist(spec: str) -> list[str]:
    """'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1'] (zero padding kept)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        part = part.strip()
        m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if not m:
            if part:
                hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            elif r:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts
