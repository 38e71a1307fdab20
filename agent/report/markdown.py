"""report.md: the report in Markdown, for pull requests, tickets and terminals.

Untrusted strings are put in code spans or escaped so that a kernel or host name can
neither break the table layout nor inject HTML when a forge renders the Markdown.
"""

from __future__ import annotations

from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS, size
from diag.analyzers.numbers import percent as pct


def md_text(value) -> str:
    """Plain text safe in Markdown prose and table cells: no HTML, links, code or cell breaks.

    Emphasis characters are left alone: they cannot inject anything, and escaping them
    would clutter the file for terminal readers. So is ">" inside the text ("Pageable ->
    Device"): only at the start of a line does it mean anything, a quote.
    """
    s = ("" if value is None else str(value)).replace("&", "&amp;").replace("<", "&lt;")
    s = s.replace("\\", "\\\\")
    for ch in ("`", "[", "]", "|"):
        s = s.replace(ch, "\\" + ch)
    s = " ".join(s.splitlines())
    return "\\" + s if s.lstrip().startswith(">") else s


def md_code(value) -> str:
    """An inline code span holding any text (names, log lines)."""
    s = ("" if value is None else str(value)).replace("\n", " ").replace("\r", " ").replace("|", "\\|")
    ticks = "`"
    while ticks in s:
        ticks += "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


OPS = {">=": "≥", "<=": "≤", ">": ">", "<": "<"}




def render(model: dict) -> str:
    """The Markdown report of a report model: its sections in reading order."""
    out: list[str] = []
    for section in (_head, _changes, _decision_path, _evidence_and_findings, _stragglers, _top_tables, _nccl):
        out += section(model)
    out += _what_if(model.get("what_if") or {})
    for section in (_memory, _missing):
        out += section(model)
    out.append("")
    return "\n".join(out)


def _head(model: dict) -> list[str]:
    """The title, the verdict with its confidence, the step-time split and the step figures."""
    run = model.get("run") or {}
    h = model.get("headline") or {}
    c = model.get("confidence") or {}
    out = [f"# diag report: {md_text(run.get('name') or 'run')}", ""]
    facts = [f"{run.get('world_size')} rank(s)"] if run.get("world_size") else []
    if run.get("devices"):
        facts.append(", ".join(run["devices"][:3]))
    if run.get("steps"):
        facts.append(f"{run['steps']} step(s)")
    if facts:
        out += [md_text(" · ".join(facts)), ""]
    out += [f"**{md_text(h.get('text'))}**", ""]
    if h.get("summary"):
        out += [md_text(h["summary"]), ""]
    if h.get("note"):
        out += [md_text(h["note"]), ""]
    out += [f"**Confidence: {md_text(c.get('level', 'n/a'))}** (score {c.get('score', 0):.2f} of 1)", ""]
    out += [f"- {md_text(r)}" for r in c.get("reasons") or []]
    out.append("")
    shares = model.get("phase_shares")
    if shares:
        if h.get("basis"):
            out += [f"Step time split over {md_text(h['basis'])}:", ""]
        out += ["| phase | share of step time |", "|---|---:|"]
        out += [f"| {PHASE_LABELS[p]} | {pct(shares[p], 1)} |" for p in CLASSES]
        out.append("")
    st = model.get("step_stats")
    thr = model.get("throughput") or {}
    if st:
        line = f"Median step {st['median_ms']:.1f} ms (MAD {st['mad_ms']:.1f} ms) over {st['steps']} steps"
        if st.get("device_median_ms") is not None:
            line += f"; device {st['device_median_ms']:.1f} ms"
        if thr.get("samples_per_s"):
            line += f"; {thr['samples_per_s']:.1f} samples/s"
        if thr.get("tokens_per_s"):
            line += f"; {thr['tokens_per_s']:.0f} tokens/s"
        if thr.get("mfu") is not None:
            line += f"; MFU {pct(thr['mfu'])}"
        out += [line + ".", ""]
    return out


