"""The job's what-if: ranks coupled by their collectives, the slowest rank setting the pace.

In a synchronous job every rank leaves a collective when the last one arrives, so a
step lasts as long as the slowest rank's own work (its *pace*: its step less the time it
spent waiting for peers, which `diag.analyzers.job.waits` measured). The job's critical
path runs through the slowest-paced rank. A change predicts, step by step:

    pace'_r = step_r - saved_r(change) - f_comm * wait_r
    job step' = max_r pace'_r + f_comm * (job step - max_r pace_r)

where saved_r is what the rank's own replay saves, and f_comm the change's factor on
communication (the waits sit inside the exposed communication the rank's replay scaled).
`no_straggler` puts every rank whose typical pace (its median over the steps) is above the
median rank's back to it (factor 0) or part of the way (another factor); the median of an
even number of ranks is the faster middle rank, an actual rank's pace. Steps are matched
across ranks by number; where the ranks share none, each rank's median step stands for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diag.analyzers.analysis_types import RankFacts
from diag.analyzers.numbers import dict_at
from diag.analyzers.whatif.rank import entry


def job_what_if(ranks: Sequence[RankFacts], changes) -> tuple[dict | None, list[dict]]:
    """(the job's critical path, its what-if entries) from the ranks' analysed steps."""
    per_rank = {}
    for r in ranks:
        steps = [s for s in r.steps if _usable(s)]
        if isinstance(r.rank, int) and steps:
            per_rank[r.rank] = steps
    if not per_rank:
        return None, []
    table = _aligned(per_rank)
    rank_ids = sorted(per_rank)
    rank_changes = [c for c in changes if c.get("scope", "rank") == "rank"]
    job_changes = [c for c in changes if c.get("scope") == "job"]
    preds: dict[str, list] = {c["id"]: [] for c in changes}
    measured, critical, paces = [], [], []
    for row in table:  # one step of every rank
        dur = np.array([s["duration_ms"] for s in row])
        wait = np.array([_wait_ms(s) for s in row])
        pace = dur - wait
        t, top = float(dur.max()), float(pace.max())
        measured.append(t)
        critical.append(int(np.argmax(pace)))
        for c in rank_changes:
            if not any(c["id"] in s["what_if_ms"] for s in row):
                continue  # replayed on no rank of this step (a cause it does not have)
            # A change that removes one cause's time leaves the waiting for peers as it was.
            f_comm = 1.0 if "remove" in c else c["scale"].get("comm", 1.0)
            saved = np.array([max(0.0, s["replayed_ms"] - s["what_if_ms"].get(c["id"], s["replayed_ms"]))
                              for s in row])
            # What the slowest-paced rank itself waited (at a later collective of the step) is
            # waiting too: it scales with communication like the rest.
            preds[c["id"]].append((t, float(np.max(dur - saved - f_comm * wait)) + f_comm * (t - top)))
        paces.append(pace)
    # A straggler is slow step after step: each rank's pace is its median over the steps, so
    # that two ranks trading places from step to step (noise) is not taken for one.
    pace_table = np.array(paces)
    typical = np.median(pace_table, axis=0)
    order = np.argsort(typical, kind="stable")
    med = float(typical[order[(len(typical) - 1) // 2]])
    lag_by_step = _pace_lag(pace_table, int(order[-1]), int(order[(len(typical) - 1) // 2]))
    for c in job_changes:
        f = c["scale"]["straggler"]
        saved = float(typical.max()) - float(np.max(np.minimum(typical, med + f * (typical - med))))
        preds[c["id"]] = [(m, m - saved) for m in measured]
    base = float(np.median(measured))
    present = set().union(*(set(s.get("present_classes") or ()) for steps in per_rank.values() for s in steps))
    if len(rank_ids) > 1 and lag_by_step:
        present.add("straggler")
    entries = [entry(c, base, base - float(np.median([m - p for m, p in preds[c["id"]]])) if preds[c["id"]] else None,
                     present) for c in changes]
    job_ids = {c["id"] for c in job_changes}
    for e in entries:
        if e["change"] in job_ids and "straggler" in present:
            # Whether that lag is a straggler or the run's own noise is the diagnosis's judgement.
            e["pace_lag_ms_by_step"] = lag_by_step
    slow = rank_ids[max(set(critical), key=critical.count)]
    path = next((r.critical_path for r in ranks if r.rank == slow), None)
    return {"rank": slow, "steps": len(table), "measured_ms": base,
            "by_class_ms": (path or {}).get("by_class_ms"), "ranks": len(rank_ids)}, entries


def _pace_lag(paces: np.ndarray, slow: int, median_rank: int) -> list[float]:
    """How far the slowest rank's pace is behind the median rank's, step by step (ms)."""
    if paces.shape[1] < 2 or slow == median_rank:
        return []
    return [round(float(x), 6) for x in paces[:, slow] - paces[:, median_rank]]


def _usable(s: Mapping[str, Any]) -> bool:
    d = s.get("duration_ms")
    return isinstance(s.get("what_if_ms"), dict) and isinstance(d, (int, float)) and d > 0 \
        and isinstance(s.get("replayed_ms"), (int, float))


def _wait_ms(s: Mapping[str, Any]) -> float:
    sh = dict_at(s, "shares")
    w = sh.get("wait")
    return float(w) * s["duration_ms"] if isinstance(w, (int, float)) else 0.0


def _aligned(per_rank: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[list[Mapping[str, Any]]]:
    """Rows of one step per rank, matched by step number; else each rank's median step."""
    by_num = [{s["step"]: s for s in steps if isinstance(s.get("step"), int)} for steps in per_rank.values()]
    common = sorted(set.intersection(*(set(b) for b in by_num))) if all(by_num) else []
    if common:
        return [[b[n] for b in by_num] for n in common]
    row = []
    for steps in per_rank.values():
        ordered = sorted(steps, key=lambda s: s["duration_ms"])
        row.append(ordered[(len(ordered) - 1) // 2])
    return [row]
