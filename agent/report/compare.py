"""compare.html and compare.md for `diag compare RUN_A RUN_B`."""

from __future__ import annotations

import os
from pathlib import Path

from diag import atomic_io
from diag.analyzers.analysis_types import json_safe
from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS
from diag.analyzers.numbers import percent
from diag.report.html import COLORS, _asset, esc, plot_safe, plotly_js, script_json
from diag.report.markdown import md_text

COMPARE_HTML = "compare.html"
COMPARE_MD = "compare.md"
COMPARE_JSON = "compare.json"

RESULT_CLASS = {"helped": "high", "hurt": "low", "fragile_win": "medium", "fragile_loss": "medium",
                "no_change": ""}
RESULT_LABEL = {"helped": "helped", "hurt": "hurt", "fragile_win": "fragile win", "fragile_loss": "fragile loss",
                "no_change": "no clear change"}


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _points(x) -> str:
    """A change of share in percentage points."""
    return "n/a" if x is None else f"{x * 100:+.1f} pts"


def figures(c: dict) -> list[dict]:
    figs = []
    if c.get("phases"):
        names = [f"before: {c['before']['name']}", f"after: {c['after']['name']}"]
        use_ms = all("before_ms" in r for r in c["phases"])
        figs.append({
            "id": "fig-compare-phases",
            "data": [{"type": "bar", "orientation": "h", "name": PHASE_LABELS[r["phase"]], "y": names,
                      "x": [r["before_ms"], r["after_ms"]] if use_ms else [r["before"] * 100, r["after"] * 100],
                      "marker": {"color": COLORS[r["phase"]]}} for r in c["phases"]],
            "layout": {"barmode": "stack", "height": 260, "margin": {"l": 160, "r": 20, "t": 40, "b": 60},
                       "title": {"text": "Median step, split by phase" + (" (ms)" if use_ms else " (%)"),
                                 "font": {"size": 14}},
                       "legend": {"orientation": "h", "y": -0.3}, "yaxis": {"autorange": "reversed"}},
        })
    return [plot_safe(f) for f in figs]


def render_html(c: dict) -> str:
    figs = figures(c)
    b, a = c["before"], c["after"]
    st = c.get("step_time")
    parts = []
    if st:
        parts.append(f"<section class=\"verdict\"><h2>Did the change help?</h2>"
                     f"<p><span class=\"badge {RESULT_CLASS[st['result']]}\">{esc(RESULT_LABEL[st['result']])}"
                     f"</span></p><div class=\"headline\">{esc(st['statement'])}</div>"
                     f"<p class=\"note\">Method: {esc(st['method'])}.</p></section>")
    else:
        parts.append("<section class=\"verdict\"><h2>Did the change help?</h2><p class=\"absent\">"
                     f"{esc(_why_not(c))}</p></section>")
    rows = [("run", b["name"], a["name"]), ("ranks", b["world_size"], a["world_size"]),
            ("verdict", b["bound"], a["bound"]), ("confidence", b["confidence"], a["confidence"]),
            ("steps compared", b["steps"], a["steps"]),
            ("median step (ms)", _ms(b["median_ms"]), _ms(a["median_ms"])),
            ("median absolute deviation (ms)", _ms(b["mad_ms"]), _ms(a["mad_ms"])),
            ("10th-90th percentile (ms)", f"{_ms(b['p10_ms'])}-{_ms(b['p90_ms'])}",
             f"{_ms(a['p10_ms'])}-{_ms(a['p90_ms'])}")]
    for key, label in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"), ("steps_per_s", "steps/s"),
                       ("mfu", "MFU")):
        t = (c.get("throughput") or {}).get(key)
        if t:
            fmt = (lambda v: "n/a" if v is None else f"{v * 100:.1f}%") if key == "mfu" else \
                (lambda v: "n/a" if v is None else f"{v:.2f}")
            rows.append((label, fmt(t["before"]), fmt(t["after"])))
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(x)}</td><td>{esc(y)}</td></tr>" for k, x, y in rows)
    parts.append(f"<section><h2>Before and after</h2><table><tr><th></th><th>before</th><th>after</th></tr>"
                 f"{table}</table><p>{esc(c['verdict_change']['text'])}</p></section>")
    if c.get("phases"):
        prow = "".join(
            f"<tr><td>{esc(PHASE_LABELS[r['phase']])}</td><td class=\"num\">{percent(r['before'], 1)}</td>"
            f"<td class=\"num\">{percent(r['after'], 1)}</td><td class=\"num\">{_points(r['delta'])}</td>"
            + (f"<td class=\"num\">{r['delta_ms']:+.1f}</td>" if "delta_ms" in r else "<td></td>") + "</tr>"
            for r in c["phases"])
        parts.append("<section><h2>Phase shares</h2><div id=\"fig-compare-phases\" class=\"chart small\" "
                     "data-chart=\"1\"></div><table><tr><th>phase</th><th class=\"num\">before</th>"
                     "<th class=\"num\">after</th><th class=\"num\">change</th><th class=\"num\">ms per median "
                     f"step</th></tr>{prow}</table></section>")
    else:
        parts.append("<section><h2>Phase shares</h2><p class=\"absent\">Phase shares are missing in at least one "
                     "run, so they cannot be compared.</p></section>")
    if c.get("prediction"):
        parts.append(f"<section><h2>Prediction check</h2><p>{esc(c['prediction']['text'])}</p></section>")
    sc = c.get("scaling")
    if sc:
        parts.append(f"<section><h2>Scaling efficiency</h2><p>{esc(sc['text'])}</p>"
                     + "".join(f"<p>{esc(f['message'])} {esc(f.get('advice', ''))}</p>" for f in sc["findings"])
                     + "</section>")
    elif b["world_size"] != a["world_size"]:
        parts.append("<section><h2>Scaling efficiency</h2><p class=\"absent\">World sizes differ, but neither "
                     "throughput nor step times allow a scaling figure.</p></section>")
    miss = list(c.get("missing") or [])
    for side, r in (("before", b), ("after", a)):
        miss += [f"{side}: {m}" for m in r["missing"]]
    if miss:
        parts.append("<section><h2>What was missing</h2><ul>" + "".join(f"<li>{esc(m)}</li>" for m in miss)
                     + "</ul></section>")
    title = f"diag compare: {b['name']} → {a['name']}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{esc(title)}</title>\n<style>\n{_asset('report.css')}</style>\n"
        f"<script>{plotly_js()}</script>\n</head>\n<body>\n<header><h1>{esc(title)}</h1>"
        f"<div class=\"meta\">before: {esc(b['path'])} · after: {esc(a['path'])}</div></header>\n<main>\n"
        + "\n".join(parts)
        + f"\n</main>\n<script type=\"application/json\" id=\"diag-data\">{script_json({'figures': figs})}</script>\n"
        f"<script>\n{_asset('report.js')}</script>\n</body>\n</html>\n"
    )


