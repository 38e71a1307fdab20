"""Recommendations, ranked by their predicted gains (the memory advice is memory.py's).

A gain is a prediction, not a share: the job's what-if (`diag.analyzers.whatif`) replays
each traced step's dependency graph with the work a fix acts on changed, so hidden work
that would surface and waits that would move are counted. A phase's share is only the
upper bound of what removing it could win. Where the traced steps hold none of the work a
fix acts on, or no step was traced, the recommendation says no prediction is possible.
The gain of a recommendation is read here from the job's what-if entries, and nowhere else.
"""

from __future__ import annotations

from diag.analyzers.diagnosis import action_models
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS, num
from diag.analyzers.numbers import percent as pct


def recommendations(ctx: JobContext, findings: list[dict], memory: dict, evidence: list[dict],
                    causes: list[dict] | tuple = ()) -> list[dict]:
    """What to change, ranked by predicted gain, each linked to the evidence behind it; a phase's
    causes (causes.py) lead its actions, in the job's own names."""
    ev_ids = {e["id"] for e in evidence}
    what_if = [e for e in ctx.job.what_if if isinstance(e, dict)]
    recs = _phase_recommendations(ctx, causes, what_if, ev_ids)
    seen_phases = {r["id"][len("phase-"):] for r in recs}
    recs += _straggler_recommendations(ctx, what_if)
    recs += _nccl_recommendations(ctx, what_if, ev_ids)
    covered = {"comm_share_notable", "straggler"} | (COMM_CAUSE_FINDINGS if "comm" in seen_phases else set())
    recs += _finding_recommendations(findings, covered)
    if memory.get("advice") and not any(r["id"] == "finding-low_memory_use" for r in recs):
        recs.append({
            "id": "memory-capacity",
            "title": memory["advice"]["title"],
            "actions": memory["advice"]["actions"],
            "gain_share": None,
            "gain": memory["advice"]["gain"],
            "evidence": ["memory"],
            "why": memory["advice"]["why"],
            "primary": False,
        })
    return _ranked(recs, ctx.tree.thresholds["recommendation_min_gain"])


def _ranked(recs: list[dict], floor: float) -> list[dict]:
    """Ranked by predicted gain; the verdict's own fixes lead among equal gains; unpredicted next;
    those predicted to win under `recommendation_min_gain` (`floor`) of the step last, as notes."""
    for r in recs:
        r["minor"] = not r["primary"] and r["gain_share"] is not None and r["gain_share"] < floor
        if r["minor"]:
            r["minor_below"] = floor
    recs.sort(key=lambda r: (r["minor"], r["gain_share"] is None, -(r["gain_share"] or 0), not r["primary"]))
    for i, r in enumerate(recs, 1):
        r["rank"] = i
    return recs


def _phase_recommendations(ctx: JobContext, causes, what_if: list[dict], ev_ids: set) -> list[dict]:
    """The verdict's phase first, then other phases large enough to matter, each with its causes'
    actions before the tree's fixes they supersede."""
    bound, job_shares, tree = ctx.bound, ctx.shares, ctx.tree
    if not job_shares:
        return []
    recs = []
    order = [bound] if bound else []
    order += [p for p in sorted(CLASSES, key=lambda p: -job_shares[p]) if p != bound]
    for p in order:
        share = job_shares[p]
        if p != bound and share < tree.thresholds["recommendation_min_share"]:
            continue
        if p == "compute" and p != bound:
            continue  # compute time is the work itself; only advise on it when it bounds the step
        if p == "wait":
            continue  # waiting is fixed on the rank waited for: the straggler recommendations
        refs = ["ev-shares"] + (["ev-data-wait"] if p == "data" and "ev-data-wait" in ev_ids else [])
        if p == "comm":
            refs += [e for e in ev_ids if e.startswith(("ev-busbw", "ev-nccl-", "ev-straggler-"))]
        why = f"{PHASE_LABELS[p].capitalize()}: {pct(share)} of step time."
        if p == "comm":
            # The cross-rank diagnosis says why communication is exposed; it belongs here.
            for f in ctx.job.findings:
                if isinstance(f, dict) and f.get("id") in COMM_CAUSE_FINDINGS and f.get("message"):
                    why += " " + str(f["message"])
        mine = [c for c in causes if c["phase"] == p]
        lead = next((c["expected"] for c in mine if c.get("expected")), None)
        why += "".join(" " + c["text"] for c in mine)
        recs.append({
            "id": f"phase-{p}",
            "title": _phase_title(p, share),
            "actions": [c["action"] for c in mine] + [
                f for f in tree.verdicts[p]["fixes"]
                if not any(f.startswith(old) for c in mine for old in c["supersedes"])],
            "causes": [c["id"] for c in mine],
            **(expected_gain(lead, share, PHASE_LABELS[p]) if lead else
               predicted_gain(_best_prediction(what_if, p), share, PHASE_LABELS[p])),
            "evidence": sorted(set(refs)),
            "why": why,
            "primary": p == bound,
        })
    return recs


