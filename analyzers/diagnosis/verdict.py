"""The job verdict: computed here, and nowhere else.

A job's verdict rests on one measurement set: the mean, over the ranks that set the
pace, of each rank's measurements over its own steps after warm-up. In a synchronous job
the slowest rank sets the pace, so when the cross-rank analysis names stragglers those
are the ranks; otherwise every rank is. The decision tree is walked on that set, so the verdict, its
decision path and every share quoted beside it are the same numbers over the same
steps. `measurement_set` says which ranks and steps those are.

Inputs are the judged ranks of an analysis document (schema diag.analysis/1: each rank's
facts and verdict) and the cross-rank facts of `diag.analyzers.job.cross_rank.analyze_job`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

from diag.analyzers.analysis_types import JOB_FACT_FIELDS, Job, JobFacts, JudgedRank, RankFacts, RunRankFacts
from diag.analyzers.diagnosis import stragglers
from diag.analyzers.diagnosis.borderline import borderline, step_values
from diag.analyzers.diagnosis.decision_tree import BOUNDS, CLASSES, PEER, share_ratios, verdict_from
from diag.analyzers.diagnosis.inputs import device_events_missing
from diag.analyzers.diagnosis.pace import band, pace_setter
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import number as _number

# Findings this module adds to the job; a document that already holds them (a saved
# analysis read again) has them replaced, not repeated.
VERDICT_FINDINGS = frozenset({
    "rank_verdicts_differ", "comm_cause_undetermined", "straggler_induced_comm", "unsynchronised_arrival",
    "slow_collectives", "straggler",
})


def rank_measurements(facts: RankFacts) -> dict | None:
    """A rank's tree measurements as its analysis gives them; where those lack any of the
    five shares, the shares come from its "shares" (when complete) and the rest is kept."""
    m = facts.measurements
    out = {str(k): v for k, v in ((k, _number(v)) for k, v in m.items()) if v is not None}
    if not has_all_shares(out):
        sh = facts.shares
        vals = {b: _number(sh.get(b)) for b in CLASSES} if isinstance(sh, dict) else {}
        if vals.get("wait") is None:
            vals["wait"] = 0.0
        known = {b: v for b in CLASSES if (v := vals.get(b)) is not None and v >= 0}
        if len(known) == len(CLASSES) and sum(known.values()) > 0:
            total = sum(known.values())
            shares = {b: v / total for b, v in known.items()}
            measured = isinstance(facts.wait_split, dict) and bool(facts.wait_split.get("measured"))
            out = {k: v for k, v in out.items() if not k.endswith("_share") and k != "memory_to_compute"}
            out.update({f"{b}_share": v for b, v in shares.items() if b != "wait" or measured},
                       **share_ratios(shares))
    return out if any(f"{b}_share" in out for b in BOUNDS) else None


def has_all_shares(measurements: dict | None) -> bool:
    return bool(measurements and all(f"{b}_share" in measurements for b in BOUNDS))


def counted_steps(facts: RankFacts) -> list:
    """The steps a rank's measurements cover, in step order: all but the warm-up steps its
    analysis left out (the run analysis marks them; a trace's profiled steps all count)."""
    return _counted(facts)[0]


def _counted(facts: RankFacts) -> tuple[list, int]:
    """(the counted steps, how many steps have a number)."""
    steps = sorted((s for s in facts.steps if isinstance(s.get("step"), int)), key=lambda s: s["step"])
    ev = facts.evidence if isinstance(facts, RunRankFacts) else {}
    skip = ev.get("warmup_steps_excluded") if isinstance(ev.get("warmup_steps_excluded"), int) else 0
    return steps[skip:] or steps, len(steps)


def measured_steps(facts: RankFacts) -> dict:
    """Which of a rank's steps its measurements cover (`counted_steps`), counted."""
    counted, numbered = _counted(facts)
    ev = facts.evidence if isinstance(facts, RunRankFacts) else {}
    # Only a run analysis mixes profiled and sampled steps; a trace's steps are all profiled
    # (its "sampled" label means a filtered trace, which its own finding says).
    sampled = sum(1 for s in counted if s.get("evidence") == "sampled") if ev else 0
    return {
        "first": counted[0]["step"] if counted else None,
        "last": counted[-1]["step"] if counted else None,
        "count": len(counted),
        "trace": len(counted) - sampled,
        "sampled": sampled,
        "warmup_excluded": numbered - len(counted),
    }


def measurement_set(ranks: list[RankFacts]) -> dict | None:
    """The job's measurements: each measurement's mean over the ranks that have it (a trace
    without the device events of its GPU process measures nothing of the device: left out)."""
    per = [(r, m) for r in ranks if not device_events_missing(r) and (m := rank_measurements(r))]
    if not per:
        return None
    values: dict[str, float] = {}
    for key in sorted({k for _, m in per for k in m}):
        vals = [m[key] for _, m in per if key in m]
        values[key] = math.inf if any(math.isinf(v) for v in vals) else statistics.fmean(vals)
    shares = None
    if all(f"{b}_share" in values for b in BOUNDS):
        total = sum(values.get(f"{b}_share", 0.0) for b in CLASSES)
        if total > 0:
            shares = {b: values.get(f"{b}_share", 0.0) / total for b in CLASSES}
    cover = {r.rank: measured_steps(r) for r, _ in per if isinstance(r.rank, int)}
    firsts = [c["first"] for c in cover.values() if c["first"] is not None]
    lasts = [c["last"] for c in cover.values() if c["last"] is not None]
    steps = {
        "count": sum(c["count"] for c in cover.values()),
        "trace": sum(c["trace"] for c in cover.values()),
        "sampled": sum(c["sampled"] for c in cover.values()),
        "warmup_excluded": sum(c["warmup_excluded"] for c in cover.values()),
        "first": min(firsts) if firsts else None,
        "last": max(lasts) if lasts else None,
    }
    return {
        "values": values,
        "shares": shares,
        "ranks": sorted(cover),
        "steps": steps,
        "per_rank": {str(k): v for k, v in sorted(cover.items())},
        "basis": _basis(steps, len(per)),
    }


def _basis(steps: dict, n_ranks: int) -> str:
    """The steps a measurement set covers, in words: said beside every number it gives."""
    span = f"steps {steps['first']}-{steps['last']}" if steps["first"] is not None else "their steps"
    who = "1 rank" if n_ranks == 1 else f"{n_ranks} ranks"
    if steps["count"] == 0:
        return f"the analysis summary of {who} (no per-step records)"
    if steps["sampled"] == 0:
        kind = "profiled steps"
    elif steps["trace"] == 0:
        kind = "all steps, from sampled measurements"
    else:
        kind = f"all steps ({steps['trace']} profiled, {steps['sampled']} sampled)"
    warm = f", {steps['warmup_excluded']} warm-up steps left out" if steps["warmup_excluded"] else ""
    return f"{kind} of {who}, {span}: {steps['count']} rank-steps{warm}"


def _vote(ranks: list[JudgedRank]) -> tuple[str | None, dict]:
    """Without measurements: the most common rank verdict, ties to the larger mean share."""
    counts = Counter(r.verdict.bound for r in ranks if r.verdict.bound in BOUNDS)
    if not counts:
        return None, {}
    top = max(counts.values())
    tied = [b for b, n in counts.items() if n == top]
    if len(tied) == 1:
        return tied[0], dict(counts)
    shares = [rank_measurements(r.facts) or {} for r in ranks]
    mean = {b: statistics.fmean(s.get(f"{b}_share", 0.0) for s in shares) for b in tied}
    return max(tied, key=lambda b: (mean[b], -BOUNDS.index(b))), dict(counts)


def _pace_setters(present: list[JudgedRank], late: set, rank_waits, z: float
                  ) -> tuple[list[JudgedRank], str | None]:
    """The ranks on the critical path, and why. In a synchronous job the slowest rank sets
    the pace and its peers' extra time is waiting for it, which their shares count as
    communication: the named stragglers, else the pace-setting rank (`pace.pace_setter`)
    where the ranks' waits at collectives were measured."""
    if len(present) < 2:
        return present, None
    if late:
        names = ", ".join(str(r.rank) for r in present if r.rank in late)
        return [r for r in present if r.rank in late], f"the straggler(s) the others wait for: rank {names}"
    measured = {w.get("rank") for w in rank_waits or [] if isinstance(w, dict) and w.get("collectives")}
    per_step: dict = {r.rank: _step_paces(r.facts) for r in present if r.rank in measured}
    per_step = {k: v for k, v in per_step.items() if v}
    if len(per_step) < 2:
        return present, None  # no collective matched across ranks: nothing tells who waits
    lead = pace_setter({k: statistics.median(v) for k, v in per_step.items()},
                       {k: band(v, z) for k, v in per_step.items()})
    if lead is None:
        return present, None
    return [r for r in present if r.rank == lead], (
        f"rank {lead}, whose own work per step (its step less its waiting for peers) is the longest "
        "(the critical path)")


def _step_paces(facts: RankFacts) -> list[float]:
    """A rank's pace in each counted step (ms): its duration less its waiting for peers."""
    out = []
    for s in counted_steps(facts):
        dur = _number(s.get("duration_ms"))
        sh = dict_at(s, "shares")
        if dur is not None and dur > 0:
            out.append(dur * (1.0 - (_number(sh.get("wait")) or 0.0)))
    return out


def _unique_ranks(ranks: list[JudgedRank]) -> list[JudgedRank]:
    seen: dict[int, JudgedRank] = {}
    for r in ranks:
        if isinstance(r.rank, int):
            seen.setdefault(r.rank, r)
    return [seen[k] for k in sorted(seen)]


def job_verdict(ranks: list[JudgedRank], facts: JobFacts | Job, tree) -> Job:
    """The job block of the analysis document: the cross-rank facts plus the verdict.

    ranks: the judged ranks; facts: `analyze_job`'s result, or a job block already holding a
    verdict (its stragglers and rank waits are kept, the rest judged again). Returns bound,
    path, measurements, cause, bound_counts and the findings the verdict explains itself with.
    """
    present = _unique_ranks(ranks)
    judged: dict = {"stragglers": [], "rank_waits": [], "comm_explanation": None, "straggler_finding": None}
    if isinstance(facts, Job):
        judged.update(stragglers=facts.stragglers, rank_waits=facts.rank_waits)
    elif facts.collective_facts is not None:  # the cross-rank facts, judged here
        judged = stragglers.judge(facts.collective_facts, {r.rank: r.verdict.bound for r in present}, tree)
    findings = [f for f in facts.findings if isinstance(f, dict) and f.get("id") not in VERDICT_FINDINGS]
    late = {s.get("rank") for s in judged["stragglers"] if isinstance(s, dict)}
    base, pace = _pace_setters(present, late, judged["rank_waits"], float(tree.thresholds["noise_interval_z"]))
    mset = measurement_set([r.facts for r in base or ranks])
    if mset is not None and pace:
        mset["pace"] = pace
        mset["basis"] += f"; {pace}"
    path, fixes, source, edge = [], [], "none", None
    if mset is not None:
        force = None
        v = verdict_from(mset["values"], tree)
        if v["bound"] == PEER:
            # The ranks that set the pace wait for others too: they wait for each other in
            # turn, and their own work is what the job can change.
            force = {"peer_wait": ("no", "the ranks on the critical path wait for each other in turn; "
                                         "their own work decides")}
            v = verdict_from(mset["values"], tree, force)
        bound, path, fixes, source = v["bound"], v["path"], v["fixes"], "measurements"
        steps = [m for r in base for m in step_values(counted_steps(r.facts))]
        edge = borderline(mset["values"], path, steps, tree, bound, force)
    else:
        bound, _ = _vote(base)
        source = "rank verdicts" if bound else "none"
    counts = Counter(r.verdict.bound for r in present if r.verdict.bound in BOUNDS)
    if len(counts) > 1:
        findings.append({
            "id": "rank_verdicts_differ",
            "severity": "info",
            "message": "Ranks disagree on what bounds them: "
            + ", ".join(f"{n} {b}-bound" for b, n in counts.most_common()) + ".",
            "advice": "Look at the odd ranks first: in a synchronous job the slowest rank sets the pace.",
            "evidence": {"bounds": {str(r.rank): r.verdict.bound for r in present}},
        })
    cause = None
    explanation = judged["comm_explanation"] if isinstance(judged["comm_explanation"], dict) else None
    if bound == "comm" and explanation is not None:
        cause = explanation.get("cause")
        if isinstance(explanation.get("finding"), dict):
            findings.append(explanation["finding"])
    elif isinstance(judged["straggler_finding"], dict):
        findings.append(judged["straggler_finding"])
    measured = {name: getattr(facts, name) for name in JOB_FACT_FIELDS}
    measured.update(what_if=stragglers.straggler_what_if(facts.what_if, tree), findings=findings)
    return Job(**measured, stragglers=judged["stragglers"], rank_waits=judged["rank_waits"], bound=bound,
               cause=cause, path=path, fixes=fixes, verdict_source=source, borderline=edge, measurements=mset,
               bound_counts={str(b): n for b, n in counts.items()})
