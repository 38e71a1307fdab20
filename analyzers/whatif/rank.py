"""One rank's what-if: each traced step's critical path and its predicted duration under each change.

Device traces use the step's dependency graph (`graph.py`, replayed by `replay.py`).
CPU-only traces (gloo) have one timeline, the host's: there the step is the chain of its
exclusively attributed parts (data, host, memory, compute, exposed communication), and
communication that ran hidden beside other work stays hidden only while that work lasts:

    exposed' = max(0, comm_total * f_comm - sum over classes c of hidden_beside_c * f_c)

which gives back the measured exposed time when nothing changes.

The per-step results go into each step of the rank's analysis (`what_if_ms`, and
`critical_path`), so that the job (`job.py`) can combine ranks step by step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.whatif import graph as wg
from diag.analyzers.whatif import replay as wr

BASE = ""  # the replay with no change: predictions are differences from it
MAX_GRAPH_STEPS = 16  # steps replayed per trace (evenly spaced): the replay is per node
CHAIN_CLASSES = ("data", "host", "memory", "compute")
# What each analysed step carries (a run directory's rank copies them from its windows' steps).
STEP_KEYS = ("critical_path", "what_if_ms", "replayed_ms", "present_classes")


def rank_steps(changes, windows, trace=None, dev_classes=None, data_spans=None, att=None, layers=None,
               removals=None) -> dict:
    """{step index: {"critical_path": {...}, "what_if_ms": {change id: ms}}} for the steps analysed.

    Device traces need trace, dev_classes and data_spans; CPU traces att (the attribution)
    and layers (the class layers it was made from). `removals` ({measure: (part, µs removed,
    µs of the part or None where the step's graph knows it)} per window, trace.removals) gives the changes that remove a cause their
    scale step by step; a change whose measure is absent predicts nothing."""
    rank_changes = [c for c in changes if c.get("scope", "rank") == "rank"]
    if dev_classes is not None:
        return _graph_steps(rank_changes, windows, trace, dev_classes, data_spans, removals or {})
    return _chain_steps(rank_changes, windows, att, layers, removals or {})


def _scales(changes, k: int, removals: dict, skip=frozenset(), part_us: dict | None = None) -> dict:
    """Each change's {part: factor} in window k: as written, or so that its measure's time is
    gone; none for the changes in `skip`. A measure without its part's total (the host part of
    a device step, which only the step's graph knows) takes it from `part_us`."""
    out = {}
    for c in changes:
        if c["id"] in skip:
            continue
        if "remove" not in c:
            out[c["id"]] = c["scale"]
            continue
        m = removals.get(c["remove"])
        if m is None or (m[2] is not None and not m[2][k] > 0):
            continue
        part, removed, total = m
        whole = float(total[k]) if total is not None else float((part_us or {}).get(part) or 0.0)
        if whole > 0:
            out[c["id"]] = {part: max(0.0, 1.0 - float(removed[k]) / whole)}
    return out


def _graph_steps(changes, windows, trace, dev_classes, data_spans, removals) -> dict:
    pick = _pick(len(windows))
    graphs = wg.step_graphs(trace, dev_classes, data_spans, [windows[k] for k in pick])
    # A change that sets its own `steps` is replayed on that many of the picked steps (evenly spaced).
    on = {c["id"]: {pick[i] for i in _pick(len(pick), c["steps"])} for c in changes if c.get("steps")}
    out = {}
    for k, g in zip(pick, graphs):
        order = wr.topo_order(g)
        cp = wr.critical_path(g)
        info: dict = {}
        skip = frozenset(cid for cid, steps in on.items() if k not in steps)
        scales = _scales(changes, k, removals, skip, {"host": wr.host_us(g)})
        replayed = wr.replay(g, {BASE: {}, **scales}, order, info)
        out[k] = {
            "critical_path": {"length_ms": cp["length_us"] / 1e3, "nodes": cp["nodes"],
                              "by_class_ms": {c: v / 1e3 for c, v in cp["by_class_us"].items()},
                              # The device's own work of the step outlasting the step: the host ran
                              # ahead, and the window understates the steady iteration by this much.
                              "device_backlog_ms": info["backlog_us"] / 1e3},
            "what_if_ms": {c: v / 1e3 for c, v in replayed.items() if c != BASE},
            "replayed_ms": replayed[BASE] / 1e3,
            "present_classes": wr.present(g),
        }
    return out


def _chain_steps(changes, windows, att, layers, removals) -> dict:
    win = np.array([[w[1], w[2]] for w in windows], dtype=np.float64).reshape(-1, 2)
    comm = layers.get("comm", iv.EMPTY)
    comm_total = iv.measure_in_windows(comm, win)
    # Hidden communication, by the class of the work it hid behind.
    hidden = {c: iv.measure_in_windows(iv.intersect(comm, att["parts"].get(c, iv.EMPTY)), win)
              for c in CHAIN_CLASSES}
    out = {}
    for k in range(len(win)):
        parts = {c: float(att["us"][c][k]) for c in CHAIN_CLASSES}
        exposed = float(att["us"]["comm"][k])
        hid = {c: float(hidden[c][k]) for c in CHAIN_CLASSES}
        path = {**parts, "comm": exposed}
        out[k] = {
            "critical_path": {"length_ms": sum(path.values()) / 1e3, "nodes": None,
                              "by_class_ms": {c: v / 1e3 for c, v in path.items() if v}},
            "what_if_ms": {cid: _chain(parts, float(comm_total[k]), hid, scale) / 1e3
                           for cid, scale in _scales(changes, k, removals).items()},
            "replayed_ms": (sum(parts.values()) + exposed) / 1e3,
            "present_classes": sorted({c for c, v in parts.items() if v > 0} | ({"comm"} if comm_total[k] > 0 else set())),
        }
    return out


def _chain(parts: dict, comm_total: float, hidden: dict, scale: dict) -> float:
    f = {c: float(scale.get(c, 1.0)) for c in (*CHAIN_CLASSES, "comm")}
    cover = sum(hidden[c] * f[c] for c in CHAIN_CLASSES)
    return sum(parts[c] * f[c] for c in CHAIN_CLASSES) + max(0.0, comm_total * f["comm"] - cover)


def _pick(n: int, limit: int = MAX_GRAPH_STEPS) -> list[int]:
    if n <= limit:
        return list(range(n))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, limit)})


