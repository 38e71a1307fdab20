"""The report's plotly charts, as (div id, data, layout) from the report model: the phase
shares per step, the what-if gains, throughput, the rank-by-step heatmaps, the rank timelines
and the NCCL bus bandwidth.
"""

from __future__ import annotations

from diag.analyzers.analysis_types import json_safe
from diag.analyzers.diagnosis.inputs import CLASSES, PHASE_LABELS

COLORS = {"data": "#e4a11b", "host": "#9467bd", "comm": "#d62728", "wait": "#ff9896", "memory": "#1f77b4",
          "compute": "#2ca02c"}


def _layout(title: str, **kw) -> dict:
    base = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "margin": {"l": 60, "r": 20, "t": 40, "b": 45},
        "legend": {"orientation": "h", "y": -0.22},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "font": {"size": 11},
    }
    base.update(kw)
    return base


def _throttle_label(e: dict) -> str:
    ranks = e.get("ranks") or []
    who = ", ".join(str(r) for r in ranks[:6]) + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")
    return f"{e['reasons']} on rank{'s' if len(ranks) != 1 else ''} {who}"


def _step_axis(xs: list, title: str = "step") -> dict:
    """An x axis of step numbers: integer ticks, one per step when there are few."""
    axis: dict = {"title": {"text": title}, "tickformat": "d"}
    if xs and len(xs) <= 20:
        axis["dtick"] = 1
    return axis


def _phase_figures(model: dict, ch: dict) -> list[dict]:
    """Each step's phase shares, stacked."""
    out: list[dict] = []
    ph = ch.get("phases")
    if ph:
        out.append({
            "id": "fig-phases",
            "data": [{"type": "bar", "name": PHASE_LABELS[p], "x": ph["x"],
                      "y": [round(v * 100, 2) for v in ph["y"][p]], "marker": {"color": COLORS[p]},
                      "hovertemplate": "step %{x}: %{y:.1f}%<extra>" + p + "</extra>"}
                     for p in CLASSES],
            "layout": _layout("Where each step's time goes (% of step)", barmode="stack", bargap=0,
                              legend={"orientation": "h", "y": -0.22, "traceorder": "normal"},
                              xaxis=_step_axis(ph["x"]),
                              yaxis={"title": {"text": "% of step time"}, "range": [0, 100]}),
        })
    return out


def _what_if_figures(model: dict, ch: dict) -> list[dict]:
    """The predicted step time under each what-if change."""
    out: list[dict] = []
    wi = [e for e in (model.get("what_if") or {}).get("changes") or [] if e.get("predicted_step_ms") is not None]
    if wi:
        base = wi[0]["baseline_step_ms"]
        out.append({
            "id": "fig-whatif",
            "data": [{"type": "bar", "orientation": "h", "name": "predicted",
                      "y": ["measured"] + [e["change"] for e in wi],
                      "x": [round(base, 3)] + [round(e["predicted_step_ms"], 3) for e in wi],
                      "marker": {"color": ["#444"] + ["#1f77b4"] * len(wi)},
                      "hovertemplate": "%{y}: %{x:.1f} ms<extra></extra>"}],
            "layout": _layout("Predicted step time under each change (ms)",
                              xaxis={"title": {"text": "step time (ms)"}, "rangemode": "tozero"},
                              yaxis={"automargin": True, "autorange": "reversed"}),
        })
    return out


def _throughput_figures(model: dict, ch: dict) -> list[dict]:
    """Step time and throughput over the run, and MFU."""
    out: list[dict] = []
    tp = ch.get("throughput")
    if tp:
        data = [{"type": "scatter", "mode": "lines", "name": "step time (ms)", "x": tp["x"], "y": tp["step_ms"],
                 "line": {"color": "#444"}}]
        lay = _layout("Step time and throughput over the run", xaxis=_step_axis(tp["x"]),
                      yaxis={"title": {"text": "step time (ms)"}, "rangemode": "tozero"})
        rate = ("samples_per_s", "samples/s") if tp.get("samples_per_s") else \
            ("tokens_per_s", "tokens/s") if tp.get("tokens_per_s") else None
        if rate:
            data.append({"type": "scatter", "mode": "lines", "name": rate[1], "x": tp["x"], "y": tp[rate[0]],
                         "yaxis": "y2", "line": {"color": "#1f77b4"}})
            lay["yaxis2"] = {"title": {"text": rate[1]}, "overlaying": "y", "side": "right", "rangemode": "tozero"}
            lay["margin"]["r"] = 60
        out.append({"id": "fig-throughput", "data": data, "layout": lay})
        mx: list | None = None
        my: list = []
        if tp.get("mfu"):
            mx, my = tp["x"], tp["mfu"]
        elif tp.get("mfu_points"):
            mx, my = tp["mfu_points"]["x"], tp["mfu_points"]["y"]
        if mx:
            out.append({
                "id": "fig-mfu",
                "data": [{"type": "scatter", "mode": "lines+markers", "name": "MFU", "x": mx,
                          "y": [None if v is None else round(v * 100, 2) for v in my],
                          "line": {"color": "#2ca02c"}}],
                "layout": _layout("Model FLOPs utilisation over the run (% of peak)",
                                  xaxis=_step_axis(mx),
                                  yaxis={"title": {"text": "MFU (%)"}, "rangemode": "tozero"}),
            })
    return out


