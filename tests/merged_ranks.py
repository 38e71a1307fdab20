"""Hand-made ranks as the diagnosis reads them (`inputs.MergedRank`), for the rule tests."""

from __future__ import annotations

from diag.analyzers.analysis_types import rank_facts_from_document, rank_verdict_from_document
from diag.analyzers.diagnosis.inputs import MergedRank


def merged_rank(parts: dict, rank: int = 0) -> MergedRank:
    """A rank of the given parts ({"analysis": ..., "samples": ..., "info": ..., "host": ...}),
    its analysis's facts and verdict read as `inputs.merge_ranks` reads them."""
    analysis = parts.get("analysis") or {}
    return MergedRank(rank=rank, facts=rank_facts_from_document(analysis, rank),
                      verdict=rank_verdict_from_document(analysis), **parts)


def merged(ranks: dict) -> dict[int, MergedRank]:
    """{rank: parts} as merged ranks."""
    return {k: merged_rank(r, k) for k, r in ranks.items()}
