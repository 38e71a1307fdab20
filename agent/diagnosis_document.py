"""The diagnosis of one job as a typed document (schema diag.diagnosis/1): what
`diag.analyzers.diagnosis.document.build_diagnosis` makes and every view renders (the reports,
`diag analyze`, compare and the gate, the exporter, `diag top`, the trackers).

It stays a `Diagnosis` from the diagnosis to the views; JSON only where it is written
(`diagnosis_json`: summary.json, `diag analyze --json`) and read back (`diagnosis_from_json`,
whose types are settled once, field by field where the file is damaged). docs/analyze.md
describes its parts; the parts below the top level are JSON objects.
"""

from __future__ import annotations

from typing import Any

import msgspec

from diag.typed_json import settled

SCHEMA = "diag.diagnosis/1"
# summary.json of diag.report_summary/1 carried the diagnosis's parts at its top level.
OLD_SUMMARY_LAYOUT = "diag.report_summary/1"

Obj = dict[str, Any]


class Diagnosis(msgspec.Struct, kw_only=True, frozen=True):
    """One judgement of a job. The fields are in the order the JSON document has always had."""

    schema: str = SCHEMA
    bound: str | None = None  # decision_tree.BOUNDS, None where the verdict is withheld
    headline: Obj = {}  # {"text", "note", ...}: the verdict's sentence, quoting the measurement set
    measurements: Obj | None = None  # the numbers the verdict rests on and the steps they cover
    phase_shares: dict[str, float | None] | None = None  # class -> share of the step
    decision_path: Obj | None = None  # the tree walked on those same numbers
    confidence: Obj = {}  # how sure, and why
    stragglers: list[Obj] = []
    straggler_episodes: Obj | None = None  # who the others waited for, step by step, in episodes
    findings: list[Obj] = []  # of the job and the ranks, merged
    evidence: list[Obj] = []  # numbered facts the verdict and recommendations link to
    recommendations: list[Obj] = []  # ranked by predicted gain
    causes: list[Obj] = []  # what in the job's own objects makes a phase slow
    what_if: Obj = {}  # {"critical_path", "changes"}: the job's replayed changes
    memory: Obj | None = None  # device memory against capacity
    nccl: Obj = {}  # what NCCL says, and what could not be read of it
    world_size: int | None = None
    missing_ranks: list[int] = []
    stopped_ranks: list[int] = []
    run_figures: Obj = {}  # identity, steady step time, throughput: what compare and the gate read


def diagnosis_from_json(raw) -> Diagnosis | None:
    """The diagnosis a decoded JSON object holds: a diag.diagnosis/1 document (a field it cannot
    hold reads as absent), else None. A `Diagnosis` is returned as it is."""
    if isinstance(raw, Diagnosis):
        return raw
    if type(raw) is not dict or raw.get("schema") != SCHEMA:
        return None
    return settled(raw, Diagnosis)


def diagnosis_in_summary(summary) -> Diagnosis | None:
    """The diagnosis a report's summary.json holds."""
    if type(summary) is not dict:
        return None
    if summary.get("schema") == OLD_SUMMARY_LAYOUT:
        return settled({**summary, "schema": SCHEMA}, Diagnosis)
    return diagnosis_from_json(summary.get("diagnosis"))


def diagnosis_json(d: Diagnosis) -> Obj:
    """The diagnosis as its JSON document holds it."""
    return msgspec.structs.asdict(d)
