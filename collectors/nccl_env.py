"""Route NCCL's own logging into the run directory.

NCCL reads NCCL_DEBUG* once, when the first communicator is created, so the variables
must be set before `torch.distributed.init_process_group` (or at least before the first
NCCL collective). Variables the user set are left alone, one by one; and a user who set
NCCL_DEBUG reads NCCL's messages where NCCL writes them by default (stderr, the scheduler's
log), which a failing job needs most, so then the log file is not set either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

DEFAULT_SUBSYS = ("INIT", "ENV", "NET", "GRAPH")
LOG_PATTERN = "nccl.%h.%p.log"  # NCCL expands %h to the host name and %p to the pid


def nccl_env(log_dir: str | os.PathLike, coll: bool = False) -> dict[str, str]:
    subsys = list(DEFAULT_SUBSYS) + (["COLL"] if coll else [])
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": ",".join(subsys),
        # Absolute: the job may change directory before NCCL opens the file.
        "NCCL_DEBUG_FILE": os.path.join(os.path.abspath(log_dir), LOG_PATTERN),
    }


def nccl_group_initialized() -> bool:
    """Whether the default process group exists already and runs on NCCL (a gloo group has no
    NCCL communicator whose logging could come too late)."""
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
    except Exception:
        return False


def configure(
    log_dir: str | os.PathLike,
    coll: bool = False,
    env: MutableMapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    check_process_group: bool = True,
) -> dict[str, str]:
    """Set the NCCL variables the user has not set; return those set.

    The log folder is created so NCCL can open its file there.
    """
    env = os.environ if env is None else env
    wanted = nccl_env(log_dir, coll=coll)
    applied = {k: v for k, v in wanted.items() if k not in env}
    if "NCCL_DEBUG" in env and applied.pop("NCCL_DEBUG_FILE", "") and log:
        log(f"nccl: NCCL_DEBUG={env['NCCL_DEBUG']} is the user's, so NCCL's messages stay where NCCL writes "
            "them (not in the run directory); `diag nccl-log FILE` reads a saved copy")
    if not applied:
        return {}
    if "NCCL_DEBUG_FILE" in applied:
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            applied.pop("NCCL_DEBUG_FILE")
            if log:
                log(f"nccl: cannot create {log_dir} ({exc.strerror or exc}); NCCL logs stay on stderr")
    env.update(applied)
    if check_process_group and log and nccl_group_initialized():
        log(
            "nccl: the process group was initialised before diag.Agent; NCCL logging takes effect only "
            "if no NCCL communicator exists yet. Start the agent before init_process_group."
        )
    return applied
