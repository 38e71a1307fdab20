"""The diagnosis is a typed document from the diagnosis to the views, and JSON only at files:
written whole, read back equal, and read from a damaged or older summary.json as far as it
can be."""

from __future__ import annotations

import json

import pytest

from diag.analyzers.analyze import analyze_paths
from diag.diagnosis_document import (
    SCHEMA,
    Diagnosis,
    diagnosis_from_json,
    diagnosis_in_summary,
    diagnosis_json,
)


@pytest.fixture(scope="module")
def diagnosis(real_traces) -> Diagnosis:
    doc = analyze_paths([str(real_traces / f"job128_rank{r}_sampled.json.gz") for r in (0, 1)], jobs=1)
    return doc.diagnosis


def test_the_diagnosis_reads_back_as_it_was_written(diagnosis):
    assert isinstance(diagnosis, Diagnosis) and diagnosis.bound is not None
    text = json.dumps(diagnosis_json(diagnosis), allow_nan=False)
    back = diagnosis_from_json(json.loads(text))
    assert back == diagnosis
    assert list(json.loads(text)) == list(Diagnosis.__struct_fields__)  # the document's key order


def test_a_damaged_field_reads_as_absent_and_the_rest_is_kept(diagnosis):
    raw = json.loads(json.dumps(diagnosis_json(diagnosis)))
    raw.update(world_size="two", missing_ranks={"not": "a list"}, causes=7, unknown_key=[1])
    back = diagnosis_from_json(raw)
    assert back is not None
    assert back.world_size is None and back.missing_ranks == [] and back.causes == []
    assert back.bound == diagnosis.bound and back.headline == diagnosis.headline


@pytest.mark.parametrize("raw", [None, [], "diagnosis", {}, {"schema": "diag.diagnosis/2", "bound": "data"},
                                 {"bound": "data"}])
def test_what_is_no_diagnosis_is_refused(raw):
    assert diagnosis_from_json(raw) is None


def test_a_summary_of_either_layout_gives_its_diagnosis(diagnosis):
    as_json = json.loads(json.dumps(diagnosis_json(diagnosis)))
    current = {"schema": "diag.report_summary/2", "diagnosis": as_json, "ranks": []}
    assert diagnosis_in_summary(current) == diagnosis
    # diag.report_summary/1 held the diagnosis's parts at its top level, beside the page's.
    older = {**as_json, "schema": "diag.report_summary/1", "ranks": [], "step_stats": {}}
    assert diagnosis_in_summary(older) == diagnosis
    for damaged in ({"schema": "diag.report_summary/2", "diagnosis": "x"}, [as_json], None):
        assert diagnosis_in_summary(damaged) is None


def test_a_diagnosis_passed_on_is_read_as_it_is(diagnosis):
    assert diagnosis_from_json(diagnosis) is diagnosis
    assert Diagnosis().schema == SCHEMA
