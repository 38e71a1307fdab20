"""The analysis document's parts are what `diag.analyzers.analysis_types` declares, stage by
stage: the facts the analysis measures, then the same with the diagnosis's verdicts; and no
stage rewrites the value it was given."""

from __future__ import annotations

import copy
import json
import typing

import msgspec
import pytest
from conftest import FIXTURES

from diag import rundir
from diag.analyzers import analysis_types as types
from diag.analyzers.analyze import analyze_paths, analyze_run_dir, job_facts, json_safe, split_waits
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.rank import judge_run_rank, judge_trace
from diag.analyzers.job.run_analysis import analyze_rank
from diag.analyzers.trace.analysis import trace_facts
from diag.diagnosis_document import Diagnosis


def _conforms(value: dict, declared, where: str) -> None:
    hints = typing.get_type_hints(declared)
    keys = set(value)
    assert declared.__required_keys__ <= keys, f"{where}: lacks {sorted(declared.__required_keys__ - keys)}"
    assert keys <= set(hints), f"{where}: undeclared {sorted(keys - set(hints))}"


def _steps_conform(steps: list, declared, where: str) -> None:
    assert steps, where
    for s in steps:
        _conforms(s, declared, f"{where} step {s.get('step')}")


# What the diagnosis adds to every rank of a trace, and to every rank of a run directory.
TRACE_VERDICT = {"bound", "title", "summary", "path", "fixes", "sampled", "findings"}
RUN_VERDICT = {"bound", "path", "fixes", "findings"}


def _judged_conforms(judged: types.JudgedRank, facts, required: set, where: str) -> None:
    """A judged rank holds its facts as they were measured; its document form is its facts'
    keys in their order, then its verdict's (RankVerdict), and reads back as it was."""
    assert judged.facts == facts, where
    doc = types.rank_document(judged)
    written = list(types.facts_document(facts))
    assert list(doc)[:len(written)] == written, where
    added = set(doc) - set(written)
    assert required <= added <= set(types.RankVerdict.__struct_fields__), f"{where}: {sorted(added)}"
    assert len(judged.verdict.steps) == len(facts.steps), where
    saved = json.loads(json.dumps(json_safe(doc)))
    assert types.document_ranks({"ranks": [saved]}) == [judged], where


def _reads_back(facts: types.TraceRankFacts) -> None:
    """The facts as a window summary writes them read back as they were."""
    text = json.dumps(json_safe(types.facts_document(facts)))
    assert types.trace_facts_from_document(json.loads(text)) == facts


@pytest.mark.parametrize("name", ["cpu_comm_rank0.pt.trace.json.gz", "cpu_data_rank0.pt.trace.json.gz"])
def test_a_traces_facts_and_its_verdicts_are_as_declared(name):
    tree = load_tree()
    facts = trace_facts(FIXTURES / name, tree.facts)
    assert isinstance(facts, types.TraceRankFacts) and isinstance(facts.causes, types.CauseFacts)
    _steps_conform(facts.steps, types.TraceStepFacts, "facts")
    assert not any("bound" in s for s in facts.steps)  # no verdict among the facts
    _reads_back(facts)
    before = copy.deepcopy(facts)
    judged = judge_trace(facts, tree)
    assert facts == before  # a new value; the facts are left as they were
    _judged_conforms(judged, facts, TRACE_VERDICT, "judged")
    _steps_conform(types.judged_steps(judged), types.TraceStep, "judged")


def _document_conforms(doc: types.Analysis, where: str) -> None:
    """The document is typed throughout, and its JSON reads back as it was built."""
    assert isinstance(doc, types.Analysis) and isinstance(doc.job, types.Job), where
    assert isinstance(doc.diagnosis, Diagnosis) and all(isinstance(r, types.JudgedRank) for r in doc.ranks), where
    for f in doc.job.findings:
        _conforms(f, types.Finding, f"{where}: job finding {f.get('id')}")
    saved = json.loads(json.dumps(json_safe(doc)))
    assert list(saved) == [k for k in types.Analysis.__struct_fields__ if getattr(doc, k) is not msgspec.UNSET]
    assert types.analysis_from_json(saved) == doc, where


