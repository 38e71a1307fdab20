"""A running rank's latest figures, from its live.json or its metrics endpoint: facts for `diag top`.

Two sources give the same `RankLive`:
- the run directory's `rank-NNNNN/live.json` (`diag.live/1`, written by the agent every
  `live_s`): the last steps' records and the last sample;
- the rank's Prometheus endpoint, where per-step figures are the change of the counters
  between two scrapes (`EndpointHistory` carries the previous scrape forward).

Facts only: which rank sets the pace, which is a straggler and which has stalled are the
diagnosis's judgement (`diag.analyzers.diagnosis.live`). Every figure is None when its source
does not have it; nothing here raises on a damaged document.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from diag.analyzers.model import BOUNDS, step_seconds
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import finite as _num
from diag.analyzers.numbers import median as _median
from diag.step_record import LiveStep, live_step

RECENT_STEPS = 8  # the figures shown are the median of this many last steps
BAND_HISTORY = 32  # step times kept for the noise band


def _paced(step: LiveStep) -> float:
    """A live step's length as the job paced it (model.step_seconds), in seconds."""
    return float(step_seconds(step.device_s, step.duration_s) or 0.0)


@dataclass(frozen=True)
class RankLive:
    """One rank, now. Times in milliseconds per step, rates per second."""
    rank: int
    source: str  # "run_dir" or "endpoint"
    host: str | None = None
    status: str = "running"  # the agent's: running, completed, failed, interrupted; "unreachable"
    updated_unix: float | None = None  # when these figures were taken
    steps_done: int | None = None
    last_step_unix: float | None = None  # when the last step ended
    step_ms: float | None = None  # host wall time of the recent steps (median)
    recent_step_ms: tuple[float, ...] = ()  # the step times the noise band is taken from
    # The last steps as the run analysis gives them (step, duration_ms, data_wait_ms, evidence,
    # shares, start_unix), for stragglers over time; a run directory's only (an endpoint has none).
    recent_steps: tuple[dict, ...] = ()
    device_ms: float | None = None
    data_wait_ms: float | None = None
    wait_ms: float | None = None  # waiting for peers at collectives, where a window measured it
    bound: str | None = None  # the verdict of most recent steps (the agent's live verdict)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    gpu_util: float | None = None  # 0-1
    gpu_mem_used: float | None = None  # bytes
    gpu_mem_total: float | None = None
    power_w: float | None = None
    clock_events: tuple[str, ...] = ()  # active clock-event (throttle) reasons
    xid_errors: int | None = None
    window: tuple[int, int] | None = None  # the profiler window's steps while one records
    profiling: bool = False
    endpoint: str | None = None  # where the figures came from (host:port or the file)
    error: str | None = None  # why a source gave nothing


def _ms(seconds) -> float | None:
    s = _num(seconds)
    return s * 1000.0 if s is not None and s >= 0 else None


def _text(v, limit: int = 200) -> str | None:
    return v[:limit] if isinstance(v, str) else None


# -- the run directory's live.json -------------------------------------------------------------


def rank_from_live_doc(doc: dict, rank: int, path: str | None = None) -> RankLive:
    """The figures of one `diag.live/1` document (as read; any field may be missing or damaged)."""
    read = (live_step(s) for s in doc.get("steps") or [])
    steps = [s for s in read if s is not None and s.duration_s is not None]
    recent = steps[-RECENT_STEPS:]
    durations = [_paced(s) * 1000.0 for s in steps]
    last = steps[-1] if steps else None
    last_end = last.start_unix + (last.duration_s or 0.0) if last is not None and last.start_unix is not None \
        else None
    window = doc.get("window") if isinstance(doc.get("window"), dict) else None
    win = None
    if window and isinstance(window.get("first_step"), int) and isinstance(window.get("last_step"), int):
        win = (window["first_step"], window["last_step"])
    sample = dict_at(doc, "sample")
    gpu = dict_at(sample, "gpu")
    span_s = sum(_paced(s) for s in recent)
    steps_done = doc.get("steps_done")
    return RankLive(
        rank=rank, source="run_dir", host=_text(doc.get("host")),
        status=_text(doc.get("status"), 32) or "running",
        updated_unix=_num(doc.get("updated_unix")),
        steps_done=steps_done if isinstance(steps_done, int) and not isinstance(steps_done, bool) else None,
        last_step_unix=last_end,
        step_ms=_median(_paced(s) * 1000.0 for s in recent),
        recent_step_ms=tuple(durations[-BAND_HISTORY:]),
        recent_steps=tuple(_analysed_step(s) for s in steps),
        device_ms=_median(_ms(s.device_s) for s in recent),
        data_wait_ms=_median(_ms(s.data_wait_s) for s in recent),
        wait_ms=_median(_wait_ms(s) for s in recent),
        bound=_most_common(s.bound for s in recent),
        samples_per_s=_rate(recent, "samples", span_s),
        tokens_per_s=_rate(recent, "tokens", span_s),
        mfu=_median(s.mfu for s in recent),
        gpu_util=_num(gpu.get("utilization_ratio")),
        gpu_mem_used=_num(gpu.get("memory_used_bytes")),
        gpu_mem_total=_num(gpu.get("memory_total_bytes")),
        power_w=_num(gpu.get("power_watts")),
        clock_events=tuple(str(e)[:40] for e in gpu.get("clock_events") or () if isinstance(e, str))[:8],
        xid_errors=int(x) if (x := _num(gpu.get("xid_errors_total"))) is not None else None,
        window=win, profiling=win is not None, endpoint=path,
    )