def summarize(steps: Sequence[Mapping[str, Any]], changes) -> tuple[dict | None, list[dict]]:
    """The rank's critical path (median step) and what-if entries from its analysed steps."""
    done = [s for s in steps if isinstance(s.get("what_if_ms"), dict) and isinstance(s.get("duration_ms"), (int, float))]
    if not done:
        return None, []
    base = float(np.median([s["duration_ms"] for s in done]))
    lengths = [s["critical_path"]["length_ms"] for s in done]
    classes = sorted({c for s in done for c in s["critical_path"]["by_class_ms"]})
    cp = {
        "steps": len(done),
        "measured_ms": base,
        "length_ms": float(np.median(lengths)),
        # Largest relative disagreement between a step's path and its measured duration.
        "max_error": float(max(abs(s["critical_path"]["length_ms"] - s["duration_ms"]) / s["duration_ms"]
                               for s in done if s["duration_ms"] > 0) if base > 0 else 0.0),
        "by_class_ms": {c: float(np.median([s["critical_path"]["by_class_ms"].get(c, 0.0) for s in done]))
                        for c in classes},
        "device_backlog_ms": float(np.median([s["critical_path"].get("device_backlog_ms") or 0.0 for s in done])),
    }
    present = set().union(*(set(s.get("present_classes") or ()) for s in done))
    entries = []
    for c in changes:
        if c.get("scope", "rank") != "rank":
            continue
        # What the change saves on the replayed step (the graph's own error cancels); a change
        # that speeds work up never slows the step down.
        saved = [max(0.0, s["replayed_ms"] - s["what_if_ms"][c["id"]]) for s in done if c["id"] in s["what_if_ms"]]
        entries.append(entry(c, base, base - float(np.median(saved)) if saved else None, present))
    return cp, entries


def entry(change: dict, base: float, predicted: float | None, present: set) -> dict:
    """One what-if entry; no prediction where none of the work the change acts on was traced."""
    acts_on = {p for p, f in change["scale"].items() if f != 1.0}
    out = {"change": change["id"], "description": change["description"], "baseline_step_ms": base,
           "predicted_step_ms": None, "speedup": None, "fixes": change.get("fixes")}
    if not (acts_on & present):
        out["note"] = f"no {' or '.join(sorted(acts_on))} time in the traced steps: no prediction"
        return out
    if predicted is not None and predicted > 0:
        out["predicted_step_ms"] = predicted
        out["speedup"] = base / predicted
    elif "remove" in change:
        out["note"] = f"no {change['remove'].replace('_', ' ')} in the traced steps: no prediction"
    return out