def _why_not(c: dict) -> str:
    """Why the comparison has no step-time change: the comparison's own reason."""
    return (c.get("missing") or ["Step times could not be compared."])[0]


def render_markdown(c: dict) -> str:
    b, a = c["before"], c["after"]
    out = [f"# diag compare: {md_text(b['name'])} → {md_text(a['name'])}", ""]
    st = c.get("step_time")
    out += [f"**{md_text(st['statement'] if st else _why_not(c))}**", ""]
    out += [md_text(c["verdict_change"]["text"]), ""]
    out += ["| | before | after |", "|---|---:|---:|",
            f"| ranks | {b['world_size']} | {a['world_size']} |",
            f"| verdict | {md_text(b['bound'])} | {md_text(a['bound'])} |",
            f"| median step (ms) | {_ms(b['median_ms'])} | {_ms(a['median_ms'])} |",
            f"| MAD (ms) | {_ms(b['mad_ms'])} | {_ms(a['mad_ms'])} |"]
    for key, label in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"), ("steps_per_s", "steps/s")):
        t = (c.get("throughput") or {}).get(key)
        if t and t["before"] is not None and t["after"] is not None:
            out.append(f"| {label} | {t['before']:.2f} | {t['after']:.2f} |")
    out.append("")
    if c.get("phases"):
        out += ["| phase | before | after | change |", "|---|---:|---:|---:|"]
        out += [f"| {PHASE_LABELS[r['phase']]} | {percent(r['before'], 1)} | {percent(r['after'], 1)} | "
                f"{_points(r['delta'])} |" for r in c["phases"]]
        out.append("")
    if c.get("scaling"):
        out += [md_text(c["scaling"]["text"]), ""]
    if c.get("prediction"):
        out += ["## Prediction check", "", md_text(c["prediction"]["text"]), ""]
    miss = list(c.get("missing") or [])
    for side, r in (("before", b), ("after", a)):
        miss += [f"{side}: {m}" for m in r["missing"]]
    if miss:
        out += ["## What was missing", ""] + [f"- {md_text(m)}" for m in miss] + [""]
    return "\n".join(out)


def write_compare(c: dict, out_dir) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"html": out / COMPARE_HTML, "markdown": out / COMPARE_MD, "json": out / COMPARE_JSON}
    atomic_io.atomic_write_text(paths["html"], render_html(c))
    atomic_io.atomic_write_text(paths["markdown"], render_markdown(c))
    atomic_io.atomic_write_json(paths["json"], json_safe(c))
    return {k: os.fspath(v) for k, v in paths.items()}


assert set(CLASSES) == set(COLORS)
