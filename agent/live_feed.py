"""What watches the run as it goes sees this rank through the live feed: live.json for
`diag top`, the exporter's metrics, and each step's and window's live verdict
(diag.live_verdict, the decision tree of the diagnosis over the latest facts)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from diag.collectors.live_state import LiveState
from diag.live_verdict import LiveVerdicts, window_record
from diag.step_record import StepRecord, to_json_record

if TYPE_CHECKING:
    from diag.analyzers.diagnosis.decision_tree import Tree
    from diag.collectors.run_writer import RunWriter


class LiveFeed:
    def __init__(self, collectors, log: Callable[[str], None], event: Callable[..., None]):
        self._collectors = collectors  # for the exporter and the profiler windows, once started
        self._log = log
        self._event = event
        self.state = LiveState()  # the last steps and sample, for diag top (live.json)
        self.tree: Tree | None = None
        self.verdicts = LiveVerdicts(None, log)  # each step's live verdict, once the tree is loaded
        self.windows_analysed: list[dict] = []  # first_step, last_step, bound of each analysed window
        self.writer: RunWriter | None = None  # once open

    def load_tree(self, config) -> dict | None:
        """The decision tree for the live verdicts, its settings recorded for the run (None
        where it cannot be loaded: the steps then get no live verdict)."""
        tree_settings = None
        try:
            from diag.analyzers.diagnosis.decision_tree import load_tree, settings

            tree = self.tree = load_tree(config.config_file, config.thresholds or None)
            tree_settings = settings(tree)
            self.verdicts = LiveVerdicts(self.tree, self._log)
        except Exception as exc:
            self._log(f"agent: decision tree unavailable ({type(exc).__name__}: {exc}); steps get no live verdict")
        if tree_settings is not None and self.writer is not None and self.writer.enabled:
            # The first rank records them for the run: the window analyses, rank 0's report and
            # every later `diag analyze` of this run directory judge by the same thresholds.
            self.writer.record_tree_settings(tree_settings)
        return tree_settings

    def step(self, rec: StepRecord) -> None:
        """A step's record: judged live (its measured shares filled in), written, and shown."""
        rec, verdict = self.verdicts.judge(rec)
        doc = to_json_record(rec)
        if self.writer is not None:
            self.writer.write_record("steps", doc)
        self.state.add_step(rec, verdict.get("bound"))
        exporter = self._collectors.exporter
        if exporter is not None:
            exporter.observe_step(rec, verdict.get("bound"))

    def sample(self, sample: dict) -> None:
        """The sampler's callback (its thread)."""
        self.verdicts.latest_sample = sample
        self.state.add_sample(sample)
        if self.writer is not None:
            self.writer.write_record("samples", sample)
        exporter = self._collectors.exporter
        if exporter is not None:
            exporter.observe_sample(sample)

    def window_done(self, first: int, last: int, facts: dict) -> None:
        """A window's summary (facts) has landed: the live verdict judges it for the live views."""
        judged = self.verdicts.window_done(facts)
        bound = judged.verdict.bound if judged is not None else None
        self.windows_analysed.append({"first_step": first, "last_step": last, "bound": bound})
        self._event("profiler", f"window {first}-{last} analysed" + (f": {bound}-bound" if bound else ""))
        exporter = self._collectors.exporter
        if exporter is not None:
            exporter.observe_window(window_record(judged, facts))

    def write(self, launch, steps_done: int, status: str = "running") -> None:
        """live.json: what `diag top` shows of this rank, within a second or two of the step."""
        if self.writer is None or launch is None:
            return
        windows = self._collectors.windows
        identity = {"rank": launch.rank, "local_rank": launch.local_rank, "host": launch.hostname,
                    "world_size": launch.world_size, "pid": os.getpid(),
                    "exporter_port": getattr(self._collectors.exporter, "port", None)}
        window = windows.window_steps if windows is not None else None
        self.writer.write_live(self.state.document(identity, steps_done, window, status))
