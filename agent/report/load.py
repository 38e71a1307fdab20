"""Reads what a report is made from: a run directory (analysed by the facade, with its
records) or a saved `diag analyze --json` document."""

from __future__ import annotations

import json

from diag.analyzers.analysis_types import ANALYSIS_SCHEMA, Analysis, analysis_from_json
from diag.analyzers.analyze import analyze_run_with_records
from diag.errors import DiagInputError
from diag.run_documents import RunRecords


def load_run(run_dir, tree=None, progress=None) -> tuple[Analysis, RunRecords]:
    """(analysis document with its diagnosis, run records) for `report_model.build_model`."""
    return analyze_run_with_records(run_dir, tree, progress)


def load_analysis_json(path) -> Analysis:
    """A saved `diag analyze --json` document, read back by `analysis_from_json`."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json follows
        raise DiagInputError(f"not a readable JSON file ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})",
                             source=str(path)) from None
    if not isinstance(doc, dict) or doc.get("schema") != ANALYSIS_SCHEMA:
        raise DiagInputError(f"not a {ANALYSIS_SCHEMA} document (expected the output of diag analyze --json)",
                             source=str(path))
    return analysis_from_json(doc)
