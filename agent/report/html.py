"""report.html: one self-contained page (plotly.js inlined) that opens offline from a file.

Untrusted strings (kernel and op names, hostnames, log lines, file names) reach the page
two ways, both escaped:
  * HTML text and attributes: through `esc` (html.escape with quotes);
  * chart data: in a <script type="application/json"> block written by `script_json`,
    which escapes '<', '>' and '&' as \\u003c \\u003e \\u0026, so no '</script>' or
    '<!--' can end or confuse the block; the page parses it with JSON.parse. Labels that
    plotly draws are additionally entity-escaped, every string of every figure at once
    (`plot_safe`), because plotly reads a few HTML-like tags in labels, ticks and hover
    text; entities make it draw them as plain characters.
"""

from __future__ import annotations

import html
import json
import math
from datetime import UTC, datetime
from functools import lru_cache
from importlib import resources

from diag import __version__
from diag.analyzers.analysis_types import json_safe
from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS
from diag.analyzers.numbers import percent as pct
from diag.diagnosis_document import diagnosis_json
from diag.report.charts import COLORS, figures
from diag.report.markdown import MEMORY_ROWS, signed_size, size_cell

OPS = {">=": "≥", "<=": "≤", ">": ">", "<": "<"}


def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def chart_text(value) -> str:
    return html.escape("" if value is None else str(value), quote=False)


def plot_safe(obj):
    """A figure with every string plotly may draw (names, labels, ticks, hover and axis
    text) entity-escaped, so markup in it stays text; the templates are ours and stay."""
    if isinstance(obj, str):
        return chart_text(obj)
    if isinstance(obj, dict):
        return {k: v if k.endswith("template") else plot_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plot_safe(v) for v in obj]
    return obj


def script_json(obj) -> str:
    """JSON safe to embed inside a <script> element (a non-finite number, which a damaged saved
    analysis can lead to, is written as null)."""
    text = json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False, default=_default)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(type(o).__name__)


@lru_cache(maxsize=1)
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _asset(name: str) -> str:
    return resources.files("diag.report").joinpath(name).read_text(encoding="utf-8")




def num(x, fmt: str = "{:.3g}") -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "n/a" if x is None or math.isnan(x) else "inf"
    return fmt.format(x)


# ---------------------------------------------------------------------------- page


def safe_figures(model: dict) -> list[dict]:
    """The charts, every string entity-escaped for plotly (plot_safe)."""
    return [plot_safe(f) for f in figures(model)]


def render(model: dict) -> str:
    figs = safe_figures(model)
    ids = {f["id"] for f in figs}
    body = "\n".join([
        _verdict(model),
        _recommendations(model),
        _decision(model),
        _phases(model, ids),
        _ranks(model, ids),
        _metrics(model, ids),
        _kernels(model),
        _nccl(model, ids),
        _what_if(model, ids),
        _memory(model),
        _missing(model),
        _notes(model),
        _glossary(),
    ])
    run = model.get("run") or {}
    title = f"diag report: {run.get('name') or 'run'}"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(title)}</title>\n<style>\n{_asset('report.css')}</style>\n"
        f"<script>{plotly_js()}</script>\n</head>\n<body>\n"
        f"<header><h1>{esc(title)}</h1><div class=\"meta\">{_meta_line(run)} &middot; "
        f"written by diag {esc(__version__)} on {esc(generated)}</div></header>\n"
        f"<main>\n{body}\n</main>\n"
        f"<script type=\"application/json\" id=\"diag-data\">{script_json({'figures': figs})}</script>\n"
        # The diagnosis the page shows, as `diag analyze --json` and summary.json hold it.
        f"<script type=\"application/json\" id=\"diag-diagnosis\">{script_json(diagnosis_json(model['diagnosis']))}</script>\n"
        f"<script>\n{_asset('report.js')}</script>\n</body>\n</html>\n"
    )


