"""The verdicts of each rank and of each of its steps, from the facts the analysis measured.

- A trace's rank (`judge_trace`): every step's and the rank's decision-tree verdict from
  their measurements, and the rank's findings: the tree's advisories, a trace that was
  sampled or repaired, a device that fell behind its host, what-if predictions that failed.
- A run directory's rank (`judge_run_rank`): its profiled steps as their windows' traces
  are judged; its sampled steps all at once (`sampled_verdicts`); the rank's verdict over
  its counted steps; its findings with its windows'.

Each returns a new `JudgedRank`: the rank's facts with its `RankVerdict`. A rank bound by its
peer is resolved afterwards, across the job (`peers.resolve`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import msgspec

from diag.analyzers.analysis_types import (
    Finding,
    JudgedRank,
    RankVerdict,
    RunRankFacts,
    TraceRankFacts,
    Verdict,
    WindowFacts,
)
from diag.analyzers.diagnosis.decision_tree import advise, evaluate, verdict_from
from diag.analyzers.model import derive_columns


def with_verdict(r: JudgedRank, v: dict, tree) -> JudgedRank:
    """The judged rank with verdict `v`, and the tree's advisories given again for it."""
    rules = {a["id"] for a in tree.advisories}
    kept = [f for f in r.verdict.findings if not (isinstance(f, dict) and f.get("id") in rules)]
    # A trace's rank tags its advisories; a run directory's rank does not.
    advice = advise(r.facts.measurements, tree, bound=v["bound"],
                    source="trace" if isinstance(r.facts, TraceRankFacts) else None)
    verdict = msgspec.structs.replace(r.verdict, bound=v["bound"], title=v["title"], summary=v["summary"],
                                      path=v["path"], fixes=v["fixes"], findings=kept + advice)
    return msgspec.structs.replace(r, verdict=verdict)


def step_measurements(step: Mapping[str, Any]) -> dict:
    """What the tree asks of a step (or a rank): its measurements, else its shares."""
    m = step.get("measurements")
    if isinstance(m, dict):
        return m
    return {f"{c}_share": v for c, v in (step.get("shares") or {}).items()}


# -- a trace's rank ----------------------------------------------------------------------


def judge_trace(facts: TraceRankFacts, tree) -> JudgedRank:
    """A trace analysis's rank: its facts with its own and its steps' verdicts and its findings."""
    coverage = facts.op_coverage
    # A trace with most of its host events missing was sampled or filtered after recording.
    sampled = isinstance(coverage, (int, float)) and coverage < tree.thresholds["sampled_trace_coverage"]
    steps: list[Verdict] = []
    for s in facts.steps:
        v = evaluate(step_measurements(s), tree)
        steps.append({"bound": v["bound"], "path": v["path"]})
    m = facts.measurements
    v = evaluate(m, tree)
    if facts.device_events_missing:
        # A GPU process's trace without its device events: its host-side shares say nothing of
        # the device, so no class is given ("can't tell"), for the rank or any of its steps.
        v = {**v, "bound": None, "title": "unknown", "fixes": [],
             "summary": "No device events in the trace of a GPU process: what bounds it can't be told."}
        steps = [{**s, "bound": None} for s in steps]
    findings = (_trace_notes(facts, sampled) + advise(m, tree, bound=v["bound"], source="trace")
                + _replay_notes(facts, tree))
    verdict = RankVerdict(bound=v["bound"], title=v["title"], summary=v["summary"], path=v["path"],
                          fixes=v["fixes"], sampled=sampled, findings=cast(list, findings), steps=cast(list, steps))
    return JudgedRank(facts=facts, verdict=verdict)


