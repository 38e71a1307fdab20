"""Judged ranks as the analysis document writes them (`analysis_types.rank_document`), for the
tests that read a rank's document form, and hand-made documents diagnosed as the facade does."""

from __future__ import annotations

from diag.analyzers.analysis_types import (
    Analysis,
    AnalysisFacts,
    Job,
    JobFacts,
    analysis_from_json,
    rank_document,
)
from diag.analyzers.analyze import analyze_trace, with_diagnosis
from diag.analyzers.diagnosis.decision_tree import load_tree


def trace_rank(path, **kwargs) -> dict:
    """One trace's judged rank (`analyze.analyze_trace`), as the document writes it."""
    return rank_document(analyze_trace(path, **kwargs))


def ranks_of(doc) -> list[dict]:
    """The ranks of an analysis document as built (`analyze_paths`), as the document writes them."""
    return [rank_document(r) for r in doc.ranks]


def diagnosed(doc: dict, tree=None, run=None) -> Analysis:
    """A hand-made analysis document (its JSON form; its ranks may be judged ranks already, its
    job block `analyze_job`'s), diagnosed as the facade does: a JSON job block's stragglers and
    rank waits are kept."""
    read = analysis_from_json(doc)
    job = doc["job"] if isinstance(doc.get("job"), (JobFacts, Job)) else read.job
    facts = AnalysisFacts(source=read.source, run=read.run, ranks=[r.facts for r in read.ranks], job=job,
                          errors=read.errors, warnings=read.warnings)
    return with_diagnosis(facts, read.ranks, tree or load_tree(), run)
