"""The bottleneck report: report.html (self-contained), report.md and summary.json.

    write_report(run_dir, out_dir=None, progress=None) -> {"html": path, "markdown": path, "summary": path}
    write_report_from_analysis(doc, out_dir) -> same, for `diag analyze --report DIR` on traces

The data model comes from `diag.analyzers.views.report_model` (pure) and the diagnosis from
the facade, built once; this package renders the model and writes the files atomically.
summary.json holds the diagnosis exactly as `diag analyze --json` prints it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diag import atomic_io, rundir
from diag.diagnosis_document import Diagnosis, diagnosis_in_summary, diagnosis_json
from diag.run_documents import RunRecords

if TYPE_CHECKING:
    from diag.analyzers.analysis_types import Analysis

REPORT_HTML = "report.html"
REPORT_MD = "report.md"
SUMMARY_JSON = "summary.json"
SUMMARY_SCHEMA = "diag.report_summary/2"

__all__ = ["REPORT_HTML", "REPORT_MD", "SUMMARY_JSON", "analyse_and_model", "build_run_model",
           "read_diagnosis", "summary", "write_model", "write_report", "write_report_from_analysis"]


def build_run_model(run_dir, tree=None, progress=None) -> dict:
    """The report model of a run directory (reads it, analyses it, builds the model)."""
    return analyse_and_model(run_dir, tree=tree, progress=progress)[1]


def analyse_and_model(source, tree=None, progress=None) -> tuple[Analysis, dict]:
    """(analysis document, report model) of a run directory or of a saved analysis JSON file."""
    from diag.analyzers.views.report_model import build_model
    from diag.report.load import load_analysis_json, load_run

    if Path(source).is_file():
        doc = load_analysis_json(source)
        return doc, build_model(doc, RunRecords(path=os.fspath(source)))
    doc, run = load_run(source, tree=tree, progress=progress)
    return doc, build_model(doc, run)


def write_report(run_dir, out_dir=None, progress=None, tree=None) -> dict:
    """Write the report of a run directory into out_dir (default: the run directory), and remove
    the partial files of its ranks whose writers are gone (killed mid-write)."""
    model = build_run_model(run_dir, tree=tree, progress=progress)
    paths = write_model(model, out_dir if out_dir is not None else run_dir)
    rundir.remove_leftovers(run_dir)
    return paths


def write_report_from_analysis(doc: Analysis, out_dir) -> dict:
    """Write the report of an analysis document (traces analysed without a run directory)."""
    from diag.analyzers.views.report_model import build_model

    return write_model(build_model(doc, None), out_dir)


def summary(model: dict) -> dict:
    """The machine-readable summary: the diagnosis as it is, and the page's own tables
    (without chart arrays and per-step series)."""
    keep = ("run", "ranks", "step_stats", "throughput", "top_kernels", "top_ops", "nccl", "missing", "problems",
            "notes")
    out = {"schema": SUMMARY_SCHEMA, "model_schema": model.get("schema"),
           "diagnosis": diagnosis_json(model["diagnosis"])}
    out.update({k: model.get(k) for k in keep})
    return out


def read_diagnosis(summary_path) -> Diagnosis | None:
    """The diagnosis of a written summary.json, or None when there is none to read."""
    return diagnosis_in_summary(atomic_io.read_json(summary_path))


def write_model(model: dict, out_dir) -> dict:
    from diag.analyzers.analysis_types import json_safe
    from diag.report import html, markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"html": out / REPORT_HTML, "markdown": out / REPORT_MD, "summary": out / SUMMARY_JSON}
    atomic_io.atomic_write_text(paths["html"], html.render(model))
    atomic_io.atomic_write_text(paths["markdown"], markdown.render(model))
    atomic_io.atomic_write_json(paths["summary"], json_safe(summary(model)))
    return {k: os.fspath(v) for k, v in paths.items()}