def _changes(model: dict) -> list[str]:
    """The causes found, then what to change in order, with the minor ones as notes."""
    out = []
    causes = model.get("causes") or []
    if causes:
        out += ["## Causes found", ""]
        for c in causes:
            out += [f"- **{md_text(PHASE_LABELS.get(c['phase'], c['phase']))}**: {md_text(c['text'])}",
                    f"  Change: {md_text(c['action'])}", f"  Predicted: {md_text(c.get('gain'))}."]
        out.append("")
    recs = model.get("recommendations") or []
    out += ["## What to change, in order", ""]
    if not recs:
        out += ["No recommendation: nothing was measured to base one on.", ""]
    evlabels = {e["id"]: e["label"] for e in model.get("evidence") or []}
    minor = [r for r in recs if r.get("minor")]
    for r in recs:
        if r in minor:
            continue
        out.append(f"{r['rank']}. **{md_text(r['title'])}** — predicted gain: {md_text(r['gain'])}.")
        out.append(f"   Why: {md_text(r['why'])}")
        out += [f"   - {md_text(a)}" for a in r["actions"]]
        if r["evidence"]:
            out.append("   Evidence: " + "; ".join(md_text(evlabels.get(e, e)) for e in r["evidence"]))
    out.append("")
    if minor:
        out += [f"Notes, each predicted to win under {pct(minor[0]['minor_below'])} of the step:", ""]
        out += [f"- {md_text(r['title'])}: {md_text(r['gain'])}." for r in minor]
        out.append("")
    return out


def _decision_path(model: dict) -> list[str]:
    path = model.get("decision_path")
    if not (path and path.get("nodes")):
        return []
    out = ["## Decision path", "", f"Evaluated on {md_text(path['source'])}.", "",
           "| question | measured | threshold | answer |", "|---|---:|---:|---|"]
    for n in path["nodes"]:
        v, t = n["value"], n["threshold"]
        frac = n["metric"].endswith(("share", "frac", "_idle")) or n["metric"] == "mfu"
        vs = "not measured" if v is None else (pct(v, 1) if frac else f"{v:.3g}")
        ts = "" if t is None else (pct(t) if frac else f"{t:.3g}")
        op = OPS.get(n["op"], md_text(n["op"]))
        out.append(f"| {md_text(n['question'])} | {vs} | {op} {ts} | {md_text(n['answer'])} |")
    out.append("")
    return out


def _evidence_and_findings(model: dict) -> list[str]:
    out = []
    ev = model.get("evidence") or []
    if ev:
        out += ["## Evidence", ""]
        out += [f"- **{md_text(e['label'])}**: {md_text(e['text'])}" for e in ev if e.get("kind") != "finding"]
        out.append("")
    findings = model.get("findings") or []
    if findings:
        out += ["## Findings", ""]
        out += [f"- {md_text(f['severity'])} `{md_text(f['id'])}`: {md_text(f['message'])}"
                + (f" Advice: {md_text(f['advice'])}" if f.get("advice") else "") for f in findings]
        out.append("")
    return out


def _stragglers(model: dict) -> list[str]:
    out = []
    strag = model.get("stragglers") or []
    if strag:
        out += ["## Stragglers", ""]
        out += [f"- rank {s['rank']}: {md_text(s['evidence_text'])}" for s in strag]
        out.append("")
    episodes = (model.get("straggler_episodes") or {}).get("episodes") or []
    if episodes:
        out += ["## Straggler episodes", "", "| kind | rank | steps | straggled | job time lost (s) |",
                "|---|---|---|---:|---:|"]
        for e in episodes[:20]:
            who = e["rank"] if e["rank"] is not None else ", ".join(str(r) for r in e["ranks"][:8])
            out.append(f"| {md_text(e['kind'])} | {md_text(str(who))} | {e['first_step']}-{e['last_step']} | "
                       f"{e['straggled_steps']} | {e['cost_ms'] / 1000.0:.2f} |")
        out.append("")
    return out


def _top_tables(model: dict) -> list[str]:
    out = []
    for key, title in (("top_kernels", "Top kernels"), ("top_ops", "Top operators")):
        rows = model.get(key) or []
        if not rows:
            continue
        out += [f"## {title}", "", "| name | class | ms per rank | calls | % | FLOP/byte |", "|---|---|---:|---:|---:|---:|"]
        for r in rows[:10]:
            inten = "" if r.get("intensity") is None else f"{r['intensity']:.1f}"
            p = "" if r.get("pct") is None else f"{r['pct']:.1f}"
            out.append(f"| {md_code(r['name'][:120])} | {md_text(r['class'])} | {r['time_ms']:.2f} | "
                       f"{r['count']} | {p} | {inten} |")
        out.append("")
    return out


