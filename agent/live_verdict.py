"""The verdict of each step as the agent records it, outside profiler windows: the decision
tree on what is always measured (step time, data wait, device utilisation of the latest
sample) and on how the latest analysed window split its device time.

A failure switches live verdicts off (logged once); the steps are still recorded and the
run analysis judges them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

from diag.analyzers.diagnosis.decision_tree import verdict_from
from diag.analyzers.job.sampled import step_measurements, window_composition


class LiveVerdicts:
    def __init__(self, tree, log: Callable[[str], None]):
        self.tree = tree
        self.log = log
        self.latest_sample: dict | None = None  # set by the sampler's thread
        self._composition: dict | None = None
        self._last_path_sig = None

    @property
    def on(self) -> bool:
        return self.tree is not None

    def judge(self, rec: dict) -> None:
        """Fill a step record's bound and shares, and its path when it differs from the last one."""
        if self.tree is None:
            return
        try:
            shares, m = step_measurements(rec, self.latest_sample, self._composition)
            v = verdict_from(m, self.tree) if m else {"bound": None, "path": []}
            rec["bound"], rec["shares"] = v["bound"], shares
            sig = tuple((p["node"], p["answer"]) for p in v["path"])
            if sig != self._last_path_sig:
                rec["path"] = v["path"]
                self._last_path_sig = sig
        except Exception as exc:
            self.tree = None
            self.log(f"agent: live verdicts off ({type(exc).__name__}: {exc})")

    def window_done(self, analysis: dict) -> None:
        """The latest window's composition is used for the steps after it."""
        try:
            comp = window_composition(analysis)
            if comp is not None:
                self._composition = comp
        except Exception as exc:
            self.log(f"agent: window composition failed ({type(exc).__name__}: {exc})")
