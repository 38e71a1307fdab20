"""Prometheus registration derived from the metric table.

`MetricState` holds one rank's values in plain dicts; writers (the agent's step path, the
sampling thread) update it under one lock held for a few dictionary operations, and a
scrape copies it under the same lock and formats outside it. `TableCollector` turns one
or more states into prometheus_client metric families, in table order, on a private
`CollectorRegistry` (never the process-global default registry, which belongs to the
user's own code).
"""

from __future__ import annotations

import bisect
import math
import platform
import sys
import threading
import time

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from diag import __version__
from diag.exporter.metrics_table import (
    BY_NAME,
    IDENTITY_LABELS,
    MAX_DYNAMIC_VALUES,
    METRICS,
    Metric,
)

OTHER = "other"
COLLECT_DURATION = "diag_exporter_collect_duration_seconds"


def identity_values(identity: dict) -> tuple[str, ...]:
    """The identity labels as strings; a missing value is '' (Prometheus: label absent)."""
    out = []
    for key in IDENTITY_LABELS:
        v = identity.get(key) if isinstance(identity, dict) else None
        out.append("" if v is None else str(v))
    return tuple(out)


class MetricState:
    """One rank's metric values. All methods are cheap; callers hold `lock` while writing."""

    def __init__(self, identity: dict, start_time: float | None = None):
        self.identity = identity_values(identity)
        self.lock = threading.Lock()
        # name -> {label value tuple: value}
        self.values: dict[str, dict[tuple[str, ...], float]] = {}
        # name -> [bucket counts (non-cumulative, one per bound + +Inf), sum, count]
        self.histograms: dict[str, list] = {}
        for m in METRICS:
            if m.type == "histogram":
                self.histograms[m.name] = [[0] * (len(m.buckets) + 1), 0.0, 0]
            elif m.type == "counter" and m.appears == "always" and m.source in ("step", "agent", "exporter"):
                # Counted here, so known from the first scrape: 0, with fixed label sets in full.
                # (Counters copied from cumulative sampled values start at their first sample.)
                keys = [(v,) for v in m.label_values] if m.labels else [()]
                self.values[m.name] = dict.fromkeys(keys, 0.0)
        self.values["diag_build_info"] = {_build_labels(): 1.0}
        self.values["diag_last_step_timestamp_seconds"] = {(): start_time or time.time()}
        self.values["diag_profiler_window_active"] = {(): 0.0}
        self.collect_duration = 0.0

    # --- writers (caller holds self.lock) ---
    def inc(self, name: str, amount: float, labels: tuple[str, ...] = ()) -> None:
        series = self.values.get(name)
        if series is not None and labels in series:  # the common case: an existing series
            series[labels] += amount
            return
        series = self.values.setdefault(name, {})
        labels = self._cap(name, series, labels)
        series[labels] = series.get(labels, 0.0) + amount

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        series = self.values.setdefault(name, {})
        series[self._cap(name, series, labels)] = value

    def replace(self, name: str, series: dict[tuple[str, ...], float]) -> None:
        """Replace all series of a metric (e.g. the findings of the latest document)."""
        capped: dict[tuple[str, ...], float] = {}
        for labels, value in series.items():
            key = self._cap(name, capped, labels)
            capped[key] = capped.get(key, 0.0) + value
        self.values[name] = capped

    def observe(self, name: str, value: float) -> None:
        m = BY_NAME[name]
        h = self.histograms[name]
        h[0][bisect.bisect_left(m.buckets, value)] += 1
        h[1] += value
        h[2] += 1

    @staticmethod
    def _cap(name: str, series: dict, labels: tuple[str, ...]) -> tuple[str, ...]:
        if not labels or labels in series:
            return labels
        fixed = BY_NAME[name].label_values
        if fixed and labels[0] in fixed:
            return labels
        dynamic = sum(1 for k in series if not fixed or k[0] not in fixed)
        return labels if dynamic < MAX_DYNAMIC_VALUES else (OTHER,) * len(labels)

    # --- reader ---
    def snapshot(self) -> tuple[dict, dict]:
        with self.lock:
            values = {k: dict(v) for k, v in self.values.items()}
            hists = {k: (list(h[0]), h[1], h[2]) for k, h in self.histograms.items()}
        return values, hists


def _build_labels() -> tuple[str, ...]:
    torch = sys.modules.get("torch")
    torch_version = str(getattr(torch, "__version__", "")) if torch is not None else ""
    return (__version__, platform.python_version(), torch_version)


def _fmt_le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _snapshots(states) -> list[tuple[MetricState, dict, dict]]:
    snaps = []
    for state in states:
        try:
            snaps.append((state, *state.snapshot()))
        except Exception:  # a damaged state costs its own series, not the scrape
            with state.lock:
                state.inc("diag_exporter_errors_total", 1.0, ("collect",))
    return snaps


