"""The diagnosis document: one judgement of a job, which every view reads.

`build_diagnosis(ranks, job, run)` turns the judged ranks and cross-rank facts of an
analysis (schema diag.analysis/1), the run directory's records (`run`, a
`diag.run_documents.RunRecords`) and the NCCL results into the job block with its
verdict (cross-rank facts, verdict, decision path, findings) and one
`diag.diagnosis_document.Diagnosis` (schema diag.diagnosis/1):

  bound, headline  the verdict and its sentence, quoting the measurement set
  measurements     the numbers the verdict rests on and the steps they cover
  decision_path    the tree walked on those same numbers
  confidence       how sure, and why
  findings         of the job and the ranks, merged
  evidence         numbered facts the verdict and recommendations link to
  recommendations  ranked by predicted gain (the job's what-if)
  memory, nccl     device memory against capacity; what NCCL says

`diag analyze --json`, summary.json, the Markdown and HTML reports and the demo read
this; none of them recomputes a verdict, a share or a gain. Pure: new values out.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from diag.analyzers.analysis_types import Job, JobFacts, JudgedRank, RunRankFacts
from diag.analyzers.diagnosis import decision_tree, reporting
from diag.analyzers.diagnosis.causes import causes
from diag.analyzers.diagnosis.context import JobContext, LostRanks
from diag.analyzers.diagnosis.decision_tree import metric_text
from diag.analyzers.diagnosis.evidence import evidence, merged_findings, nccl_facts
from diag.analyzers.diagnosis.inputs import (
    BOUND_CODE,
    CLASSES,
    PHASE_LABELS,
    PHASE_PHRASES,
    MergedRank,
    Ranks,
    Steps,
    concat,
    describe,
    device_events_missing,
    job_steps,
    mean,
    merge_ranks,
    mode_bound,
    num,
    rank_shares,
    step_iterations,
    tw_shares,
    world_size,
)
from diag.analyzers.diagnosis.memory import memory_section
from diag.analyzers.diagnosis.precision import cpu_without_bf16_units, withhold_half_precision
from diag.analyzers.diagnosis.recommendations import recommendations
from diag.analyzers.diagnosis.run_figures import run_figures
from diag.analyzers.diagnosis.straggler_cause import with_likely_causes
from diag.analyzers.diagnosis.straggler_episodes import episode_finding, straggler_episodes
from diag.analyzers.diagnosis.verdict import has_all_shares, job_verdict, rank_measurements
from diag.analyzers.numbers import percent as pct
from diag.diagnosis_document import Diagnosis
from diag.run_documents import RunRecords


def build_diagnosis(ranks: list[JudgedRank], job: JobFacts | Job, run: RunRecords | None = None, tree=None
                    ) -> tuple[Job, Diagnosis]:
    """(the job block with its verdict, the diagnosis) of one job, from its judged ranks, its
    cross-rank facts and (optionally) its run records."""
    run = run or RunRecords()
    tree = tree or decision_tree.load_tree()
    return diagnose_ranks(job, merge_ranks(ranks, run), run, tree)


def diagnose_ranks(facts: JobFacts | Job, ranks: Ranks, run: RunRecords, tree) -> tuple[Job, Diagnosis]:
    """`build_diagnosis` on ranks already merged with `inputs.merge_ranks`."""
    job = with_likely_causes(diagnose_job(facts, ranks, tree), ranks, tree)
    job_missing = {r for r in job.missing_ranks if isinstance(r, int)}
    reports = job.reports if isinstance(job.reports, dict) else None  # a run directory's only
    lost = LostRanks(missing=sorted((set(run.missing_ranks) | job_missing) - set(ranks)),
                     stopped=[x for x in reporting.stopped_ranks(reports, tree) if x["rank"] in ranks])
    return _judge(job, ranks, run, lost, tree)


def diagnose_job(facts: JobFacts | Job, ranks: Ranks, tree) -> Job:
    """The job block with its verdict, from the ranks (analysed, or else their step records)
    and the cross-rank facts (a hand-made block's stragglers and rank waits kept, as
    `job_verdict` keeps a `Job`'s)."""
    judged = []
    for r in ranks.values():
        rank_facts = r.facts
        if not has_all_shares(rank_measurements(rank_facts)) and (tw := tw_shares(r.step_table)) is not None:
            rank_facts = msgspec.structs.replace(rank_facts, shares=tw)  # the shares of its step records
        judged.append(JudgedRank(facts=rank_facts, verdict=r.verdict))
    return job_verdict(judged, facts, tree)


def _judge(job: Job, ranks: Ranks, run: RunRecords, lost: LostRanks, tree) -> tuple[Job, Diagnosis]:
    """Everything but the job verdict, which `job` already holds."""
    job, tree = withhold_half_precision(job, tree, cpu_without_bf16_units(ranks))
    allt = concat(ranks)
    mset = job.measurements
    # Ranks whose traces lack their GPU's device events: their step shares are the host's alone.
    blind = _blind(ranks)
    step_shares = None if blind and blind == set(ranks) else tw_shares(allt)
    ctx = JobContext(
        job=job, ranks=ranks, run=run, lost=lost, tree=tree, world=world_size(job, run, lost.missing, ranks),
        all_steps=allt,
        job_steps=job_steps(ranks), mset=mset, shares=(mset or {}).get("shares") or step_shares,
        bound=job.bound if job.bound in CLASSES else None, stragglers=_stragglers(job),
        nccl=nccl_facts(run, tree),
    )
    bound, world, steps, job_shares, stragglers = ctx.bound, ctx.world, ctx.job_steps, ctx.shares, ctx.stragglers
    path = _decision_path(job, ranks, bound)
    episodes = straggler_episodes({k: r.facts.steps for k, r in ranks.items()}, tree)
    over_time = episode_finding(episodes, tree)
    extra = [f for f in (over_time, ended_finding(ranks, lost.stopped), reporting.missing_finding(lost.missing, world))
             if f] + reporting.input_findings(job)
    findings = merged_findings([*job.findings, *extra], ranks)
    basis = mset["basis"] if mset else f"{int(steps.has_shares.sum())} step(s) of {len(ranks)} rank(s)"
    ev = evidence(ranks, allt, steps, job_shares, basis, stragglers, ctx.nccl, findings)
    headline = _headline(ctx)
    whole = [k for k, r in ranks.items() if (it := step_iterations(r.facts)) and not it.get("marker")]
    confidence = _confidence(bound, _measured(allt, mset), path, lost.missing, len(run.problems), world,
                             job.borderline, sorted(blind), whole)
    memory = memory_section(ranks, tree, world)
    found = causes(ctx)
    recs = recommendations(ctx, findings, memory, ev, found)
    headline["note"] = _order_note(bound, recs, job_shares)
    return job, Diagnosis(
        bound=bound,
        headline=headline,
        measurements=mset,
        phase_shares={p: job_shares.get(p) for p in CLASSES} if job_shares else None,
        decision_path=path,
        confidence=confidence,
        stragglers=stragglers,
        # Who the others waited for, step by step, in episodes (persistent, rotating, transient).
        straggler_episodes=episodes,
        findings=findings,
        evidence=ev,
        recommendations=recs,
        # What in the job's own objects makes a phase slow (causes.py), each quoting its names.
        causes=found,
        # The job's critical path and what-if predictions, as the job analysis replayed them.
        what_if={"critical_path": job.critical_path, "changes": [e for e in job.what_if if isinstance(e, dict)]},
        memory=memory,
        nccl=ctx.nccl,
        world_size=world,
        missing_ranks=lost.missing,
        stopped_ranks=[x["rank"] for x in lost.stopped],
        # What the run is and how fast it went, for the report and for comparing it with another.
        run_figures=run_figures(ranks, steps, world),
    )


def _decision_path(job: Job, ranks: Ranks, bound) -> dict | None:
    """The tree's path to the job verdict, on the measurement set the headline quotes."""
    mset = job.measurements
    jp = job.path
    if mset and isinstance(jp, list) and jp:
        return {"source": mset["basis"], "nodes": _clean_path(jp), "bound": bound}
    # Without measurements the verdict is the ranks' vote: show an agreeing rank's own path.
    for r in sorted(ranks.values(), key=lambda r: r.rank):
        p = r.verdict.path
        if bound and r.verdict.bound == bound and p:
            return {"source": f"rank {r.rank}'s measurements over its steps", "nodes": _clean_path(p),
                    "bound": bound}
    return None


def _clean_path(path: list) -> list[dict]:
    out = []
    for n in path:
        if not isinstance(n, dict):
            continue
        out.append(
            {
                "question": str(n.get("question", n.get("node", ""))),
                "metric": str(n.get("metric", "")),
                "value": num(n.get("value")),
                "op": str(n.get("op", "")),
                "threshold": num(n.get("threshold")),
                "answer": str(n.get("answer", "")),
            }
        )
    return out


def _stragglers(job: Job) -> list[dict]:
    out = []
    for s in job.stragglers:
        if isinstance(s, dict) and isinstance(s.get("rank"), int):
            ev = s.get("evidence")
            text = s.get("message") if isinstance(s.get("message"), str) else None
            share = num(ev.get("imposed_wait_share_of_step")) if isinstance(ev, dict) else None
            out.append({**s, "evidence_text": text or (ev if isinstance(ev, str) else describe(ev)),
                        "wait_share": share})
    return out


def _rank_share(r: MergedRank, phase: str) -> float | None:
    sh = rank_shares(r)
    return sh[phase] if sh else None


def _blind(ranks: Ranks) -> set:
    """The ranks whose traces lack the device events of their GPU process."""
    return {k for k, r in ranks.items() if device_events_missing(r.facts)}


ABNORMAL_ENDS = {"failed": "failed", "terminated": "was told to stop", "interrupted": "was interrupted"}


def ended_finding(ranks: Ranks, lost: list[dict]) -> dict | None:
    """The ranks that did not finish, each with what ended it in its own words (the exception
    its training raised, the signal), and the ranks that stopped reporting: a killed rank makes
    its peers fail at the next collective, so the first to go is what to read first. `lost`: the
    ranks that stopped reporting (diagnosis.reporting.stopped_ranks)."""
    ended = sorted(((r.rank, f.status, f.error) for r in ranks.values()
                    if isinstance(f := r.facts, RunRankFacts) and f.status in ABNORMAL_ENDS), key=lambda e: e[0])
    if not ended and not lost:
        return None
    parts = [f"rank {k} {ABNORMAL_ENDS[str(status)]}" + (f": {error.splitlines()[0][:300]}" if error else "")
             for k, status, error in ended]
    for x in lost[:16]:
        where = f" on {x['host']}" if x.get("host") else ""
        step = f" after step {x['last_step']}" if x.get("last_step") is not None else ""
        parts.append(f"rank {x['rank']}{where} stopped reporting{step} without ending (killed: the OOM killer, "
                     "a hard kill, a crash, or it hangs)")
    return {"id": "ranks_ended_abnormally", "severity": "error",
            "message": "The job did not end normally: " + "; ".join(parts) + ".",
            "advice": "Read the first rank to go first: a rank killed without warning leaves no error of its own "
                      "(the host's kernel log, dmesg, names the OOM killer), and its peers then fail at the next "
                      "collective with a connection error that is a consequence, not the cause.",
            "evidence": {"ended": [{"rank": k, "status": status, "error": error} for k, status, error in ended],
                         "stopped_reporting": [x["rank"] for x in lost], "stopped": lost[:1000]}}


def _no_verdict(ctx: JobContext) -> dict:
    """The headline where nothing bounds the job: why no verdict was given."""
    ranks = ctx.ranks
    if not ranks:
        text = "No verdict: the run directory holds no readable rank data."
    elif len(ctx.all_steps) == 0:
        text = "No verdict: no training step was recorded (the run may have stopped before its first step)."
    elif _blind(ranks) == set(ranks):
        text = ("Can't tell: the trace holds no device events of its GPU process (no kernel, memcpy or "
                "memset), so its host-side time says nothing of what bounds the device.")
    else:
        text = "No verdict: steps were timed, but nothing measured where their time went."
    return {"bound": None, "title": "No verdict", "text": text}


def _headline(ctx: JobContext) -> dict:
    bound, ranks, world, mset = ctx.bound, ctx.ranks, ctx.world, ctx.mset
    if bound is None:
        return _no_verdict(ctx)
    title = ctx.tree.verdicts[bound]["title"]
    title = title[:1].upper() + title[1:]
    measured = set(mset["ranks"]) if mset else set(ranks)
    agree = [r for r in ranks.values() if r.verdict.bound == bound]
    if not agree:
        agree = [r for r in ranks.values() if mode_bound(r.step_table.bound) == bound]
    n_agree, n_ranks = len(agree), len(ranks)
    lost = [x["rank"] for x in ctx.lost.stopped]
    if n_ranks == 0:
        where = ""
    elif n_agree == n_ranks and n_ranks == world and not lost:
        where = "" if n_ranks == 1 else " on both ranks" if n_ranks == 2 else f" on all {n_ranks} ranks"
    else:
        where = f" on {n_agree} of {world} ranks" if world > 1 else ""
    # The verdict's own number: the measurement set's, which the decision path shows too.
    share = num(((mset or {}).get("values") or {}).get(f"{bound}_share"))
    if share is None and ctx.shares:
        share = ctx.shares.get(bound)
    per_rank = [x for x in (_rank_share(r, bound) for r in ranks.values() if r.rank in measured) if x is not None]
    spread = ""
    if len(per_rank) > 1 and max(per_rank) - min(per_rank) >= 0.02:
        spread = f" ({pct(min(per_rank))}-{pct(max(per_rank))} across ranks)"
    if share is not None:
        text = f"{title}: {PHASE_PHRASES[bound]} {pct(share)} of step time{spread}{where}"
    else:
        text = f"{title}{where}"
    edge = ctx.job.borderline
    extra = _headline_extras(ctx, lost, edge)
    if extra:
        text += "; " + "; ".join(extra)
    return {"bound": bound, "title": title, "text": text + ".", "share": share,
            "borderline": list(edge["candidates"]) if edge else None,
            "ranks_agreeing": n_agree, "world_size": world, "basis": mset["basis"] if mset else None,
            "summary": ctx.tree.verdicts[bound]["summary"]}


def _headline_extras(ctx: JobContext, lost: list, edge: dict | None) -> list[str]:
    """What the headline adds after its verdict: stopped ranks, a borderline call, and per
    verdict its own figure (the bandwidth and the late ranks, MFU, the wait for a batch)."""
    bound, nccl, job = ctx.bound, ctx.nccl, ctx.job
    extra = []
    if lost:
        extra.append(f"{'rank' if len(lost) == 1 else 'ranks'} {', '.join(map(str, lost[:8]))} stopped before the "
                     "job ended")
    if edge and edge.get("text"):
        extra.append(str(edge["text"]))
    if bound == "comm":
        summary = nccl.get("bandwidth_summary")
        if summary:
            extra.append(summary)
        if nccl.get("log_sentences"):
            sentence = nccl["log_sentences"][0]
            # The bandwidth diagnosis may already name the same cause (e.g. TCP sockets): say it once.
            said = (summary or "").lower()
            if not any(k in said and k in sentence.lower() for k in ("tcp socket", "gpudirect", "shared memory")):
                extra.append(sentence)
        late = [s for s in ctx.stragglers if s.get("rank") is not None]
        if late:
            names = ", ".join(str(s["rank"]) for s in late[:4])
            if len(late) == 1:
                extra.append(f"rank {names} is late and the other ranks wait for it")
            else:
                extra.append(f"ranks {names} are late and the other ranks wait for them")
        cause = job.cause if (job.collectives.get("matched") or 0) > 0 else None
        if cause == "network":
            extra.append("no rank is late: the collectives themselves are slow")
        elif cause == "imbalance":
            extra.append("no single rank is late, but ranks reach the collectives at different times")
    if bound == "compute":
        mfu = mean([r.facts.mfu for r in ctx.ranks.values() if num(r.facts.mfu) is not None])
        if mfu is not None:
            extra.append(f"MFU {pct(mfu)}")
    if bound == "data":
        waits = ctx.all_steps.wait[~np.isnan(ctx.all_steps.wait)]
        if len(waits):
            extra.append(f"median wait for a batch {np.median(waits) * 1000:.1f} ms")
    return extra


def _order_note(bound, recs, job_shares) -> str | None:
    """Say so when the largest predicted gain is not the verdict's own phase."""
    if not bound or not recs or not job_shares or not recs[0]["id"].startswith("phase-"):
        return None
    p = recs[0]["id"][len("phase-"):]
    if p == bound:
        return None
    return (f"The verdict is {bound}-bound because the decision tree asks its questions in a fixed order "
            f"(data wait, waiting for other ranks, device idle, exposed communication, then the kernel mix) and the {bound} question "
            f"answered yes first. By predicted gain, though, the fixes for {PHASE_LABELS[p]} "
            f"({pct(job_shares[p])} of the step) come first in the list below.")


def _measured(allt: Steps, mset: dict | None) -> Steps:
    """The steps the measurement set covers (warm-up left out), so that confidence counts
    the same steps the verdict rests on."""
    first = ((mset or {}).get("steps") or {}).get("first")
    if first is None or not len(allt):
        return allt
    keep = allt.step >= first
    out = Steps(int(keep.sum()))
    out.step = allt.step[keep]
    for f in Steps.FIELDS:
        setattr(out, f, getattr(allt, f)[keep])
    out.shares, out.bound, out.evidence = allt.shares[keep], allt.bound[keep], allt.evidence[keep]
    return out


# The highest confidence a verdict can have when a GPU process's trace lacks its device events.
BLIND_DEVICE_SCORE = 0.45
# The confidence kept when a trace had to be judged whole (no steps, no iterations found).
WHOLE_TRACE_FACTOR = 0.7


def _evidence_base(allt: Steps) -> tuple[float, list[str]]:
    """The confidence the evidence itself allows (traced steps, sampled ones, none), and why."""
    n_trace = int(allt.traced.sum())
    n_all = int((allt.bound >= 0).sum())
    if n_trace:
        return 0.9, [f"{n_trace} of the {n_all} analysed rank-steps rest on profiler traces, which "
                     "attribute every microsecond of a step to one phase; the others rest on sampled measurements."]
    if n_all:
        return 0.65, ["No profiler window was analysed: the verdict rests on sampled measurements only "
                      "(step time, DataLoader wait, device utilisation), which cannot split device time "
                      "into communication, memory and compute."]
    return 0.5, ["No per-step verdicts were recorded; the verdict comes from the analysis summary alone."]


def _deciding_margin(path, edge, reasons: list[str]) -> float:
    """The factor the deciding node's margin gives (adding its sentence to `reasons`): the
    borderline node where there is one (never called clear beside it), else the last of the path."""
    nodes = (path or {}).get("nodes") or []
    last = next((n for n in nodes if isinstance(edge, dict) and n.get("metric") == edge.get("metric")),
                nodes[-1] if nodes else None)
    if last is None:
        return 1.0
    v, t = last["value"], last["threshold"]
    if v is None or t in (None, 0) or math.isinf(v):
        return 1.0
    vs, ts = metric_text(last["metric"], v), metric_text(last["metric"], t, threshold=True)
    if abs(v - t) / abs(t) < 0.15:
        reasons.append(f"The deciding measurement ({last['metric']} = {vs}) is within 15% of its threshold "
                       f"({ts}): a small change could flip the verdict.")
        return 0.75
    reasons.append(f"The deciding measurement ({last['metric']} = {vs}) is clear of its threshold ({ts}).")
    return 1.0


def _confidence(bound, allt: Steps, path, missing: list[int], damaged: int, world, edge=None, blind=(),
                whole=()) -> dict:
    """A score in [0, 1] from four factors, each explained in a sentence."""
    if bound is None:
        why = ["There is no verdict to be sure of."]
        if blind:
            why.append(f"The traces of rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} hold no device "
                       "events of their GPU process: no class can be given from the host's time alone.")
        return {"level": "none", "score": 0.0, "reasons": why}
    base, reasons = _evidence_base(allt)
    # Agreement across steps.
    codes = allt.bound[allt.bound >= 0]
    agree = float((codes == BOUND_CODE[bound]).mean()) if len(codes) else None
    factor = 1.0
    if agree is not None:
        factor *= 0.5 + 0.5 * agree
        reasons.append(f"{pct(agree)} of analysed steps across ranks give the same verdict.")
    factor *= _deciding_margin(path, edge, reasons)
    if isinstance(edge, dict) and edge.get("candidates"):
        factor *= 0.7
        reasons.append(f"The verdict is borderline between {' and '.join(edge['candidates'])}: "
                       + str(edge.get("text", "")) + ".")
    unknown = [n for n in (path or {}).get("nodes") or [] if n["answer"] == "unknown"]
    if unknown:
        factor *= 0.9
        reasons.append(
            "Some questions could not be answered (" + ", ".join(n["metric"] for n in unknown)
            + " not measured); the tree took their 'no' branch."
        )
    if missing:
        factor *= max(0.5, 1 - len(missing) / max(world, 1))
        reasons.append(f"{len(missing)} of {world} rank(s) left no data; they may behave differently.")
    if damaged:
        factor *= 0.9
        reasons.append(f"{damaged} file(s) were damaged or unreadable and were skipped.")
    if whole:
        factor *= WHOLE_TRACE_FACTOR
        reasons.append(f"The traces of rank(s) {', '.join(map(str, whole[:8]))} have no steps and no iterations "
                       "could be found in them: each was judged whole, start-up included.")
    score = round(base * factor, 2)
    if blind:
        score = min(score, BLIND_DEVICE_SCORE)
        reasons.append(f"The traces of rank(s) {', '.join(map(str, blind[:8]))} hold no device events although "
                       "the process used a GPU: their steps are attributed from the host side alone.")
    level = "high" if score >= 0.75 else "medium" if score >= 0.5 else "low"
    return {"level": level, "score": score, "reasons": reasons}
