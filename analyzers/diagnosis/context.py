"""What the parts of one diagnosis read: the job block with its verdict, the merged ranks,
the run's records, the ranks lost and the tree, and what is derived from them once (the steps, the
measurement set and its shares, the stragglers, what NCCL says)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diag.analyzers.analysis_types import Job
from diag.analyzers.diagnosis.decision_tree import Tree
from diag.analyzers.diagnosis.inputs import Ranks, Steps
from diag.run_documents import RunRecords


@dataclass(frozen=True)
class LostRanks:
    """The ranks the diagnosis has no whole record of."""
    missing: list[int] = field(default_factory=list)  # expected from the world size, left no data
    stopped: list[dict] = field(default_factory=list)  # stopped reporting (diagnosis.reporting.stopped_ranks)


@dataclass(frozen=True)
class JobContext:
    job: Job  # the job block, with its verdict and cross-rank judgements
    ranks: Ranks  # rank -> its analysis merged with its records (inputs.merge_ranks)
    run: RunRecords  # the run's records (empty for plain traces)
    lost: LostRanks
    tree: Tree
    world: int  # world size
    all_steps: Steps  # every rank's steps
    job_steps: Steps  # per step, the job's (the slowest rank's)
    mset: dict | None  # the measurement set the verdict rests on
    shares: dict | None  # its phase shares (or the steps' time-weighted shares)
    bound: str | None  # the verdict
    stragglers: list  # the named stragglers, with their evidence in words
    nccl: dict  # what the NCCL log and the bus-bandwidth measurement say
