"""The diagnosis of one job as a typed document (schema diag.diagnosis/1): what
`diag.analyzers.diagnosis.document.build_diagnosis` makes and every view renders (the reports,
`diag analyze`, compare and the gate, the exporter, `diag top`, the trackers).

It stays a `Diagnosis` from the diagnosis to the views; JSON only where it is written
(`diagnosis_json`: summary.json, `diag analyze --json`) and read back (`diagnosis_from_json`,
whose types are settled once, field by field where the file is damaged). docs/analyze.md
describes its parts; the parts below the top level are JSON objects, those that compare, the
gate and the report compute with checked against their declared shapes where they are read.
"""

from __future__ import annotations

from typing import Annotated, Any, Required, TypedDict

import msgspec

from diag.typed_json import fits, settled

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


# The shapes of the parts that compare, the gate and the report compute with, below the top
# level: a saved part that does not fit its shape reads as absent, as a top-level field does.
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[float, msgspec.Meta(gt=0)]
_Rate = Annotated[float, msgspec.Meta(ge=0)] | None
_Identity = TypedDict("_Identity", {"world size": "int | None", "device": "str | None", "model": "str | None",
                                    "batch": "float | None"})


class _StepTime(TypedDict):
    steps: _Count
    median_ms: _Positive
    relative_se: Annotated[float, msgspec.Meta(ge=0)]
    drift: float
    mad_ms: float
    p10_ms: float
    p90_ms: float


class _Throughput(TypedDict, total=False):
    steps_per_s: _Rate
    samples_per_s: _Rate
    tokens_per_s: _Rate
    mfu: _Rate


class _RunFigures(TypedDict, total=False):
    identity: _Identity
    step_time: _StepTime | None
    throughput: _Throughput


class _LatenessChart(TypedDict):
    ranks: list[int]
    first_steps: list[int]
    lateness_ms: list[list[float | None]]


class _StragglerEpisodes(TypedDict, total=False):
    chart: _LatenessChart | None
    episodes: list[dict[str, Any]]


class _WhatIfChange(TypedDict, total=False):
    change: Required[str]
    description: str
    baseline_step_ms: _Positive | None
    predicted_step_ms: Annotated[float, msgspec.Meta(ge=0)] | None
    speedup: float | None
    fixes: str | None
    note: str


class _WhatIf(TypedDict, total=False):
    critical_path: dict[str, Any] | None
    changes: list[_WhatIfChange]


_PART_SHAPES: dict[str, Any] = {"run_figures": _RunFigures, "straggler_episodes": _StragglerEpisodes | None,
                                "what_if": _WhatIf}


def diagnosis_from_json(raw) -> Diagnosis | None:
    """The diagnosis a decoded JSON object holds: a diag.diagnosis/1 document (a field it cannot
    hold, or a part that does not fit its shape, reads as absent), else None. A `Diagnosis` is
    returned as it is."""
    if isinstance(raw, Diagnosis):
        return raw
    if type(raw) is not dict or raw.get("schema") != SCHEMA:
        return None
    return _parts_in_shape(settled(raw, Diagnosis))


def _parts_in_shape(d: Diagnosis) -> Diagnosis:
    unfit = [name for name, shape in _PART_SHAPES.items() if not fits(getattr(d, name), shape)]
    if not unfit:
        return d
    absent = Diagnosis()
    return msgspec.structs.replace(d, **{name: getattr(absent, name) for name in unfit})


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