def test_real_gpu_ranks_of_one_job_are_as_declared(real_traces):
    paths = [real_traces / "job128_rank0_sampled.json.gz", real_traces / "job128_rank1_sampled.json.gz"]
    doc = analyze_paths(paths, jobs=1)
    _document_conforms(doc, "job128")
    tree = load_tree()
    facts = job_facts(split_waits([trace_facts(p, tree.facts) for p in paths]), tree)
    assert isinstance(facts, types.JobFacts) and facts.collective_facts is not None
    assert not hasattr(facts, "bound") and not hasattr(facts, "stragglers")  # no verdict among the facts
    split = split_waits([trace_facts(p, tree.facts) for p in paths])
    for r, f in zip(doc.ranks, split):
        _judged_conforms(r, f, TRACE_VERDICT, f"rank {r.rank}")
        _steps_conform(types.judged_steps(r), types.TraceStep, f"rank {r.rank}")
        assert r.facts.wait_split["measured"] and f.wait_split["measured"]
    saved = json.loads(json.dumps(json_safe(doc)))
    assert "collective_facts" not in saved["job"] and "reports" not in saved["job"]  # in memory only; a run directory's
    # What a saved document's parts cannot hold reads as absent.
    damaged = types.analysis_from_json({**saved, "job": {"bound": 7, "stragglers": "x"}, "errors": ["x", {"e": 1}],
                                        "source": 3, "diagnosis": {"schema": "other"}})
    assert damaged.job == types.Job() and damaged.errors == [{"e": 1}] and damaged.source is msgspec.UNSET
    assert damaged.diagnosis is None and damaged.ranks == doc.ranks and damaged.warnings == doc.warnings


def test_a_real_runs_ranks_are_as_declared(demo_run_dir):
    tree = load_tree()
    rd = rundir.RunDir(demo_run_dir)
    facts, inputs = analyze_rank(rd, 0, tree.facts)
    assert isinstance(facts, types.RunRankFacts)
    _steps_conform(facts.steps, types.RunStepFacts, "facts")
    assert {s["evidence"] for s in facts.steps} == {"trace", "sampled"}
    for w in inputs.windows:  # each window's facts, read back from its summary
        assert isinstance(w, types.WindowFacts) and isinstance(w.facts, types.TraceRankFacts)
    before = copy.deepcopy(facts)
    judged = judge_run_rank(facts, inputs.windows, inputs.sampled, tree)
    assert facts == before
    _judged_conforms(judged, facts, RUN_VERDICT, "judged")
    _steps_conform(types.judged_steps(judged), types.RunStep, "judged")
    assert len(judged.verdict.window_bounds) == len(inputs.windows)
    doc = analyze_run_dir(demo_run_dir)
    _document_conforms(doc, "demo run")
    for r in doc.ranks:
        facts, _ = analyze_rank(rd, r.rank, tree.facts)  # the job's ranks then have their waits split
        assert list(types.facts_document(r.facts)) == list(types.facts_document(facts))
        _judged_conforms(r, r.facts, RUN_VERDICT, f"rank {r.rank}")


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
    for name in ("TraceRankFacts", "RunRankFacts", "CauseFacts", "RankVerdict"):
        assert f"### `{name}`" in text
        assert all(f"| `{key}` |" in text for key in getattr(types, name).__annotations__)
    assert "| `diag.analysis/1` |" in text and "| `diag.run/3` |" in text


def test_damaged_facts_read_with_the_damaged_fields_absent():
    """A window summary's facts from another agent version, or damaged: each value a field
    cannot hold reads as that field's default; the rest are kept."""
    raw = {"rank": 3, "source": "w.json", "shares": "nonsense", "mfu": 0.4, "collectives": 5,
           "copies": [{"kind": "HtoD"}], "steps": [{"step": 1}, "not a step"], "unknown_key": 1}
    facts = types.trace_facts_from_document(raw)
    assert (facts.rank, facts.source, facts.mfu) == (3, "w.json", 0.4)
    assert facts.shares == {} and facts.causes.collectives == [] and facts.causes.copies == [{"kind": "HtoD"}]
    assert facts.steps == [{"step": 1}]
    assert types.trace_facts_from_document({}) == types.TraceRankFacts()
