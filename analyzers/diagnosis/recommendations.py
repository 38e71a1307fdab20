"""Recommendations and their expected gains: computed here only (the memory advice is memory.py's).

Expected gain. Every moment of a step is attributed to exactly one of five phases, so
removing a phase entirely shortens the step by that phase's share s, a speed-up of
1 / (1 - s): the upper bound quoted ("up to"). Fixes rarely remove a phase entirely;
`RECOVERABLE` holds the share of a phase its fixes typically win back.
"""

from __future__ import annotations

import math

from diag.analyzers.diagnosis.inputs import PHASE_LABELS, PHASES, num, pct


def recommendations(bound, job_shares, tree, job: dict, findings: list[dict], stragglers, nccl, memory,
                    evidence) -> list[dict]:
    """What to change, ranked by expected gain, each linked to the evidence behind it."""
    ev_ids = {e["id"] for e in evidence}
    recs = []
    seen_phases = set()
    if job_shares:
        # The verdict's phase first, then other phases large enough to matter (>= 10% of the step).
        order = [bound] if bound else []
        order += [p for p in sorted(PHASES, key=lambda p: -job_shares[p]) if p != bound]
        for p in order:
            share = job_shares[p]
            if p != bound and share < 0.10:
                continue
            if p == "compute" and p != bound:
                continue  # compute time is the work itself; only advise on it when it bounds the step
            if p == "wait":
                continue  # waiting is fixed on the rank waited for: the straggler recommendations below
            seen_phases.add(p)
            refs = ["ev-shares"] + (["ev-data-wait"] if p == "data" and "ev-data-wait" in ev_ids else [])
            if p == "comm":
                refs += [e for e in ev_ids if e.startswith(("ev-busbw", "ev-nccl-", "ev-straggler-"))]
            why = f"{PHASE_LABELS[p].capitalize()}: {pct(share)} of step time."
            if p == "comm":
                # The cross-rank diagnosis says why communication is exposed; it belongs here.
                for f in job.get("findings") or []:
                    if isinstance(f, dict) and f.get("id") in COMM_CAUSE_FINDINGS and f.get("message"):
                        why += " " + str(f["message"])
            frac = RECOVERABLE[p]
            recs.append({
                "id": f"phase-{p}",
                "title": _phase_title(p, share),
                "actions": list(tree.verdicts[p]["fixes"]),
                "gain_share": share * frac if frac else None,
                "gain_max_share": share,
                "gain": _phase_gain_text(p, share, frac),
                "evidence": sorted(set(refs)),
                "why": why,
                "primary": p == bound,
            })
    for s in stragglers:
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
            "gain_share": wait,
            "gain_max_share": wait,
            "gain": (_gain_text(wait) + " (the time the other ranks spend waiting for it)") if wait is not None
            else "The other ranks' waiting time at collectives would shrink; not quantified",
            "evidence": [f"ev-straggler-{s['rank']}"],
            "why": f"Rank {s['rank']} is named as a straggler: {s['evidence_text']}",
            "primary": False,
        })
    frac = nccl.get("busbw_fraction")
    if frac is not None and frac < 0.8 and job_shares and job_shares["comm"] > 0.02:
        gain = job_shares["comm"] * (1 - frac)
        recs.append({
            "id": "nccl-bandwidth",
            "title": "Bring collective bandwidth up to what the network can do",
            "actions": [
                "Read the NCCL transport lines below: NET/Socket between nodes means InfiniBand/RoCE is not used.",
                "Check NCCL_IB_HCA, NCCL_SOCKET_IFNAME and GPUDirect RDMA (NCCL_NET_GDR_LEVEL).",
                "Re-run `diag nccl` after each change to see the bus bandwidth move.",
            ],
            "gain_share": gain,
            "gain_max_share": gain,
            "gain": _gain_text(gain) + f" (communication at the expected bandwidth would take {pct(frac)} "
            "of its current time)",
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
    covered = {"comm_share_notable", "straggler"} | (COMM_CAUSE_FINDINGS if "comm" in seen_phases else set())
    for i, f in enumerate(findings):
        if not f.get("advice") or f["id"] in covered:
            continue
        recs.append({
            "id": f"finding-{f['id']}",
            "title": _short(f["message"]),
            "actions": [f["advice"]],
            "gain_share": None,
            "gain": "Not quantified from these measurements",
            "evidence": [f"ev-finding-{i}"],
            "why": f["message"],
            "primary": False,
        })
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
    # Ranked by expected gain; the verdict's own fixes lead among equal gains; unquantified last.
    recs.sort(key=lambda r: (r["gain_share"] is None, -(r["gain_share"] or 0), not r["primary"]))
    for i, r in enumerate(recs, 1):
        r["rank"] = i
    return recs


# Share of a phase that its fixes typically win back: the basis of "expected gain".
# data 0.9: more workers, pinned memory and prefetch usually hide nearly all of the wait;
# comm 0.8: overlap and bucketing hide most exposed communication, the last bucket stays exposed;
# host 0.7: CUDA graphs / torch.compile remove launch and sync overhead, some Python remains;
# memory 0.5: fusion and bf16 roughly halve the bytes bandwidth-bound kernels move;
# compute: the useful work itself; not estimated.
RECOVERABLE = {"data": 0.9, "comm": 0.8, "host": 0.7, "memory": 0.5, "compute": None}


# Cross-rank findings that explain exposed communication (shown with the comm recommendation).
COMM_CAUSE_FINDINGS = {"slow_collectives", "straggler_induced_comm", "unsynchronised_arrival"}


def _phase_gain_text(p: str, share: float, frac: float | None) -> str:
    if frac is None:
        return ("Compute is the useful work; gains come from doing it faster (lower precision, tensor cores) "
                "or doing less of it, not from removing it")
    g = share * frac
    return (f"About {pct(g)} of step time, {1 / (1 - g):.2f}x faster steps: these fixes typically win back "
            f"{frac:.0%} of the {pct(share)} spent on {PHASE_LABELS[p]} (at most all of it, "
            f"{1 / (1 - share) if share < 0.99 else math.inf:.2f}x)")


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


def _gain_text(share: float | None) -> str:
    if share is None:
        return "Not quantified"
    speedup = 1 / (1 - share) if share < 0.99 else math.inf
    sp = "more than 100x" if math.isinf(speedup) else f"{speedup:.2f}x"
    return f"Up to {pct(share)} of step time, a step speed-up of up to {sp}"