def _histogram_buckets(m: Metric, counts: list[int]) -> list[tuple[str, int]]:
    cum, out = 0, []
    for bound, c in zip((*m.buckets, math.inf), counts):
        cum += c
        out.append((_fmt_le(bound), cum))
    return out


def _collected(states, elapsed: float) -> None:
    for state in states:
        with state.lock:
            state.collect_duration = elapsed
            state.inc("diag_exporter_scrapes_total", 1.0)


class TableCollector:
    """A prometheus_client collector over the table for one or more ranks' states.

    Several states in one collector (as `diag export` serves a whole run directory from
    one endpoint) give one metric family per name with the ranks told apart by the
    identity labels, which is what Prometheus expects. It lets the metrics join any
    prometheus_client registry (`handle.registry`, or a user's own); the rank endpoint
    itself serves `render_text`, which gives the same samples faster.
    """

    def __init__(self, states):
        self._states = states if callable(states) else (lambda: states)

    def describe(self):
        for m in METRICS:
            yield self._family(m)

    def collect(self):
        t0 = time.perf_counter()
        states = list(self._states())
        snaps = _snapshots(states)
        for m in METRICS:
            fam = self._family(m)
            for state, values, hists in snaps:
                ident = list(state.identity)
                if m.type == "histogram":
                    counts, total, _n = hists[m.name]
                    fam.add_metric(ident, _histogram_buckets(m, counts), total)
                elif m.name == COLLECT_DURATION:
                    fam.add_metric(ident, state.collect_duration)
                else:
                    for labels, value in values.get(m.name, {}).items():
                        fam.add_metric(ident + list(labels), value)
            yield fam
        _collected(states, time.perf_counter() - t0)

    @staticmethod
    def _family(m: Metric):
        labels = list(IDENTITY_LABELS) + list(m.labels)
        if m.type == "counter":
            # prometheus_client appends _total itself.
            return CounterMetricFamily(m.name[: -len("_total")], m.help, labels=labels)
        if m.type == "histogram":
            return HistogramMetricFamily(m.name, m.help, labels=labels)
        # An info metric is exposed as a gauge of constant 1, as Prometheus' own *_info metrics are.
        return GaugeMetricFamily(m.name, m.help, labels=labels)


def make_registry(states) -> CollectorRegistry:
    """A private registry serving the given states (a list, or a callable returning one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TableCollector(states))
    return registry


# ---------------------------------------------------------------------------- fast text exposition
# The rank endpoint formats the Prometheus text format (version 0.0.4) itself: the identity
# labels are escaped once per rank and the HELP/TYPE lines once per process, so a scrape
# costs a fraction of prometheus_client's generic formatter (which validates and escapes
# every label of every sample). Tests check both give the same samples.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape_value(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _headers() -> dict[str, str]:
    out = {}
    for m in METRICS:
        mtype = "gauge" if m.type == "info" else m.type
        out[m.name] = f"# HELP {m.name} {_escape_help(m.help)}\n# TYPE {m.name} {mtype}\n"
    return out


_HEADERS = _headers()


def identity_text(state: MetricState) -> str:
    return ",".join(f'{k}="{_escape_value(v)}"' for k, v in zip(IDENTITY_LABELS, state.identity))


def render_text(states) -> bytes:
    """The exposition of the given states (a list, or a callable returning one)."""
    t0 = time.perf_counter()
    states = list(states() if callable(states) else states)
    snaps = [(identity_text(state), state, values, hists) for state, values, hists in _snapshots(states)]
    fmt = floatToGoString
    out: list[str] = []
    add = out.append
    for m in METRICS:
        name = m.name
        add(_HEADERS[name])
        for ident, state, values, hists in snaps:
            if m.type == "histogram":
                counts, total, n = hists[name]
                for le, cum in _histogram_buckets(m, counts):
                    add(f'{name}_bucket{{{ident},le="{le}"}} {fmt(cum)}\n')
                add(f"{name}_count{{{ident}}} {fmt(n)}\n{name}_sum{{{ident}}} {fmt(total)}\n")
            elif name == COLLECT_DURATION:
                add(f"{name}{{{ident}}} {fmt(state.collect_duration)}\n")
            else:
                keys = m.labels
                for labels, value in values.get(name, {}).items():
                    if labels:
                        extra = ",".join(f'{k}="{_escape_value(v)}"' for k, v in zip(keys, labels))
                        add(f"{name}{{{ident},{extra}}} {fmt(value)}\n")
                    else:
                        add(f"{name}{{{ident}}} {fmt(value)}\n")
    _collected(states, time.perf_counter() - t0)
    return "".join(out).encode("utf-8")
