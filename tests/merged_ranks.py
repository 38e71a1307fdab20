"""Hand-made ranks as the diagnosis reads them (`inputs.MergedRank`), for the rule tests."""

from __future__ import annotations

from diag.analyzers.analysis_types import judged_rank_from_document
from diag.analyzers.diagnosis.inputs import MergedRank, weighed_facts


def merged_rank(parts: dict, rank: int = 0) -> MergedRank:
    """A rank of the given parts ({"analysis": ..., "samples": ..., "info": ..., "host": ...}),
    its analysis (a judged rank's document form) read as `inputs.merge_ranks` reads a document's."""
    parts = dict(parts)
    judged = judged_rank_from_document(parts.pop("analysis", None) or {}, rank)
    return MergedRank(rank=rank, facts=weighed_facts(judged), verdict=judged.verdict, **parts)


def merged(ranks: dict) -> dict[int, MergedRank]:
    """{rank: parts} as merged ranks."""
    return {k: merged_rank(r, k) for k, r in ranks.items()}