def _trace_notes(facts: TraceRankFacts, sampled: bool) -> list[Finding]:
    """What the trace itself lacked: events damaged, or most host events left out."""
    notes: list[Finding] = []
    rep = facts.repairs
    if rep:
        notes.append({
            "id": "repaired_trace",
            "severity": "warning",
            "message": f"The trace had damaged or oddly typed data: {rep['fields']} field(s) were converted or "
                       f"ignored and {rep['events']} event(s) skipped; the rest is analysed as usual "
                       f"(e.g. {'; '.join(rep['examples'][:2])}).",
            "advice": "Check what wrote or copied the trace; a profiler version mismatch or a truncated copy "
                      "are the usual causes.",
            "evidence": {**rep, "source": "trace"},
        })
    if facts.device_events_missing:
        notes.append({
            "id": "device_events_missing",
            "severity": "warning",
            "message": "Device events missing: the process used a GPU, but the trace holds no kernel, memcpy or "
                       "memset (CUPTI held by another tool, e.g. Nsight Systems, or the device activity left out). "
                       "The steps are attributed from the host side alone, so the verdict says little about the "
                       "device.",
            "advice": "Profile without another CUPTI client attached (or with ProfilerActivity.CUDA) for a "
                      "verdict on the device's work.",
            "evidence": {"source": "trace"},
        })
    it = facts.iterations
    if it and it.get("marker"):
        notes.append({
            "id": "iterations_from_markers",
            "severity": "info",
            "message": f"The trace has no ProfilerStep spans: its steps are {len(it['used'])} iterations found "
                       f"from markers ({it['reason']}).",
            "advice": "torch.profiler's schedule (or a ProfilerStep per step) marks the steps exactly.",
            "evidence": {**it, "source": "trace"},
        })
    elif it:
        notes.append({
            "id": "no_iterations",
            "severity": "warning",
            "message": f"The trace has {it['reason']}.",
            "advice": "Record with torch.profiler.profile(schedule=...) and call prof.step() every step, or wrap "
                      "each step in record_function, so that steady steps can be told from start-up.",
            "evidence": {**it, "source": "trace"},
        })
    if sampled:
        notes.append({
            "id": "sampled_trace",
            "severity": "warning",
            "message": f"Only {facts.op_coverage or 0.0:.1%} of the host events the profiler numbered are in this trace "
                       "(it was sampled or filtered): idle and host time are over-stated, so the verdict is indicative.",
            "advice": "Analyse the unfiltered trace for a firm verdict.",
            "evidence": {"op_coverage": facts.op_coverage, "source": "trace"},
        })
    return notes


def _replay_notes(facts: TraceRankFacts, tree) -> list[Finding]:
    """What the replay of the steps' graphs showed or could not do."""
    notes: list[Finding] = []
    critical_path = facts.critical_path
    backlog = (critical_path or {}).get("device_backlog_ms") or 0.0
    if critical_path and backlog > tree.thresholds["device_backlog_share"] * critical_path["measured_ms"]:
        notes.append({
            "id": "device_behind_host", "severity": "info",
            "message": f"The device's own work of a profiled step outlasts the step by {backlog:.1f} ms "
                       f"({backlog / critical_path['measured_ms']:.0%}): the host ran ahead of the device, so "
                       "the window shows the host's pace, and a steady iteration would be that much longer.",
            "advice": "Profile more consecutive steps (active=3 or more) so that a window reaches the steady "
                      "state; the what-if predictions of device-side changes are conservative until then.",
            "evidence": {"device_backlog_ms": backlog, "step_ms": critical_path["measured_ms"], "source": "trace"},
        })
    error = facts.what_if_error
    if error:
        notes.append({
            "id": "what_if_failed", "severity": "info",
            "message": f"No what-if predictions for this trace: its dependency graph could not be built ({error}).",
            "advice": "The rest of the analysis stands; recommendations for this rank carry no predicted gain.",
            "evidence": {"error": error, "source": "trace"},
        })
    return notes


# -- a run directory's rank ----------------------------------------------------------------


def _step_measurements(sampled, i: int, j: int | None) -> dict:
    """One sampled step's measurements: its row of the columns, else its own."""
    if j is None:
        return sampled.alone[i]
    return {k: float(v[j]) for k, v in sampled.columns.items() if not math.isnan(v[j])}


