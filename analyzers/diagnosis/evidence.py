"""The evidence a diagnosis points to: numbered facts, merged findings, NCCL facts.

Each recommendation and the verdict link to these by id; the report gives them anchors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diag.analyzers.diagnosis import bandwidth, nccl_log
from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS, Ranks, Steps, describe, mean, num
from diag.analyzers.numbers import percent as pct
from diag.run_documents import RunRecords


def evidence(ranks: Ranks, allt: Steps, steps: Steps, job_shares, basis, stragglers, nccl, findings) -> list[dict]:
    """Numbered facts the verdict and the recommendations point to (anchors on the page)."""
    ev: list[dict] = []
    if job_shares:
        ev.append({
            "id": "ev-shares",
            "label": "Phase shares",
            "text": f"Over {basis}: " + ", ".join(f"{PHASE_LABELS[p]} {pct(job_shares[p])}" for p in CLASSES) + ".",
        })
    n_trace = int(steps.traced.sum())
    n_windows = sum(len(r.windows) for r in ranks.values())
    ev.append({
        "id": "ev-sources",
        "label": "What was measured",
        "text": f"{len(steps)} step(s) timed; {n_trace} step(s) covered by profiler traces "
        f"({n_windows} analysed window(s) across ranks); "
        f"{sum(len(r.samples) for r in ranks.values())} device/host metric sample(s).",
    })
    with np.errstate(invalid="ignore", divide="ignore"):
        waits = allt.wait / allt.dur
    waits = waits[np.isfinite(waits)]
    if len(waits):
        ev.append({
            "id": "ev-data-wait",
            "label": "DataLoader wait",
            "text": f"Median wait for the next batch is {pct(float(np.median(waits)))} of the step "
            f"(90th percentile {pct(float(np.percentile(waits, 90)))}), timed by agent.loader().",
        })
    for s in stragglers:
        ev.append({"id": f"ev-straggler-{s['rank']}", "label": f"Straggler rank {s['rank']}",
                   "text": s["evidence_text"] or "named by the cross-rank analysis"})
    if nccl.get("bandwidth_summary"):
        ev.append({"id": "ev-busbw", "label": "Bus bandwidth", "text": nccl["bandwidth_summary"] + "."})
    for i, f in enumerate(nccl.get("log_findings") or []):
        ev.append({"id": f"ev-nccl-{i}", "label": f"NCCL log: {f.get('id', '')}",
                   "text": str(f.get("message", "")), "lines": [str(x) for x in (f.get("evidence") or [])][:5]})
    gt = [g for r in ranks.values() if (g := r.facts.gpu_time)]
    if gt:
        idle = mean([num(g.get("idle_pct")) for g in gt])
        comp = mean([num(g.get("compute_pct")) for g in gt])
        ov = mean([num(g.get("comm_compute_overlap_pct")) for g in gt])
        parts = []
        if idle is not None:
            parts.append(f"device idle {idle:.1f}%")
        if comp is not None:
            parts.append(f"compute {comp:.1f}%")
        if ov is not None:
            parts.append(f"communication overlapped by compute {ov:.1f}%")
        if parts:
            ev.append({"id": "ev-gpu-time", "label": "GPU time breakdown (HTA definitions)",
                       "text": "Mean over traced ranks: " + ", ".join(parts) + "."})
    for i, f in enumerate(findings):
        # Shown in the findings table (which carries the anchor), not repeated in the evidence list.
        ev.append({"id": f"ev-finding-{i}", "label": f"Finding: {f['id']}", "text": f["message"], "kind": "finding"})
    return ev


def merged_findings(job_findings: list, ranks: Ranks) -> list[dict]:
    """Findings of the job and of the ranks, one entry per id with the ranks it fired on."""
    merged: dict[str, dict] = {}
    sources: list[tuple[int | None, Any]] = [(None, f) for f in job_findings]
    for r in ranks.values():
        sources += [(r.rank, f) for f in r.verdict.findings]
    for rank, f in sources:
        if not isinstance(f, dict):
            continue
        fid = str(f.get("id") or "finding")
        cur = merged.get(fid)
        if cur is None:
            cur = merged[fid] = {
                "id": fid,
                "severity": str(f.get("severity") or "info"),
                "message": _cap(str(f.get("message") or fid)),
                "advice": str(f.get("advice") or ""),
                "evidence": describe(f.get("evidence")),
                "ranks": [],
            }
        if rank is not None:
            cur["ranks"].append(rank)
    order = {"critical": 0, "error": 0, "warning": 1, "info": 2}
    return sorted(merged.values(), key=lambda f: (order.get(f["severity"], 3), f["id"]))


def _cap(text: str, limit: int = 1500) -> str:
    """Long messages (a finding listing hundreds of ranks) are cut for the page at the end of a
    sentence or clause; the analysis JSON (its job and rank findings) has them whole."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    at = max(cut.rfind(". "), cut.rfind("; "))
    cut = cut[:at + 1] if at > limit // 2 else cut.rsplit(" ", 1)[0]
    return f"{cut} ... ({len(text) - len(cut)} more characters in the analysis JSON)"


