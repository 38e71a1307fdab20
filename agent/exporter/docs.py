"""The metrics reference (dashboards/METRICS.md), generated from the metric table.

    python -m diag.exporter.docs > dashboards/METRICS.md    (dashboards/generate.py does it too)
"""

from __future__ import annotations

from diag.exporter.metrics_table import IDENTITY_LABELS, MAX_DYNAMIC_VALUES, METRICS

_APPEARS = {
    "always": "always",
    "gpu": "with a GPU",
    "window": "after a profiler window",
    "nccl": "after `diag nccl`",
    "event": "on events only",
}

_SECTIONS = (
    ("Static details", lambda m: m.type == "info"),
    ("Training", lambda m: m.type != "info" and m.source in ("step", "window", "agent", "diagnosis")),
    ("Device", lambda m: m.type != "info" and m.source == "sample.gpu"),
    ("Host", lambda m: m.source == "sample.host"),
    ("Communication", lambda m: m.source.startswith("nccl")),
    ("The exporter itself", lambda m: m.type != "info" and m.source == "exporter"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    out = [
        "# diag metrics reference",
        "",
        "Generated from `agent/exporter/metrics_table.py` by `python dashboards/generate.py`; "
        "do not edit by hand.",
        "",
        "Every rank serves its own endpoint (port base + `LOCAL_RANK`, default base 9870). "
        f"Every series carries the identity labels {', '.join(f'`{x}`' for x in IDENTITY_LABELS)} "
        "(`gpu` is empty on a CPU-only rank). Units are base units: seconds, bytes, ratios 0-1, "
        "watts, joules, degrees Celsius, hertz. Label values that come from data (finding ids, "
        f"collectives, unknown clock event reasons) are capped at {MAX_DYNAMIC_VALUES} per metric; "
        "the rest is folded into `other`.",
        "",
        "*Appears* tells when a metric has samples: `always` from the first scrape of a training "
        "rank; `with a GPU` where NVML/amdsmi supports it; `after a profiler window` once a window "
        "was analysed; `after diag nccl` once bus bandwidth results were handed over; `on events "
        "only` when the event happens.",
        "",
    ]
    for title, pick in _SECTIONS:
        rows = [m for m in METRICS if pick(m)]
        if not rows:
            continue
        out += [f"## {title}", "", "| metric | type | labels | appears | source | description |",
                "|---|---|---|---|---|---|"]
        for m in rows:
            labels = ", ".join(
                f"`{label}`" + (f" ({' '.join(m.label_values)})" if m.label_values else "") for label in m.labels
            )
            out.append(f"| `{m.name}` | {m.type} | {labels or '-'} | {_APPEARS[m.appears]} | "
                       f"{m.source} | {_cell(m.help)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