def _analysed_step(s: LiveStep) -> dict:
    return {"step": s.step, "duration_ms": _paced(s) * 1000.0, "data_wait_ms": _ms(s.data_wait_s),
            "evidence": s.evidence,
            "shares": {k: v for k, v in s.shares.items() if v is not None} if s.shares is not None else None,
            "start_unix": s.start_unix}


def _wait_ms(step: LiveStep) -> float | None:
    w = step.shares.get("wait") if step.shares is not None else None
    return w * _paced(step) * 1000.0 if w is not None else None


def _rate(steps: list[LiveStep], key: str, span_s: float) -> float | None:
    vals = [v for v in (getattr(s, key) for s in steps) if v is not None]
    return sum(vals) / span_s if vals and span_s > 0 else None


def _most_common(values) -> str | None:
    counts = Counter(v for v in values if v in BOUNDS)
    return counts.most_common(1)[0][0] if counts else None


# -- a metrics endpoint ------------------------------------------------------------------------

# Series -> the counters whose change between two scrapes gives the per-step figures.
_COUNTERS = {
    "steps": ("diag_steps_total", None),
    "step_s": ("diag_step_duration_seconds_sum", None),
    "device_s": ("diag_step_device_seconds_sum", None),
    "device_n": ("diag_step_device_seconds_count", None),
    "data_s": ("diag_data_wait_seconds_total", None),
    "wait_s": ("diag_step_phase_seconds_total", ("phase", "wait")),
    "samples": ("diag_samples_total", None),
    "tokens": ("diag_tokens_total", None),
}


@dataclass(frozen=True)
class EndpointHistory:
    """What one endpoint's previous scrape leaves for the next: its counters and step times."""
    counters: dict = field(default_factory=dict)
    bounds: dict = field(default_factory=dict)
    at: float | None = None
    step_ms: tuple[float, ...] = ()


def _value(series: dict, name: str, label: tuple[str, str] | None = None) -> float | None:
    for labels, value in series.get(name, ()):
        if label is None or labels.get(label[0]) == label[1]:
            return _num(value)
    return None


def rank_from_metrics(series: dict, history: EndpointHistory, now: float,
                      endpoint: str | None = None) -> tuple[RankLive | None, EndpointHistory]:
    """(the rank's figures, the history for the next scrape) from one scrape's series:
    {metric sample name: [(labels, value), ...]}. None when the series name no rank."""
    identity: dict = next((labels for rows in series.values() for labels, _ in rows if "rank" in labels), {})
    rank_text = identity.get("rank", "")
    if not rank_text.isdigit():
        return None, history
    counters = {k: _value(series, name, label) for k, (name, label) in _COUNTERS.items()}
    bounds = {labels.get("bound"): _num(v) or 0.0 for labels, v in series.get("diag_step_bound_total", ())}
    prev = history.counters
    d = {k: (v - prev[k]) if v is not None and prev.get(k) is not None else v for k, v in counters.items()}
    since_start = not prev or not d.get("steps")
    if since_start:  # the first scrape, or no step since the last: the averages since the start
        d = dict(counters)
    n = d.get("steps") or 0.0

    step_total = d.get("step_s") or 0.0

    def per_step(k: str) -> float | None:
        v = d.get(k)
        return v / n * 1000.0 if n > 0 and v is not None else None

    def per_second(k: str) -> float | None:
        v = d.get(k)
        return v / step_total if step_total > 0 and v else None

    step_ms = per_step("step_s")
    recent = history.step_ms if since_start or step_ms is None else (history.step_ms + (step_ms,))[-BAND_HISTORY:]
    dn, device_s = d.get("device_n"), d.get("device_s")
    device_ms = device_s / dn * 1000.0 if dn and device_s is not None else None
    dbounds = {b: v - history.bounds.get(b, 0.0) for b, v in bounds.items()} if not since_start else bounds
    bound = max((b for b in dbounds if b in BOUNDS and dbounds[b] > 0), key=lambda b: dbounds[b], default=None)
    reasons = tuple(labels.get("reason", "")[:40] for labels, v in series.get("diag_gpu_clock_event_active", ())
                    if _num(v) == 1.0)
    xid = _value(series, "diag_gpu_xid_errors_total")
    steps_total = counters.get("steps")
    rank = RankLive(
        rank=int(rank_text), source="endpoint", host=_text(identity.get("host")), updated_unix=now,
        steps_done=int(steps_total) if steps_total is not None else None,
        last_step_unix=_value(series, "diag_last_step_timestamp_seconds") if steps_total else None,
        step_ms=step_ms, recent_step_ms=recent, device_ms=device_ms,
        data_wait_ms=per_step("data_s"),
        wait_ms=per_step("wait_s") if d.get("wait_s") else None,
        bound=bound,
        samples_per_s=per_second("samples"),
        tokens_per_s=per_second("tokens"),
        mfu=_value(series, "diag_mfu_ratio"),
        gpu_util=_value(series, "diag_gpu_utilization_ratio"),
        gpu_mem_used=_value(series, "diag_gpu_memory_used_bytes"),
        gpu_mem_total=_value(series, "diag_gpu_memory_total_bytes"),
        power_w=_value(series, "diag_gpu_power_watts"),
        clock_events=reasons[:8], xid_errors=int(xid) if xid is not None else None,
        profiling=_value(series, "diag_profiler_window_active") == 1.0, endpoint=endpoint,
    )
    return rank, EndpointHistory(counters=counters, bounds=bounds, at=now, step_ms=recent)


def unreachable(rank: int, source: str, endpoint: str | None, error: str, last: RankLive | None = None) -> RankLive:
    """A rank whose source gave nothing this time; its last figures are kept, marked as such."""
    if last is not None:
        return replace(last, status="unreachable", error=error[:200])
    return RankLive(rank=rank, source=source, status="unreachable", endpoint=endpoint, error=error[:200])