def _straggler_recommendations(ctx: JobContext, what_if: list[dict]) -> list[dict]:
    recs = []
    for s in ctx.stragglers:
        wait = num(s.get("wait_share")) or num(s.get("others_wait_share"))
        recs.append({
            "id": f"straggler-{s['rank']}",
            "title": f"Find out why rank {s['rank']} is late",
            "actions": [
                f"Compare rank {s['rank']}'s host and device metrics with the others (the timelines below): "
                "thermal or power throttling, a busy CPU, a slow disk or DataLoader.",
                "Check that every rank gets the same amount of work (uneven batches, sequence lengths).",
                "If the late rank's device is throttled or faulty, exclude that node.",
            ],
            **_straggler_gain(ctx, s["rank"], _best_prediction(what_if, "wait"), wait),
            "evidence": [f"ev-straggler-{s['rank']}"],
            "why": f"Rank {s['rank']} is named as a straggler: {s['evidence_text']}",
            "primary": False,
        })
    return recs


def _nccl_recommendations(ctx: JobContext, what_if: list[dict], ev_ids: set) -> list[dict]:
    """The bus bandwidth below what the network can do, and the NCCL log's findings with advice."""
    job_shares, nccl, tree = ctx.shares, ctx.nccl, ctx.tree
    recs = []
    frac = nccl.get("busbw_fraction")
    if frac is not None and frac < tree.thresholds["busbw_healthy"] and job_shares \
            and job_shares["comm"] > tree.thresholds["recommendation_min_comm_share"]:
        recs.append({
            "id": "nccl-bandwidth",
            "title": "Bring collective bandwidth up to what the network can do",
            "actions": [
                "Read the NCCL transport lines below: NET/Socket between nodes means InfiniBand/RoCE is not used.",
                "Check NCCL_IB_HCA, NCCL_SOCKET_IFNAME and GPUDirect RDMA (NCCL_NET_GDR_LEVEL).",
                "Re-run `diag nccl` after each change to see the bus bandwidth move.",
            ],
            # At the expected bandwidth, communication would take `frac` of its current time.
            **predicted_gain(_comm_at(what_if, frac), job_shares["comm"], "exposed communication"),
            "evidence": sorted(e for e in ev_ids if e.startswith(("ev-busbw", "ev-nccl-"))),
            "why": nccl.get("bandwidth_summary", ""),
            "primary": False,
        })
    comm = job_shares["comm"] if job_shares else None
    for i, f in enumerate(nccl.get("log_findings") or []):
        if f["severity"] not in ("critical", "error", "warning") or not f.get("advice"):
            continue
        bound_text = (f"at most the exposed communication, {pct(comm)} of step time" if comm is not None
                      else "not quantified")
        recs.append({
            "id": f"nccl-{f['id']}",
            "title": f"Fix NCCL: {f.get('summary') or f['message']}",
            "actions": [f["advice"]],
            "gain_share": None,
            "gain": f"Faster collectives; {bound_text}",
            "evidence": [f"ev-nccl-{i}"],
            "why": f["message"],
            "primary": False,
        })
    return recs


def _finding_recommendations(findings: list[dict], covered: set) -> list[dict]:
    """Each finding with advice that no recommendation above covers."""
    return [{
        "id": f"finding-{f['id']}",
        "title": _short(f["message"]),
        "actions": [f["advice"]],
        "gain_share": None,
        "gain": "Not quantified from these measurements",
        "evidence": [f"ev-finding-{i}"],
        "why": f["message"],
        "primary": False,
    } for i, f in enumerate(findings) if f.get("advice") and f["id"] not in covered]


# Cross-rank findings that explain exposed communication (shown with the comm recommendation).
COMM_CAUSE_FINDINGS = {"slow_collectives", "straggler_induced_comm", "unsynchronised_arrival"}


def _phase_title(p: str, share: float) -> str:
    return {
        "data": "Feed the device faster: cut the wait for data",
        "host": "Remove host overhead: synchronisation points and launch-bound small ops",
        "comm": "Hide or shrink communication",
        "memory": "Fuse bandwidth-bound kernels",
        "compute": "Make the compute itself cheaper",
    }[p]


def _short(msg: str, limit: int = 110) -> str:
    """A title from a finding's message: its first clause, or the message cut at a word."""
    for sep in (": ", ". ", "; "):
        i = msg.find(sep)
        if 20 <= i <= limit:
            return msg[:i]
    return msg if len(msg) <= limit else msg[:limit].rsplit(" ", 1)[0] + " ..."


def _best_prediction(what_if: list[dict], cls: str) -> dict | None:
    """The what-if entry with the largest predicted gain among the changes that fix a class
    (no_exposed_comm and comm_2x both fix communication); else one that says why none."""
    fixing = [e for e in what_if if e.get("fixes") == cls]
    predicted = [e for e in fixing if num(e.get("speedup")) is not None]
    if predicted:
        return max(predicted, key=lambda e: e["speedup"])
    return fixing[0] if fixing else None