def _meta_line(run: dict) -> str:
    parts = []
    if run.get("world_size"):
        parts.append(f"{run['world_size']} rank(s)")
    if run.get("host_count"):
        hosts = ", ".join(run["hosts"][:4]) + (" ..." if run["host_count"] > 4 else "")
        parts.append(f"{run['host_count']} host(s): {hosts}")
    if run.get("devices"):
        parts.append(", ".join(run["devices"][:3]))
    if run.get("backend"):
        parts.append(f"backend {run['backend']}")
    if run.get("steps"):
        parts.append(f"{run['steps']} step(s)")
    if run.get("path"):
        parts.append(f"from {run['path']}")
    return esc(" · ".join(str(p) for p in parts))


def _section(sid: str, title: str, inner: str, cls: str = "") -> str:
    return f"<section id=\"{sid}\" class=\"{cls}\"><h2>{esc(title)}</h2>\n{inner}\n</section>"


def _absent(text: str) -> str:
    return f"<p class=\"absent\">{esc(text)}</p>"


def _chart(fid: str, ids: set, absent: str, small: bool = False) -> str:
    if fid in ids:
        return f"<div id=\"{fid}\" class=\"chart{' small' if small else ''}\" data-chart=\"1\"></div>"
    return _absent(absent)


def _verdict(model: dict) -> str:
    h = model.get("headline") or {}
    c = model.get("confidence") or {}
    bound = model.get("bound")
    recs = model.get("recommendations") or []
    inner = [f"<div class=\"headline\">{esc(h.get('text'))}</div>"]
    if h.get("summary"):
        inner.append(f"<p>{esc(h['summary'])}</p>")
    if h.get("note"):
        inner.append(f"<p class=\"note\">{esc(h['note'])}</p>")
    inner.append(f"<p><b>How sure we are:</b> <span class=\"badge {esc(c.get('level'))}\">"
                 f"{esc(c.get('level', 'n/a'))} confidence</span> "
                 f"<span class=\"note\">(score {num(c.get('score'), '{:.2f}')} of 1)</span></p>")
    if c.get("reasons"):
        inner.append("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in c["reasons"]) + "</ul>")
    causes = model.get("causes") or []
    if causes:
        inner.append("<div class=\"causes\"><b>Causes found:</b><ul>" + "".join(
            f"<li><span class=\"phase\">{esc(PHASE_LABELS.get(c['phase'], c['phase']))}</span> {esc(c['text'])}"
            f"<br><b>Change:</b> {esc(c['action'])}<br><span class=\"gain\">Predicted: {esc(c.get('gain'))}.</span></li>"
            for c in causes) + "</ul></div>")
    changes = [r for r in recs if not r.get("minor")]
    if changes:
        r = changes[0]
        inner.append(f"<div class=\"first\"><b>Change this first:</b> {esc(r['title'])}. "
                     f"<span class=\"gain\">{esc(r['gain'])}.</span> "
                     f"<a href=\"#rec-{esc(r['id'])}\">How, and why we think so</a></div>")
    shares = model.get("phase_shares")
    if shares:
        basis = h.get("basis")
        over = f" over {basis}" if basis else ""
        inner.append(f"<p class=\"note\">Step time split{esc(over)}: " + esc(", ".join(
            f"{PHASE_LABELS[p]} {pct(shares[p])}" for p in CLASSES)) + ".</p>")
    return _section("verdict", "What bounds the training", "\n".join(inner), f"verdict b-{esc(bound)}")


def _ev_links(ids: list, model: dict) -> str:
    labels = {e["id"]: e["label"] for e in model.get("evidence") or []}
    labels["memory"] = "Memory"
    links = [f"<a href=\"#{esc(i)}\">{esc(labels.get(i, i))}</a>" for i in ids]
    return f"<div class=\"evid\">Evidence: {''.join(links)}</div>" if links else ""


def _recommendations(model: dict) -> str:
    recs = model.get("recommendations") or []
    if not recs:
        return _section("recommendations", "What to change, in order",
                        _absent("No recommendation: there is no measurement to base one on (see 'What was missing')."))
    items, notes = [], []
    for r in recs:
        if r.get("minor"):
            notes.append(f"<li id=\"rec-{esc(r['id'])}\">{esc(r['title'])}: <span class=\"gain\">{esc(r['gain'])}."
                         "</span></li>")
            continue
        acts = "".join(f"<li>{esc(a)}</li>" for a in r["actions"])
        items.append(
            f"<li id=\"rec-{esc(r['id'])}\"><b>{esc(r['title'])}</b><br>"
            f"<span class=\"gain\">Predicted gain: {esc(r['gain'])}.</span><br>"
            f"<span class=\"note\">Why: {esc(r['why'])}</span><ul>{acts}</ul>{_ev_links(r['evidence'], model)}</li>"
        )
    note = ("<p class=\"note\">Ranked by predicted gain: each traced step's dependency graph replayed with the "
            "work a fix acts on changed (see 'What if'), beside the measured step. A phase's share of the step "
            "is only the upper bound of what removing it could win.</p>")
    body = note + (f"<ol class=\"recs\">{''.join(items)}</ol>" if items else "")
    if notes:
        below = next(r["minor_below"] for r in recs if r.get("minor"))
        body += (f"<p class=\"note\">Notes, each predicted to win under {pct(below)} of the step:</p>"
                 f"<ul class=\"recs-minor\">{''.join(notes)}</ul>")
    return _section("recommendations", "What to change, in order", body)


def _decision(model: dict) -> str:
    path = model.get("decision_path")
    inner = []
    if path and path.get("nodes"):
        inner.append(f"<p>The verdict follows the decision tree below, evaluated on {esc(path['source'])}. "
                     "Each row is one question: the measured value, the threshold, and the answer.</p>")
        rows = []
        for n in path["nodes"]:
            v = n["value"]
            shown = "not measured" if v is None else (pct(v, 1) if n["metric"].endswith(("share", "frac", "_idle"))
                                                        or n["metric"] == "mfu" else num(v))
            t = n["threshold"]
            tshown = "" if t is None else (pct(t, 0) if n["metric"].endswith(("share", "frac", "_idle"))
                                            else num(t))
            op = OPS.get(n["op"], n["op"])
            rows.append(f"<tr><td>{esc(n['question'])}</td><td class=\"name\">{esc(n['metric'])}</td>"
                        f"<td class=\"num\">{esc(shown)}</td><td class=\"num\">{esc(op)} {esc(tshown)}</td>"
                        f"<td class=\"{esc(n['answer'])}\">{esc(n['answer'])}</td></tr>")
        inner.append("<table><tr><th>question</th><th>measurement</th><th class=\"num\">measured</th>"
                     "<th class=\"num\">threshold</th><th>answer</th></tr>" + "".join(rows) + "</table>")
        inner.append(f"<p>Verdict: <b>{esc(path.get('bound'))}-bound</b>. Thresholds can be changed with "
                     "<code>diag analyze --threshold NAME=VALUE</code> or a config file.</p>")
    else:
        inner.append(_absent("No decision path: no step was analysed."))
    ev = model.get("evidence") or []
    if ev:
        inner.append("<h3>Evidence</h3><ul>")
        for e in ev:
            if e.get("kind") == "finding":
                continue
            lines = "".join(f"<pre>{esc(x)}</pre>" for x in e.get("lines") or [])
            inner.append(f"<li id=\"{esc(e['id'])}\"><b>{esc(e['label'])}:</b> {esc(e['text'])}{lines}</li>")
        inner.append("</ul>")
    findings = model.get("findings") or []
    if findings:
        inner.append("<h3>Findings</h3><table><tr><th>severity</th><th>finding</th><th>ranks</th>"
                     "<th>advice</th></tr>")
        for i, f in enumerate(findings):
            ranks = ", ".join(str(r) for r in f["ranks"][:12]) + (" ..." if len(f["ranks"]) > 12 else "")
            inner.append(f"<tr id=\"ev-finding-{i}\"><td><span class=\"badge {esc(f['severity'])}\">{esc(f['severity'])}</span></td>"
                         f"<td>{esc(f['message'])}</td><td>{esc(ranks or 'job')}</td><td>{esc(f['advice'])}</td></tr>")
        inner.append("</table>")
    return _section("why", "Why we think so", "\n".join(inner))


def _phases(model: dict, ids: set) -> str:
    tp = (model.get("charts") or {}).get("throughput") or {}
    st = model.get("step_stats")
    thr = model.get("throughput") or {}
    inner = []
    if st:
        line = (f"Median step time {st['median_ms']:.1f} ms (median absolute deviation {st['mad_ms']:.1f} ms; "
                f"10th-90th percentile {st['p10_ms']:.1f}-{st['p90_ms']:.1f} ms) over {st['steps']} steps")
        if st.get("device_median_ms") is not None:
            line += f"; median device step time {st['device_median_ms']:.1f} ms over {st['device_steps']} steps"
        if thr.get("samples_per_s"):
            line += f"; {thr['samples_per_s']:.1f} samples/s for the whole job"
        if thr.get("tokens_per_s"):
            line += f"; {thr['tokens_per_s']:.0f} tokens/s"
        if thr.get("mfu") is not None:
            line += f"; MFU {pct(thr['mfu'])}"
        inner.append(f"<p>{esc(line)}.</p>")
    inner.append(_chart("fig-phases", ids, "No phase shares: no step was attributed to phases."))
    inner.append(_chart("fig-throughput", ids, "No step times were recorded."))
    if tp and not tp.get("samples_per_s") and not tp.get("tokens_per_s"):
        inner.append(_absent("Throughput is shown as step time only: pass agent.step(samples=..., tokens=...) "
                             "to see samples or tokens per second."))
    inner.append(_chart("fig-mfu", ids, "MFU over time is not available: it needs FLOPs per step "
                                        "(profiler with_flops) and the device's peak."))
    return _section("phases", "Where the time goes", "\n".join(inner))


def _ranks(model: dict, ids: set) -> str:
    inner = [_chart("fig-heat-step", ids, "No per-rank step times were recorded.")]
    if "fig-heat-step" in ids:
        inner.append("<p class=\"note\">Each row is a rank, each column a step (or a bucket of steps). A row "
                     "brighter than the others is a rank whose steps take longer.</p>")
    inner.append(_chart("fig-heat-wait", ids, "No collective waiting times: they need profiler traces from at "
                                              "least two ranks with matching collectives."))
    if "fig-heat-wait" in ids:
        inner.append("<p class=\"note\">Waiting time is how much longer a rank spent in a collective than the "
                     "fastest rank did, usually because it arrived first and waited for the others. A rank that "
                     "waits much less than everyone else (a dark row) is the one they wait for: a straggler.</p>")
    inner.append(_chart("fig-heat-late", ids, "No lateness over time: it needs the steps of at least two ranks."))
    episodes = (model.get("straggler_episodes") or {}).get("episodes") or []
    if "fig-heat-late" in ids:
        inner.append("<p class=\"note\">Each row is a rank, each column a step (or a bucket of steps): how much later "
                     "than the median rank it was ready for the step's collectives (its data wait, or its pace where "
                     "a window traced the step). One bright row is a persistent straggler; brightness moving between "
                     "rows, a rotating one; a bright patch, a transient one.</p>")
    if episodes:
        inner.append("<h3>Straggler episodes</h3><table><tr><th>kind</th><th>rank</th><th class=\"num\">steps</th>"
                     "<th class=\"num\">straggled</th><th class=\"num\">job time lost (s)</th>"
                     "<th class=\"num\">share</th></tr>" + "".join(
                         f"<tr><td>{esc(e['kind'])}</td><td>{esc(e['rank'] if e['rank'] is not None else ', '.join(str(r) for r in e['ranks'][:8]))}</td>"
                         f"<td class=\"num\">{esc(e['first_step'])}-{esc(e['last_step'])}</td>"
                         f"<td class=\"num\">{esc(e['straggled_steps'])}</td>"
                         f"<td class=\"num\">{num(e['cost_ms'] / 1000.0, '{:.2f}')}</td>"
                         f"<td class=\"num\">{pct(e.get('share_of_job_time'))}</td></tr>" for e in episodes[:20])
                     + "</table>")
    strag = model.get("stragglers") or []
    if strag:
        inner.append("<h3>Stragglers</h3><ul>" + "".join(
            f"<li><b>rank {esc(s['rank'])}</b>: {esc(s['evidence_text'])} "
            f"<a href=\"#ev-straggler-{esc(s['rank'])}\">evidence</a></li>" for s in strag) + "</ul>")
    elif len(model.get("ranks") or []) > 1 and not episodes:
        inner.append("<p>No straggler was named: no rank is consistently late for the others.</p>")
    rows = model.get("ranks") or []
    if rows:
        t = ["<h3>Per rank</h3><table><tr><th>rank</th><th>host</th><th>device</th><th>verdict</th>"
             "<th class=\"num\">steps</th><th class=\"num\">median step (ms)</th>"
             + "".join(f"<th class=\"num\">{esc(p)}</th>" for p in CLASSES)
             + "<th class=\"num\">traced steps</th><th class=\"num\">samples</th></tr>"]
        for r in rows:
            sh = r.get("shares") or {}
            t.append(
                f"<tr class=\"{'late' if r['straggler'] else ''}\"><td>{esc(r['rank'])}"
                f"{' (late)' if r['straggler'] else ''}</td><td class=\"name\">{esc(r['host'] or '')}</td>"
                f"<td>{esc(r['device'] or '')}</td><td>{esc(r['bound'] or 'n/a')}"
                + (f" (waits for rank {esc(r['bound_via'])})" if r.get("bound_via") is not None else "") + "</td>"
                f"<td class=\"num\">{r['steps']}</td><td class=\"num\">{num(r['median_step_ms'], '{:.1f}')}</td>"
                + "".join(f"<td class=\"num\">{pct(sh.get(p))}</td>" for p in CLASSES)
                + f"<td class=\"num\">{r['trace_steps']}</td><td class=\"num\">{r['samples']}</td></tr>"
            )
        t.append("</table>")
        inner.append("".join(t))
    missing = (model.get("run") or {}).get("missing_ranks") or []
    if missing:
        inner.append(f"<p class=\"absent\">Missing rank(s): {esc(', '.join(str(m) for m in missing[:32]))}.</p>")
    return _section("ranks", "Ranks and stragglers", "\n".join(inner))


def _metrics(model: dict, ids: set) -> str:
    tl = (model.get("charts") or {}).get("timelines")
    if not tl:
        return _section("metrics", "Device and host metrics",
                        _absent("No metric samples were recorded (see 'What was missing')."))
    charts = "".join(f"<div id=\"fig-tl-{esc(m['key'])}\" class=\"chart small\" data-chart=\"1\"></div>"
                     for m in tl["metrics"] if f"fig-tl-{m['key']}" in ids)
    inner = [f"<div class=\"grid2\">{charts}</div>"]
    if not any(m["key"].startswith("gpu_") for m in tl["metrics"]):
        inner.append(_absent("No device metrics (no NVML or amdsmi): only host metrics are shown."))
    n = tl.get("throttle_total") or 0
    if n:
        inner.append(f"<p>{n} throttle event(s) (clock reasons other than idle) are marked with red triangles "
                     "on the SM clock chart. Throttling lowers clocks and slows every kernel.</p>")
    elif any(m["key"] == "gpu_clock" for m in tl["metrics"]):
        inner.append("<p>No clock throttling was reported.</p>")
    return _section("metrics", "Device and host metrics", "\n".join(inner))


def _table(rows: list, with_intensity: bool) -> str:
    head = ("<table><tr><th>name</th><th>class</th><th class=\"num\">time per rank (ms)</th>"
            "<th class=\"num\">calls</th><th class=\"num\">% of device time</th>"
            + ("<th class=\"num\">FLOP/byte</th>" if with_intensity else "") + "</tr>")
    body = []
    for r in rows:
        body.append(
            f"<tr><td class=\"name\">{esc(r['name'])}</td><td>{esc(r['class'])}</td>"
            f"<td class=\"num\">{num(r['time_ms'], '{:.2f}')}</td><td class=\"num\">{r['count']}</td>"
            f"<td class=\"num\">{num(r['pct'], '{:.1f}')}</td>"
            + (f"<td class=\"num\">{num(r['intensity'], '{:.1f}')}</td>" if with_intensity else "") + "</tr>"
        )
    return head + "".join(body) + "</table>"


def _kernels(model: dict) -> str:
    k, o = model.get("top_kernels") or [], model.get("top_ops") or []
    inner = []
    if k:
        inner.append("<h3>Top device kernels</h3>" + _table(k, True))
    elif o:
        inner.append("<h3>Top device kernels</h3>" + _absent(
            "The traces hold no device kernels (a CPU-only run): the operator table below shows where the "
            "time went."))
    else:
        inner.append("<h3>Top device kernels</h3>" + _absent(
            "No kernel table: it comes from profiler traces (see 'What was missing')."))
    inner.append("<h3>Top operators</h3>" + (_table(o, False) if o else _absent(
        "No operator table: it comes from profiler traces.")))
    inner.append("<p class=\"note\">Class: compute-bound kernels (matmul, convolution, attention) against "
                 "bandwidth-bound ones (elementwise, reductions, norms, copies) and communication. FLOP/byte is "
                 "the arithmetic intensity where the trace recorded shapes and FLOPs; below the device's "
                 "roofline knee a kernel is limited by memory bandwidth.</p>")
    return _section("kernels", "Top kernels and operators", "\n".join(inner))


def _nccl(model: dict, ids: set) -> str:
    n = model.get("nccl") or {}
    inner = []
    if n.get("bandwidth_summary"):
        inner.append(f"<p><b>{esc(n['bandwidth_summary'])}.</b></p>")
    inner.append(_chart("fig-busbw", ids, "No bus-bandwidth measurement: run `diag nccl --run-dir RUN_DIR` "
                                          "on the job's nodes to add one."))
    if n.get("version") or n.get("transports"):
        inner.append(f"<h3>Topology and transports</h3><p>NCCL {esc(n.get('version') or 'version unknown')}"
                     + (f" on {len(n.get('hosts') or [])} host(s): {esc(', '.join(n['hosts'][:8]))}"
                        if n.get("hosts") else "") + ".</p>")
        if n.get("transports"):
            inner.append("<table><tr><th>transport</th><th>detail</th></tr>" + "".join(
                f"<tr><td>{esc(t['transport'])}</td><td class=\"name\">{esc(t['detail'])}</td></tr>"
                for t in n["transports"]) + "</table>")
    else:
        run = model.get("run") or {}
        if run.get("nccl_applicable") is False:
            what = f"the {run['backend']} backend" if run.get("backend") else "a PyTorch build without CUDA or ROCm"
            inner.append(f"<p>This job used {esc(what)}, so there is no NCCL log and no NCCL transport to check.</p>")
        else:
            inner.append(_absent("No NCCL log was parsed, so transports and topology are unknown "
                                 "(see 'What was missing')."))
    if n.get("log_findings"):
        inner.append("<h3>NCCL findings</h3><ul>")
        for f in n["log_findings"]:
            lines = "".join(f"<pre>{esc(x)}</pre>" for x in f["evidence"])
            inner.append(f"<li><span class=\"badge {esc(f['severity'])}\">{esc(f['severity'])}</span> "
                         f"<b>{esc(f['id'])}</b>: {esc(f['message'])}{lines}</li>")
        inner.append("</ul>")
    if n.get("warnings"):
        inner.append("<h3>NCCL warnings</h3>" + "".join(f"<pre>{esc(w)}</pre>" for w in n["warnings"]))
    return _section("nccl", "Communication (NCCL)", "\n".join(inner))


def _what_if(model: dict, ids: set) -> str:
    w = model.get("what_if") or {}
    cp, changes = w.get("critical_path"), w.get("changes") or []
    if not cp and not changes:
        return ""
    inner = []
    if cp and cp.get("by_class_ms"):
        parts = ", ".join(f"{c} {v:.1f} ms" for c, v in sorted(cp["by_class_ms"].items(), key=lambda x: -x[1]))
        inner.append(f"<p>Critical path of the median traced step (rank {esc(cp.get('rank'))}, the slowest-paced "
                     f"of {esc(cp.get('ranks'))}): {esc(parts)}.</p>")
    if "fig-whatif" in ids:
        inner.append(_chart("fig-whatif", ids, "", small=True))
    rows = "".join(
        f"<tr><td><code>{esc(e['change'])}</code>: {esc(e['description'])}</td>"
        f"<td class=\"num\">{esc(num(e.get('predicted_step_ms'), '{:.1f} ms') if e.get('predicted_step_ms') is not None else e.get('note') or 'no prediction')}</td>"
        f"<td class=\"num\">{esc(num(e.get('baseline_step_ms'), '{:.1f} ms'))}</td>"
        f"<td class=\"num\">{esc(num(e.get('speedup'), '{:.2f}x'))}</td></tr>" for e in changes)
    inner.append(f"<table class=\"what-if\"><tr><th>Change</th><th class=\"num\">Predicted step</th>"
                 f"<th class=\"num\">Measured step</th><th class=\"num\">Speed-up</th></tr>{rows}</table>")
    inner.append("<p class=\"note\">Each traced step's dependency graph replayed with the change applied. "
                 "<code>diag compare BEFORE AFTER --applied CHANGE</code> puts a prediction beside the measured "
                 "run.</p>")
    return _section("what-if", "What if: predicted step times", "\n".join(inner))


def _memory(model: dict) -> str:
    m = model.get("memory") or {}
    inner = [f"<p>{esc(m.get('text') or 'No memory figures.')}</p>"]
    b = m.get("breakdown")
    if b:
        rows = "".join(f"<tr><td>{esc(label)}</td><td class=\"num\">{esc(size_cell(b.get(k)))}</td></tr>"
                       for k, label in MEMORY_ROWS)
        inner.append(f"<table class=\"memory-breakdown\"><tr><th>Per rank</th><th class=\"num\">Size</th></tr>{rows}</table>")
    if m.get("levers"):
        rows = "".join(f"<tr><td>{esc(x['change'])}</td><td class=\"num\">{signed_size(x['bytes'])}</td></tr>"
                       for x in m["levers"])
        inner.append(f"<table class=\"memory-levers\"><tr><th>Change</th><th>Frees (+) or costs (-) per GPU</th>"
                     f"</tr>{rows}</table>")
    a = m.get("advice")
    if a:
        inner.append(f"<p><b>{esc(a['title'])}.</b> {esc(a['why'])}</p><ul>"
                     + "".join(f"<li>{esc(x)}</li>" for x in a["actions"]) + "</ul>")
    elif m.get("note"):
        inner.append(f"<p>{esc(m['note'])}</p>")
    return _section("memory", "Memory", "\n".join(inner))


def _missing(model: dict) -> str:
    miss = model.get("missing") or []
    probs = model.get("problems") or []
    inner = []
    if miss:
        inner.append("<table><tr><th>what was missing</th><th>why it matters</th><th>how to get it</th></tr>"
                     + "".join(f"<tr><td>{esc(m['what'])}</td><td>{esc(m['why'])}</td><td>{esc(m['how'])}</td></tr>"
                               for m in miss) + "</table>")
    else:
        inner.append("<p>Nothing: every kind of data this report uses was present.</p>")
    if probs:
        inner.append(f"<h3>Damaged or unreadable input ({len(probs)})</h3><p>These were skipped; the rest of the "
                     "run was reported.</p>" + "".join(f"<pre>{esc(p)}</pre>" for p in probs[:50]))
        if len(probs) > 50:
            inner.append(f"<p class=\"note\">... and {len(probs) - 50} more.</p>")
    return _section("missing", "What was missing, and how to get it", "\n".join(inner))


def _notes(model: dict) -> str:
    notes = model.get("notes") or []
    if not notes:
        return ""
    return _section("notes", "How this page was reduced",
                    "<p>This run is large, so some charts show aggregates instead of every point:</p><ul>"
                    + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")


def _glossary() -> str:
    rows = "".join(f"<tr><td style=\"color:{COLORS[p]}\"><b>{esc(p)}</b></td><td>{esc(d)}</td></tr>" for p, d in (
        ("data", "Waiting for the DataLoader to hand over the next batch."),
        ("host", "The device is idle while the host launches kernels, synchronises (.item(), "
                 "synchronize) or runs Python."),
        ("comm", "Communication (all-reduce, all-gather, ...) not hidden behind computation: the transfer itself."),
        ("wait", "Waiting inside a collective for the last rank to arrive: the time a faster rank loses to a "
                 "slower one. Measured only when the traces of several ranks are analysed together."),
        ("memory", "Bandwidth-bound kernels: elementwise ops, reductions, norms, copies."),
        ("compute", "Compute-bound kernels: matrix multiplies, convolutions, attention."),
    ))
    return _section("glossary", "The six phases", "<p>Every moment of a step is counted in exactly one phase, "
                    "by priority in the order below, so the shares add up to 100%.</p>"
                    f"<table>{rows}</table>")