def sampled_verdicts(sampled, tree) -> list[tuple[str | None, list]]:
    """(bound, path) of each sampled step of a rank, in step order; the path is given only
    where it differs from the previous sampled step's, so long runs stay small.

    sampled: the analysis's sampled-step facts (`job.sampled.SampledSteps`). The tree is
    walked once for all the steps its columns cover (`Walker.walk`); a step whose path
    differs from the previous one's, or that the columns do not cover, is evaluated alone,
    which gives the full path. So the result is exactly the per-step one.
    """
    walker = tree.walker
    fast: list = [None] * sampled.count
    position = {i: j for j, i in enumerate(sampled.covered)}
    if sampled.covered:
        sig, verdict = walker.walk(derive_columns(sampled.columns), len(sampled.covered))
        sig_l = sig.tolist()
        guessed = {k: walker.guessed(k) for k in set(sig_l)}  # once per distinct path, not per step
        for j, i in enumerate(sampled.covered):
            k = sig_l[j]
            fast[i] = (None, ()) if sampled.empty[j] else (None if guessed[k] else verdict[j], walker.sigs[k])
    out = []
    last = None
    for i, f in enumerate(fast):
        if f is None or f[1] != last:
            m = _step_measurements(sampled, i, position.get(i))
            v = verdict_from(m, tree) if m else {"bound": None, "path": []}
            bound, path = v["bound"], v["path"]
            sig = tuple((p["node"], p["answer"]) for p in path)
        else:
            (bound, sig), path = f, []
        out.append((bound, path if sig != last else []))
        last = sig
    return out


def judge_run_rank(rank: RunRankFacts, windows: list[WindowFacts], sampled, tree) -> JudgedRank:
    """A run directory's rank: its facts with its steps', its windows' and its own verdicts and
    its findings.

    windows: the rank's profiler windows, their analyses' waits split; sampled: its
    sampled steps' facts (`job.sampled.SampledSteps`).
    """
    judged = [judge_trace(w.facts, tree) if w.facts is not None else None for w in windows]
    analysed = [a for a in judged if a is not None]
    profiled = {s["step"]: v for a in analysed for s, v in zip(a.facts.steps, a.verdict.steps)
                if isinstance(s.get("step"), int)}
    by_sample = iter(sampled_verdicts(sampled, tree))
    steps: list[Verdict] = []
    for s in rank.steps:
        if s.get("evidence") == "trace":
            t = profiled.get(s["step"])
            bound, path = (t["bound"], t["path"] or []) if t is not None else (None, [])
        else:
            bound, path = next(by_sample)
        steps.append({"bound": bound, "path": path})
    m = rank.measurements
    v = verdict_from(m, tree) if m else {"bound": None, "path": [], "fixes": []}
    findings = advise(m, tree, bound=v["bound"]) if m else []
    findings = _first_of_each(findings + [cast(Finding, f) for a in analysed
                                          for f in a.verdict.findings if isinstance(f, dict)])
    verdict = RankVerdict(bound=v["bound"], path=v["path"], fixes=v["fixes"],
                          findings=cast(list, findings + _window_notes(windows, len(steps))),
                          steps=cast(list, steps),
                          window_bounds=[a.verdict.bound if a is not None else None for a in judged])
    return JudgedRank(facts=rank, verdict=verdict)


def _first_of_each(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if f.get("id") not in seen:
            seen.add(f.get("id"))
            out.append(f)
    return out


def _window_notes(windows: list[WindowFacts], n_steps: int) -> list[Finding]:
    """What the rank's profiler windows lacked: none recorded, or some not analysed."""
    notes: list[Finding] = []
    if not windows:
        notes.append({
            "id": "no_profiler_window", "severity": "info",
            "message": "No profiler window was recorded on this rank: verdicts rest on sampled evidence only.",
            "advice": "Run long enough to pass the profiler's skip_first steps, or touch RUN_DIR/profile.trigger "
                      "(or send SIGUSR2) to profile a window on demand.",
            "evidence": {"steps": n_steps},
        })
    failed = [w for w in windows if w.facts is None]
    if failed:
        notes.append({
            "id": "window_analysis_failed", "severity": "info",
            "message": f"{len(failed)} profiler window(s) could not be analysed.",
            "advice": "Run `diag analyze` on the traces in the rank's traces/ folder to see the error.",
            "evidence": {"windows": [{"first_step": w.first_step, "error": w.error}
                                     for w in failed][:20]},
        })
    return notes