def _nccl(model: dict) -> list[str]:
    n = model.get("nccl") or {}
    if not (n.get("bandwidth_summary") or n.get("log_findings")):
        return []
    out = ["## Communication (NCCL)", ""]
    if n.get("bandwidth_summary"):
        out += [md_text(n["bandwidth_summary"]) + ".", ""]
    for f in n.get("log_findings") or []:
        out.append(f"- {md_text(f['severity'])} `{md_text(f['id'])}`: {md_text(f['message'])}")
    out.append("")
    return out


def _memory(model: dict) -> list[str]:
    mem = model.get("memory") or {}
    out = ["## Memory", "", md_text(mem.get("text") or "No memory figures."), ""]
    b = mem.get("breakdown")
    if b:
        out += ["| Per rank | Size |", "|---|---:|"]
        out += [f"| {label} | {size_cell(b.get(k))} |" for k, label in MEMORY_ROWS]
        out.append("")
    if mem.get("levers"):
        out += ["| Change | Frees (+) or costs (-) per GPU |", "|---|---:|"]
        out += [f"| {md_text(x['change'])} | {signed_size(x['bytes'])} |" for x in mem["levers"]]
        out.append("")
    if mem.get("advice"):
        out += [f"**{md_text(mem['advice']['title'])}.** " + " ".join(md_text(a) for a in mem["advice"]["actions"]),
                ""]
    return out


def _missing(model: dict) -> list[str]:
    """What was missing and how to get it, the damaged input, and how the report was reduced."""
    miss = model.get("missing") or []
    out = ["## What was missing", ""]
    if not miss:
        out += ["Nothing.", ""]
    for m in miss:
        out.append(f"- **{md_text(m['what'])}** {md_text(m['why'])} How to get it: {md_text(m['how'])}")
    probs = model.get("problems") or []
    if probs:
        out += ["", f"Damaged or unreadable input ({len(probs)}), skipped:", ""]
        out += [f"- {md_code(p)}" for p in probs[:20]]
    notes = model.get("notes") or []
    if notes:
        out += ["", "## How this report was reduced", ""]
        out += [f"- {md_text(x)}" for x in notes]
    return out


# The memory breakdown's rows (diag.analyzers.diagnosis.memory), shared with the HTML report.
MEMORY_ROWS = (("params_bytes", "Parameters"), ("grads_bytes", "Gradients"), ("optimizer_bytes", "Optimizer state"),
               ("buffers_bytes", "Buffers"), ("activations_and_other_bytes", "Activations and other (peak - states)"),
               ("peak_bytes", "Measured peak"))


def size_cell(b) -> str:
    return "not measured" if b is None else size(b)


def signed_size(b: float) -> str:
    return ("+" if b >= 0 else "-") + size(abs(b))


def _what_if(w: dict) -> list[str]:
    """The critical path per class and the predicted step time under each change."""
    cp, changes = w.get("critical_path"), w.get("changes") or []
    if not cp and not changes:
        return []
    out = ["## What if: predicted step times", ""]
    if cp and cp.get("by_class_ms"):
        parts = ", ".join(f"{md_text(c)} {v:.1f} ms" for c, v in sorted(cp["by_class_ms"].items(), key=lambda x: -x[1]))
        out += [f"Critical path of the median traced step (rank {cp.get('rank')}, the slowest-paced of "
                f"{cp.get('ranks')}): {parts}.", ""]
    out += ["| change | predicted step | measured step | speed-up |", "|---|---:|---:|---:|"]
    for e in changes:
        pred = e.get("predicted_step_ms")
        cell = f"{pred:.1f} ms" if pred is not None else md_text(e.get("note") or "no prediction")
        sp = f"{e['speedup']:.2f}x" if e.get("speedup") else "-"
        out.append(f"| {md_code(e['change'])}: {md_text(e['description'])} | {cell} | "
                   f"{e['baseline_step_ms']:.1f} ms | {sp} |")
    return out + ["", "Predictions replay each traced step's dependency graph with the change applied "
                      "(`diag compare BEFORE AFTER --applied CHANGE` checks one against a measured run).", ""]
