"""The report's charts, as plain data: the per-step phase shares and throughput, the step
and collective-wait heatmaps, the straggler lateness chart, the metric timelines (bands of
min, median and max for many ranks) and the bus bandwidth, each bucketed to its limit with a
note saying so (`report_model.Limits`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from diag.analyzers.diagnosis.inputs import (
    CLASSES,
    Ranks,
    Steps,
    as_float,
    bucket_mean,
    bucket_starts,
    num,
)
from diag.analyzers.diagnosis.throttle import throttle_reasons
from diag.run_documents import RunRecords


def busbw_chart(run: RunRecords) -> dict | None:
    """Bus bandwidth against message size per collective, with the expected line."""
    bench = run.nccl_bench
    if not bench:
        return None
    chart: dict[str, list] = {"series": [], "expected": []}
    for t in bench.get("tests") or []:
        if not isinstance(t, dict):
            continue
        xs, ys = [], []
        for row in t.get("rows") or []:
            oop = row.get("out_of_place") or {}
            x, y = num(row.get("size_bytes")), num(oop.get("busbw_gbps"))
            if y is None:
                y = num((row.get("in_place") or {}).get("busbw_gbps"))
            if x is not None and y is not None:
                xs.append(x)
                ys.append(y)
        if xs:
            chart["series"].append({
                "name": f"{t.get('collective', '?')} ({t.get('world_size', '?')} ranks, "
                        f"{t.get('backend', '?')})",
                "collective": str(t.get("collective", "")),
                "x": xs, "y": ys, "status": str(t.get("status", "ok")),
            })
    for i in run.nccl_bandwidth:
        e = num(i.get("expected_busbw_gbps"))
        if e and not any(x["busbw_gbps"] == e for x in chart["expected"]):
            chart["expected"].append({"collective": str(i.get("collective", "")), "busbw_gbps": e,
                                      "label": str(i.get("expected_basis") or "expected")})
    return chart if chart["series"] else None


def json_list(a: np.ndarray, digits: int = 4) -> list:
    """Array to a JSON list, NaN as null."""
    return [None if v != v else round(float(v), digits) for v in a.tolist()]


def phase_series(steps: Steps, limits, notes) -> dict | None:
    m = steps.has_shares
    if not m.any():
        return None
    st, sh, traced = steps.step[m], steps.shares[m], steps.traced[m]
    starts = bucket_starts(len(st), limits.series_points)
    if len(starts) < len(st):
        notes.append(f"Phase shares: {len(st)} steps are shown as {len(starts)} buckets of consecutive steps "
                     "(each bar is the mean of its bucket).")
    means = bucket_mean(sh, starts)
    trace = np.logical_or.reduceat(traced, starts)  # a bucket with any traced step is shown as traced
    return {"x": st[starts].tolist(), "y": {p: json_list(means[:, i]) for i, p in enumerate(CLASSES)},
            "evidence": ["trace" if t else "sampled" for t in trace.tolist()], "bucketed": len(starts) < len(st)}


def throughput_series(ranks: Ranks, steps: Steps, limits, notes) -> dict | None:
    m = ~np.isnan(steps.dur)
    if not m.any():
        return None
    st, dur = steps.step[m], steps.dur[m]
    starts = bucket_starts(len(st), limits.series_points)
    out = {"x": st[starts].tolist(), "step_ms": json_list(bucket_mean(dur, starts) * 1000, 3),
           "samples_per_s": None, "tokens_per_s": None, "mfu": None}
    tot = np.add.reduceat(dur, starts)
    for key, col in (("samples_per_s", steps.samples[m]), ("tokens_per_s", steps.tokens[m])):
        if np.nansum(col) > 0:
            out[key] = json_list(np.add.reduceat(np.nan_to_num(col), starts) / tot, 3)
    if not np.isnan(steps.mfu[m]).all():
        out["mfu"] = json_list(bucket_mean(steps.mfu[m], starts))
    else:
        # MFU from analysed windows: one point per window start, mean over ranks.
        by_step = defaultdict(list)
        for r in ranks.values():
            for w in r.windows:
                v = num((w.analysis or {}).get("mfu"))
                if v is not None and w.first_step is not None:
                    by_step[w.first_step].append(v)
        if by_step:
            out["mfu_points"] = {"x": sorted(by_step), "y": [float(np.mean(by_step[k])) for k in sorted(by_step)]}
    return out


def step_heatmap(ranks: Ranks, limits, notes) -> dict | None:
    rows = [r for r in ranks.values() if (~np.isnan(r.step_table.dur)).any()]
    if not rows:
        return None
    all_steps = np.unique(np.concatenate([r.step_table.step[~np.isnan(r.step_table.dur)] for r in rows]))
    grid = np.full((len(rows), len(all_steps)), np.nan)
    for i, r in enumerate(rows):
        m = ~np.isnan(r.step_table.dur)
        grid[i, np.searchsorted(all_steps, r.step_table.step[m])] = r.step_table.dur[m] * 1000
    starts = bucket_starts(len(all_steps), limits.heatmap_columns)
    if len(starts) < len(all_steps):
        notes.append(f"Step-time heatmap: {len(all_steps)} steps per rank are shown as {len(starts)} columns "
                     "(each cell is the mean step time of its bucket).")
    z = bucket_mean(grid.T, starts).T
    return {"x": all_steps[starts].tolist(), "ranks": [r.rank for r in rows],
            "z": [json_list(row, 3) for row in z], "unit": "ms", "label": "step time"}


def lateness_heatmap(episodes: dict | None) -> dict | None:
    """The diagnosis's rank x time lateness, as the step heatmap's shape; None without ranks to compare."""
    chart = (episodes or {}).get("chart")
    if not chart or not chart.get("first_steps"):
        return None
    return {"x": chart["first_steps"], "ranks": chart["ranks"], "z": chart["lateness_ms"], "unit": "ms",
            "label": "lateness behind the median rank"}


def bucket_cols(grid: np.ndarray, starts: np.ndarray) -> list:
    return [json_list(row, 3) for row in bucket_mean(grid.T, starts).T]


def wait_heatmap(ranks: Ranks, limits, notes) -> dict | None:
    """Waiting time per collective per rank: its duration minus the fastest rank's duration.

    Collectives are matched across ranks by the cross-rank analyzer (process group and
    sequence number, falling back to order), the same matching the job verdict uses.
    """
    per_rank = {r.rank: r.facts.causes.collectives for r in ranks.values() if r.facts.causes.collectives}
    if len(per_rank) < 2:
        return None
    from diag.analyzers.job.cross_rank import match_collectives

    groups = match_collectives(per_rank)["groups"]
    if not groups:
        return None
    rank_list = sorted(per_rank)
    row = {r: i for i, r in enumerate(rank_list)}
    wait = np.full((len(rank_list), len(groups)), np.nan)
    for j, g in enumerate(groups):
        fastest = min(g["dur_us"].values())
        for r, d in g["dur_us"].items():
            if r in row:
                wait[row[r], j] = (d - fastest) / 1000.0  # ms
    starts = bucket_starts(len(groups), limits.heatmap_columns)
    if len(starts) < len(groups):
        notes.append(f"Collective-wait heatmap: {len(groups)} matched collectives are shown as {len(starts)} "
                     "columns (each cell is the mean wait of its bucket).")
    z = bucket_cols(wait, starts)
    totals = np.nansum(wait, axis=1)
    return {"x": starts.tolist(), "ranks": rank_list, "z": z, "unit": "ms",
            "label": "wait at collectives", "collectives": len(groups),
            "total_wait_ms": {str(r): round(float(t), 3) for r, t in zip(rank_list, totals)}}


# (key, label, unit, section of the sample, field, scale): the metric timelines, in page order.
TIMELINE_METRICS = (
    ("gpu_util", "Device utilisation", "%", "gpu", "utilization_ratio", 100.0),
    ("gpu_mem", "Device memory used", "GiB", "gpu", "memory_used_bytes", 1 / 2**30),
    ("gpu_power", "Device power", "W", "gpu", "power_watts", 1.0),
    ("gpu_clock", "SM clock", "MHz", "gpu", "sm_clock_hz", 1e-6),
    ("gpu_temp", "Device temperature", "°C", "gpu", "temperature_celsius", 1.0),
    ("host_cpu", "Host CPU", "%", "host", "cpu_ratio", 100.0),
    ("proc_cpu", "Training process CPU", "% of one core", "host", "process_cpu_ratio", 100.0),
    ("host_mem", "Host memory used", "GiB", "host", "memory_used_bytes", 1 / 2**30),
    ("proc_rss", "Training process memory (RSS)", "GiB", "host", "process_rss_bytes", 1 / 2**30),
)


def sample_matrix(samples: list) -> tuple[np.ndarray, np.ndarray, list]:
    """(times, values per TIMELINE_METRICS column, [(t, reasons)] throttle events) of one rank."""
    ts, rows, throttle = [], [], []
    for s in samples:
        t = as_float(s.get("t"))
        if t != t:
            continue
        g = s.get("gpu") if type(s.get("gpu")) is dict else {}
        h = s.get("host") if type(s.get("host")) is dict else {}
        ts.append(t)
        rows.append([as_float((g if sec == "gpu" else h).get(field)) * k for _, _, _, sec, field, k in TIMELINE_METRICS])
        bad = throttle_reasons(g.get("clock_events"))
        if bad:
            throttle.append((t, ",".join(bad)))
    if not ts:
        return np.empty(0), np.empty((0, len(TIMELINE_METRICS))), throttle
    vals = np.array(rows, dtype=np.float64)
    vals[~np.isfinite(vals)] = np.nan
    return np.array(ts), vals, throttle


def timelines(ranks: Ranks, limits, notes) -> dict | None:
    """Device and host metrics over time; bands across ranks when there are many."""
    per = {r.rank: sample_matrix(r.samples) for r in ranks.values() if r.samples}
    per = {k: v for k, v in per.items() if len(v[0])}
    if not per:
        return None
    t0 = min(float(v[0].min()) for v in per.values())
    band = len(per) > limits.rank_lines
    out = {"t0_unix": t0, "band": band, "metrics": [], "throttle": []}
    if band:
        notes.append(f"Metric timelines: {len(per)} ranks are shown as the min, median and max across ranks "
                     f"per time bucket (at most {limits.timeline_points} buckets).")
    downsampled = False
    for j, (key, label, unit, _sec, _field, _k) in enumerate(TIMELINE_METRICS):
        series = {}
        for rank, (ts, vals, _) in per.items():
            m = ~np.isnan(vals[:, j])
            if m.any():
                series[rank] = (ts[m] - t0, vals[m, j])
        if not series:
            continue
        entry: dict[str, Any] = {"key": key, "label": label, "unit": unit}
        if band:
            entry.update(band_of(series, limits.timeline_points))
        else:
            lines = []
            for rank, (t, v) in sorted(series.items()):
                if len(t) > limits.timeline_points:
                    downsampled = True
                    starts = bucket_starts(len(t), limits.timeline_points)
                    t, v = t[starts], bucket_mean(v, starts)
                lines.append({"rank": rank, "t": json_list(t, 3), "y": json_list(v)})
            entry["lines"] = lines
        out["metrics"].append(entry)
    if downsampled:
        notes.append(f"Metric timelines: series longer than {limits.timeline_points} samples are averaged "
                     "into that many points.")
    # Throttle events: one marker per second and reason, naming the ranks it hit.
    events: dict[tuple, list] = defaultdict(list)
    for rank, (_, _, thr) in per.items():
        for t, reasons in thr:
            events[(round(t - t0), reasons)].append(rank)
    throttle = [{"t": k[0], "reasons": k[1], "ranks": sorted(v)} for k, v in sorted(events.items())]
    out["throttle_total"] = sum(len(v) for v in events.values())
    if len(throttle) > limits.timeline_points:
        notes.append(f"Throttle events: {len(throttle)} distinct seconds with throttling; the first "
                     f"{limits.timeline_points} are marked.")
        throttle = throttle[: limits.timeline_points]
    out["throttle"] = throttle
    return out if out["metrics"] else None


def band_of(series: dict, points: int) -> dict:
    t = np.concatenate([v[0] for v in series.values()])
    v = np.concatenate([v[1] for v in series.values()])
    lo, hi = float(t.min()), float(t.max())
    nb = max(1, min(points, int(hi - lo) + 1))
    idx = np.minimum(((t - lo) / max(hi - lo, 1e-9) * nb).astype(int), nb - 1)
    order = np.lexsort((v, idx))
    idx, v = idx[order], v[order]
    cuts = np.flatnonzero(np.diff(idx)) + 1
    starts = np.r_[0, cuts]
    ends = np.r_[cuts, len(v)]
    med = [(float(v[(a + b - 1) // 2]) + float(v[(a + b) // 2])) / 2 for a, b in zip(starts, ends)]
    centers = lo + (idx[starts] + 0.5) * (hi - lo) / nb
    return {"t": json_list(centers, 3), "min": json_list(v[starts]), "median": [round(x, 4) for x in med],
            "max": json_list(v[ends - 1])}
