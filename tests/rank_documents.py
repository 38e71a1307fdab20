"""Judged ranks as the analysis document writes them (`analysis_types.rank_document`), for the
tests that read a rank's document form."""

from __future__ import annotations

from diag.analyzers.analysis_types import rank_document
from diag.analyzers.analyze import analyze_trace


def trace_rank(path, **kwargs) -> dict:
    """One trace's judged rank (`analyze.analyze_trace`), as the document writes it."""
    return rank_document(analyze_trace(path, **kwargs))


def ranks_of(doc: dict) -> list[dict]:
    """The ranks of an analysis document as built (`analyze_paths`), as the document writes them."""
    return [rank_document(r) for r in doc["ranks"]]
