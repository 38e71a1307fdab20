"""Reads what a report is made from: a run directory (analysed by the facade, with its
records) or a saved `diag analyze --json` document."""

from __future__ import annotations

import json

from diag.analyzers.analyze import SCHEMA, analyze_run_with_records
from diag.errors import DiagInputError
from diag.run_documents import RunRecords


def load_run(run_dir, tree=None, progress=None) -> tuple[dict, RunRecords]:
    """(analysis document with its diagnosis, run records) for `report_model.build_model`."""
    return analyze_run_with_records(run_dir, tree, progress)


def load_analysis_json(path) -> dict:
    """A saved `diag analyze --json` document."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json follows
        raise DiagInputError(f"not a readable JSON file ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})",
                             source=str(path)) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise DiagInputError(f"not a {SCHEMA} document (expected the output of diag analyze --json)",
                             source=str(path))
    return settled_lists(doc)


def settled_lists(doc: dict) -> dict:
    """A saved document with its lists of entries as the facade writes them: "errors" and
    "warnings" keep their objects only, "source" is a string or absent. Its ranks, job block
    and diagnosis have readers of their own (`document_ranks`, `job_block`, `diagnosis_from_json`)."""
    out = {k: v for k, v in doc.items() if k != "source" or isinstance(v, str)}
    for key in ("errors", "warnings"):
        entries = doc.get(key)
        out[key] = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    return out