def _comm_at(what_if: list[dict], factor: float) -> dict | None:
    """The prediction for communication at `factor` of its time, interpolated between the
    replayed points no_exposed_comm (0), comm_2x (0.5) and no change (1)."""
    by_id = {e.get("change"): e for e in what_if}
    z, h = by_id.get("no_exposed_comm"), by_id.get("comm_2x")
    if not (z and h and num(z.get("predicted_step_ms")) and num(h.get("predicted_step_ms"))):
        return z or h
    base = z["baseline_step_ms"]
    pts = [(0.0, z["predicted_step_ms"]), (0.5, h["predicted_step_ms"]), (1.0, base)]
    (x0, y0), (x1, y1) = (pts[0], pts[1]) if factor <= 0.5 else (pts[1], pts[2])
    pred = y0 + (y1 - y0) * (min(max(factor, 0.0), 1.0) - x0) / (x1 - x0)
    return {**z, "change": f"comm_at_{factor:.2f}", "predicted_step_ms": pred, "speedup": base / pred,
            "description": f"Communication taking {factor:.0%} of its measured time (interpolated between "
                           "no_exposed_comm and comm_2x)"}


def _straggler_gain(ctx: JobContext, rank: int, pred: dict | None, wait: float | None) -> dict:
    """A straggler's gain: whatever makes it late, removing it gives the step with every rank at
    the median rank's pace (the no_straggler replay), carried over to the steps outside the
    profiler as a cause's removal is (action_models)."""
    what = "the other ranks' waiting for it"
    expect = action_models.removal(f"rank {rank} at its peers' pace")(ctx, {"ranks": [rank]}, pred) \
        if pred and num(pred.get("predicted_step_ms")) is not None else None
    return expected_gain(expect, wait, what) if expect else predicted_gain(pred, wait, what)


def predicted_gain(pred: dict | None, bound_share: float | None, what: str) -> dict:
    """The gain fields of a recommendation from its what-if prediction."""
    upper = f"; removing {what} entirely is at most {pct(bound_share)} of the step" if bound_share else ""
    if pred is None or num(pred.get("predicted_step_ms")) is None:
        why = pred.get("note") if pred and pred.get("note") else "no profiled step was traced to replay"
        return {"gain_share": None, "gain_max_share": bound_share, "prediction": pred,
                "gain": f"No prediction possible ({why}){upper}"}
    base, new = pred["baseline_step_ms"], pred["predicted_step_ms"]
    gain = max(0.0, 1.0 - new / base) if base > 0 else 0.0
    # A replayed change is the whole of a part of the step gone: the ceiling of what the actions
    # beside it can win, never their own prediction.
    return {"gain_share": gain, "gain_max_share": bound_share, "prediction": pred,
            "gain": f"Ceiling: {_replay_text(pred)}{upper}"}


def _replay_text(pred: dict) -> str:
    base, new = pred["baseline_step_ms"], pred["predicted_step_ms"]
    return (f"{new:.1f} ms per step against {base:.1f} ms measured, {base / new:.2f}x faster "
            f"({pred['change']}: the traced steps replayed so that {_lower(pred['description'])})")


def expected_gain(expect: dict, bound_share: float | None, what: str) -> dict:
    """The gain fields of a recommendation led by a cause whose action has its own prediction."""
    upper = f"; removing {what} entirely is at most {pct(bound_share)} of the step" if bound_share else ""
    base, new = expect["baseline_step_ms"], expect["expected_step_ms"]
    return {"gain_share": max(0.0, 1.0 - new / base) if base > 0 else 0.0, "gain_max_share": bound_share,
            "prediction": expect, "gain": cause_gain(expect, None) + upper}


def cause_gain(expect: dict | None, ceiling: dict | None) -> str:
    """A cause's gain in words: the step its action is predicted to give, with the range the
    measured step should fall in, and apart from it the ceiling (the cause gone entirely). A
    cause whose action is not modelled says so and gives the ceiling alone, labelled."""
    ceil = ceiling if ceiling and num(ceiling.get("predicted_step_ms")) is not None else None
    if expect is None:
        if ceiling is None:
            return "No prediction: no change the replay can make removes exactly this cause"
        if ceil is None:
            return predicted_gain(ceiling, None, "")["gain"]
        return f"Not predicted for the change itself; ceiling, with this cause gone entirely: {_replay_text(ceil)}"
    base, new = expect["baseline_step_ms"], expect["expected_step_ms"]
    text = (f"With {expect['action']}: {new:.1f} ms per step (expected within {expect['low_ms']:.1f} to "
            f"{expect['high_ms']:.1f} ms) against {base:.1f} ms measured, {base / new:.2f}x faster; "
            f"{expect['assumes']}")
    c = expect.get("ceiling_step_ms")
    if num(c) and abs(c - new) > 0.005 * new:  # an action that removes its cause has the ceiling's step
        text += f". Ceiling, with this cause gone entirely: {c:.1f} ms, {base / c:.2f}x"
    return text


def _lower(text: str) -> str:
    """The sentence's first letter lowered, unless its first word is an acronym (DDP, CPU)."""
    if not text or text[1:2].isupper():
        return text
    return text[:1].lower() + text[1:]
