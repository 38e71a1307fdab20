"""The live verdict of each step, for what watches the run as it goes (the exporter, `diag top`,
`diag export`): the decision tree on what is always measured (step time, data wait, device
utilisation of the latest sample) and on how the latest analysed window split its device time.

The run directory holds facts only: a step record keeps its measured shares, and the verdict
goes to the live feed beside it. Afterwards the run analysis judges the steps again from the
records, with every window known.

A failure switches live verdicts off (logged once); the steps are still recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from diag.analyzers.analysis_types import JudgedRank, rank_document, trace_facts_from_document
from diag.analyzers.diagnosis.decision_tree import verdict_from
from diag.analyzers.diagnosis.rank import judge_trace
from diag.analyzers.job.sampled import step_measurements, window_composition
from diag.step_record import StepRecord


class LiveVerdicts:
    def __init__(self, tree, log: Callable[[str], None]):
        self.tree = tree
        self.log = log
        self.latest_sample: dict | None = None  # set by the sampler's thread
        self._composition: dict | None = None
        self._last_path_sig: tuple | None = None

    @property
    def on(self) -> bool:
        return self.tree is not None

    def judge(self, rec: StepRecord) -> tuple[StepRecord, dict]:
        """A step's record with its measured shares filled in (a measurement), and its live
        verdict: its bound, and its path where that differs from the last step's."""
        if self.tree is None:
            return rec, {}
        try:
            shares, m = step_measurements(rec, self.latest_sample, self._composition)
            v = verdict_from(m, self.tree) if m else {"bound": None, "path": []}
            out = {"bound": v["bound"]}
            sig = tuple((p["node"], p["answer"]) for p in v["path"])
            if sig != self._last_path_sig:
                out["path"] = v["path"]
                self._last_path_sig = sig
            return msgspec.structs.replace(rec, shares=shares), out
        except Exception as exc:
            self.tree = None
            self.log(f"agent: live verdicts off ({type(exc).__name__}: {exc})")
            return rec, {}

    def window_done(self, analysis: Mapping[str, Any]) -> JudgedRank | None:
        """The steps after an analysed window take its composition; its facts (the window
        summary's analysis) judged: the rank with its verdict and findings, or None with live
        verdicts off."""
        facts = trace_facts_from_document(dict(analysis))
        try:
            comp = window_composition(facts)
            if comp is not None:
                self._composition = comp
        except Exception as exc:
            self.log(f"agent: window composition failed ({type(exc).__name__}: {exc})")
        if self.tree is None:
            return None
        try:
            return judge_trace(facts, self.tree)
        except Exception as exc:
            self.log(f"agent: window verdict failed ({type(exc).__name__}: {exc})")
            return None


def window_record(judged: JudgedRank | None, facts: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the exporter reads of an analysed window: its judged rank as the document writes
    it, or its facts alone with live verdicts off."""
    return rank_document(judged) if judged is not None else facts
