"""The analysis document's parts are what `diag.analyzers.analysis_types` declares, stage by
stage: the facts the analysis measures, then the same with the diagnosis's verdicts; and no
stage rewrites the value it was given."""

from __future__ import annotations

import copy
import json
import typing

import pytest
from conftest import FIXTURES

from diag import rundir
from diag.analyzers import analysis_types as types
from diag.analyzers.analyze import analyze_paths, analyze_run_dir, job_facts, json_safe, split_waits
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.document import job_block
from diag.analyzers.diagnosis.rank import judge_run_rank, judge_trace
from diag.analyzers.job.run_analysis import analyze_rank
from diag.analyzers.trace.analysis import trace_facts
from diag.diagnosis_document import Diagnosis


def _conforms(value: dict, declared, where: str) -> None:
    hints = typing.get_type_hints(declared)
    keys = set(value)
    assert declared.__required_keys__ <= keys, f"{where}: lacks {sorted(declared.__required_keys__ - keys)}"
    assert keys <= set(hints), f"{where}: undeclared {sorted(keys - set(hints))}"


def _steps_conform(rank: dict, declared, where: str) -> None:
    assert rank["steps"], where
    for s in rank["steps"]:
        _conforms(s, declared, f"{where} step {s.get('step')}")


@pytest.mark.parametrize("name", ["cpu_comm_rank0.pt.trace.json.gz", "cpu_data_rank0.pt.trace.json.gz"])
def test_a_traces_facts_and_its_verdicts_are_as_declared(name):
    tree = load_tree()
    facts = trace_facts(FIXTURES / name, tree.facts)
    _conforms(facts, types.TraceRankFacts, "facts")
    _steps_conform(facts, types.TraceStepFacts, "facts")
    assert "bound" not in facts and not any("bound" in s for s in facts["steps"])  # no verdict among the facts
    before = copy.deepcopy(facts)
    judged = judge_trace(facts, tree)
    assert facts == before  # a new value; the facts are left as they were
    _conforms(judged, types.TraceRank, "judged")
    _steps_conform(judged, types.TraceStep, "judged")


def _document_conforms(doc: dict, where: str) -> None:
    _conforms(doc, types.AnalysisDocument, where)
    assert isinstance(doc["job"], types.Job) and isinstance(doc["diagnosis"], Diagnosis), where
    for f in doc["job"].findings:
        _conforms(f, types.Finding, f"{where}: job finding {f.get('id')}")


def test_real_gpu_ranks_of_one_job_are_as_declared(real_traces):
    paths = [real_traces / "job128_rank0_sampled.json.gz", real_traces / "job128_rank1_sampled.json.gz"]
    doc = analyze_paths(paths, jobs=1)
    _document_conforms(doc, "job128")
    tree = load_tree()
    facts = job_facts(split_waits([trace_facts(p, tree.facts) for p in paths]), tree)
    assert isinstance(facts, types.JobFacts) and facts.collective_facts is not None
    assert not hasattr(facts, "bound") and not hasattr(facts, "stragglers")  # no verdict among the facts
    for r in doc["ranks"]:
        _conforms(r, types.TraceRank, f"rank {r['rank']}")
        _steps_conform(r, types.TraceStep, f"rank {r['rank']}")
        assert r["wait_split"]["measured"]
    # A saved document's job block reads back as the judged block it was written from.
    saved = json.loads(json.dumps(json_safe(doc)))["job"]
    assert "collective_facts" not in saved and "reports" not in saved  # in memory only; a run directory's
    assert job_block(saved) == doc["job"] and job_block(doc["job"]) is doc["job"]
    assert job_block(None) == types.JobFacts() and job_block({"bound": 7, "stragglers": "x"}) == types.Job()


def test_a_real_runs_ranks_are_as_declared(demo_run_dir):
    tree = load_tree()
    rd = rundir.RunDir(demo_run_dir)
    facts, inputs = analyze_rank(rd, 0, tree.facts)
    _conforms(facts, types.RunRankFacts, "facts")
    _steps_conform(facts, types.RunStepFacts, "facts")
    assert {s["evidence"] for s in facts["steps"]} == {"trace", "sampled"}
    before = copy.deepcopy(facts)
    judged = judge_run_rank(facts, inputs.windows, inputs.sampled, tree)
    assert facts == before
    _conforms(judged, types.RunRank, "judged")
    _steps_conform(judged, types.RunStep, "judged")
    doc = analyze_run_dir(demo_run_dir)
    _document_conforms(doc, "demo run")
    for r in doc["ranks"]:
        _conforms(r, types.RunRank, f"rank {r['rank']}")


def test_the_schema_page_is_what_the_code_declares():
    """docs/schema.md is generated from the SCHEMA constants and these declarations: a key or a
    schema added without regenerating it fails here, and every declared part has its section."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "docs" / "generate_schema.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (REPO / "docs" / "schema.md").read_text()
    for name in ("TraceRankFacts", "TraceRank", "RunRankFacts", "RunRank"):
        assert f"### `{name}`" in text
        assert all(f"| `{key}` |" in text for key in getattr(types, name).__annotations__)
    assert "| `diag.analysis/1` |" in text and "| `diag.run/3` |" in text