def nccl_facts(run: RunRecords, tree) -> dict:
    """What the NCCL log and the bus-bandwidth measurement say, as the verdict quotes them."""
    out: dict = {}
    log, bench = run.nccl_log, run.nccl_bench
    if log:
        out["version"] = log.get("nccl_version")
        out["hosts"] = [str(h) for h in (log.get("hosts") or [])][:64] if isinstance(log.get("hosts"), list) \
            else [str(h) for h in (log.get("hosts") or {})][:64]
        out["transports"] = _transport_rows(log.get("transports"))
        out["log_findings"] = [
            {"id": str(f.get("id", "")), "severity": str(f.get("severity", "info")),
             "message": str(f.get("message", "")), "evidence": [str(x) for x in (f.get("evidence") or [])][:5],
             "advice": str(f.get("advice") or ""), "summary": str(f.get("summary") or "")}
            for f in nccl_log.findings(log)
        ]
        out["log_sentences"] = nccl_log.summary_sentences(out["log_findings"])
        out["warnings"] = [str(w.get("message", w)) if isinstance(w, dict) else str(w)
                           for w in (log.get("warnings") or [])][:20]
    if bench:
        interp = [bandwidth.judge(i, tree) for i in run.nccl_bandwidth]
        # The headline figure: all_reduce first (what data-parallel training uses), else the first test.
        rated = [i for i in interp if num(i.get("pct_of_expected")) is not None]
        rated.sort(key=lambda i: i.get("collective") != "all_reduce")
        if rated:
            best = rated[0]
            out["busbw_fraction"] = best["pct_of_expected"] / 100.0
            out["bandwidth_summary"] = (f"{best.get('collective') or 'collective'} bus bandwidth "
                                        f"{best['measured_busbw_gbps']:.1f} GB/s, {best.get('diagnosis')}")
        elif interp and interp[0].get("diagnosis"):
            out["bandwidth_note"] = (f"{interp[0].get('collective') or 'collective'} bus bandwidth: "
                                     f"{interp[0]['diagnosis']}")
    return out


def _transport_rows(t) -> list[dict]:
    rows = []
    if isinstance(t, dict) and isinstance(t.get("by_kind"), dict):
        # Connection counts per transport kind, plus GPUDirect RDMA and NICs.
        for kind, n in sorted(t["by_kind"].items(), key=lambda kv: -(num(kv[1]) or 0))[:20]:
            rows.append({"transport": str(kind), "detail": f"{n} connection(s)"})
        extra = []
        for key, label in (("gdrdma", "with GPUDirect RDMA"), ("no_gdrdma", "network connections without "
                                                                             "GPUDirect RDMA"), ("pxn", "via PXN")):
            if num(t.get(key)):
                extra.append(f"{int(t[key])} {label}")
        if extra:
            rows.append({"transport": "network detail", "detail": ", ".join(extra)})
        nics = t.get("nics") or t.get("network")
        if isinstance(nics, list) and nics:
            rows.append({"transport": "NICs", "detail": ", ".join(describe(x) if isinstance(x, dict) else str(x)
                                                                 for x in nics[:8])})
        return rows
    if isinstance(t, dict):
        for k, v in list(t.items())[:50]:
            rows.append({"transport": str(k), "detail": describe(v) if not isinstance(v, (int, float, str))
                         else str(v)})
    elif isinstance(t, list):
        for x in t[:50]:
            if isinstance(x, dict):
                name = x.get("transport") or x.get("kind") or x.get("type") or "?"
                detail = ", ".join(f"{k}={v}" for k, v in x.items()
                                   if k not in ("transport", "kind", "type") and isinstance(v, (str, int, float)))
                rows.append({"transport": str(name), "detail": detail})
            else:
                rows.append({"transport": str(x), "detail": ""})
    return rows