def _heatmap_figures(model: dict, ch: dict) -> list[dict]:
    """Step time and waiting at collectives per rank."""
    out: list[dict] = []
    for key, fid, title, xlab in (
        ("heatmap_step", "fig-heat-step", "Step time per rank (ms)", "step"),
        ("heatmap_wait", "fig-heat-wait", "Waiting time at collectives per rank (ms)", "collective (in order)"),
        ("heatmap_lateness", "fig-heat-late", "How late each rank was, step by step (ms behind the median rank)",
         "step"),
    ):
        hm = ch.get(key)
        if not hm:
            continue
        late = {s["rank"] for s in model.get("stragglers") or []}
        ylabels = [f"rank {r}" + (" (late)" if r in late else "") for r in hm["ranks"]]
        height = max(200, min(900, 22 * len(ylabels) + 120))
        out.append({
            "id": fid,
            "data": [{"type": "heatmap", "z": hm["z"], "x": hm["x"], "y": ylabels, "colorscale": "Viridis",
                      "colorbar": {"title": {"text": "ms"}}, "hoverongaps": False,
                      "hovertemplate": "%{y}, " + xlab + " %{x}: %{z:.2f} ms<extra></extra>"}],
            "layout": _layout(title, height=height, xaxis=_step_axis(hm["x"], xlab),
                              yaxis={"autorange": "reversed", "type": "category"},
                              margin={"l": 90, "r": 20, "t": 40, "b": 45}),
        })
    return out


def _timeline_figures(model: dict, ch: dict) -> list[dict]:
    """The device and host metrics over time, with throttle events on the clock chart."""
    out: list[dict] = []
    tl = ch.get("timelines")
    if tl:
        clock_key = "gpu_clock" if any(m["key"] == "gpu_clock" for m in tl["metrics"]) else None
        for m in tl["metrics"]:
            data = []
            if tl["band"]:
                data.append({"type": "scatter", "mode": "lines", "name": "max", "x": m["t"], "y": m["max"],
                             "line": {"width": 0}, "showlegend": False, "hoverinfo": "skip"})
                data.append({"type": "scatter", "mode": "lines", "name": "min-max across ranks", "x": m["t"],
                             "y": m["min"], "fill": "tonexty", "line": {"width": 0},
                             "fillcolor": "rgba(31,119,180,0.2)"})
                data.append({"type": "scatter", "mode": "lines", "name": "median", "x": m["t"], "y": m["median"],
                             "line": {"color": "#1f77b4"}})
            else:
                for line in m["lines"]:
                    data.append({"type": "scatter", "mode": "lines", "name": f"rank {line['rank']}",
                                 "x": line["t"], "y": line["y"]})
            if m["key"] == clock_key and tl.get("throttle"):
                ys = m["max"] if tl["band"] else [v for line in m["lines"] for v in line["y"]]
                top = max([v for v in ys if v is not None] or [1])
                data.append({"type": "scatter", "mode": "markers", "name": "throttle events",
                             "x": [e["t"] for e in tl["throttle"]], "y": [top * 1.02] * len(tl["throttle"]),
                             "marker": {"symbol": "triangle-down", "color": "#d62728", "size": 9},
                             "text": [_throttle_label(e) for e in tl["throttle"]],
                             "hovertemplate": "%{text} at %{x:.0f} s<extra></extra>"})
            out.append({
                "id": f"fig-tl-{m['key']}",
                "data": data,
                "layout": _layout(f"{m['label']} ({m['unit']})", height=230,
                                  xaxis={"title": {"text": "seconds since start"}},
                                  yaxis={"rangemode": "tozero"},
                                  margin={"l": 55, "r": 15, "t": 35, "b": 40},
                                  showlegend=not tl["band"] and len(m.get("lines") or []) > 1),
            })
    return out


def _busbw_figures(model: dict, ch: dict) -> list[dict]:
    """Bus bandwidth against message size, with the expected line."""
    out: list[dict] = []
    nb = ch.get("nccl_busbw")
    if nb:
        data = []
        for s in nb["series"]:
            data.append({"type": "scatter", "mode": "lines+markers", "name": s["name"],
                         "x": s["x"], "y": s["y"]})
        xs = [x for s in nb["series"] for x in s["x"]]
        for e in nb.get("expected") or []:
            data.append({"type": "scatter", "mode": "lines", "name": f"expected: {e['label']}",
                         "x": [min(xs), max(xs)], "y": [e["busbw_gbps"]] * 2,
                         "line": {"dash": "dash", "color": "#888"}})
        out.append({
            "id": "fig-busbw",
            "data": data,
            "layout": _layout("Bus bandwidth against message size", xaxis={"title": {"text": "message size (bytes)"},
                                                                         "type": "log"},
                              yaxis={"title": {"text": "bus bandwidth (GB/s)"}, "rangemode": "tozero"}),
        })
    return out


def figures(model: dict) -> list[dict]:
    """(div id, plotly data, layout) for every chart that has data; its strings as the model
    holds them (html.safe_figures makes them safe for plotly to draw)."""
    ch = model.get("charts") or {}
    out = []
    for part in (_phase_figures, _what_if_figures, _throughput_figures, _heatmap_figures, _timeline_figures, _busbw_figures):
        out.extend(part(model, ch))
    return [json_safe(f) for f in out]  # chart arrays: JSON has no NaN or infinity
