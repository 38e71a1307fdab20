"""The judgement of a running job from its ranks' latest figures: what `diag top` shows of the job.

From each rank's `RankLive` (`diag.analyzers.job.live`):
- its pace: its step time less its waiting for peers, where a window measured that. In a job
  synchronised by collectives every rank's step lasts as long as the slowest one's work, so
  the rank with the longest pace sets it, when it leads the others by more than the noise
  (`pace.pace_setter`, the job verdict's rule too);
- a straggler: the pace-setting rank when its pace exceeds the other ranks' median by more
  than `straggler_step_excess` of their step and by more than the noise bands of both (the
  interval of each median, `steady`); or a rank whose data wait exceeds the others' by that
  much, since its peers then wait for it inside their collectives, where the step record
  does not see it; else the one rank of the episode going on (below), as the report names
  it. Its likely cause is where its excess lies: waiting for data, the device (with the
  clock-event reasons it reports), or the host;
- stalled ranks: running, but no step for `live_stall_steps` median steps and at least
  `live_stall_min_s` seconds;
- the straggler episode going on, over the last steps the ranks' live.json files hold
  (`straggler_episodes`, as the report judges the whole run);
- the job: its verdict (the ranks' most common), throughput (the ranks' sum), MFU (their
  median), and whether a profiler window records.
Pure: returns a new dict; every threshold is a name in `decision_tree.toml`.
"""

from __future__ import annotations

import statistics
from collections import Counter

from diag.analyzers.diagnosis.pace import band, pace_setter
from diag.analyzers.diagnosis.straggler_cause import excess_at
from diag.analyzers.diagnosis.straggler_episodes import straggler_episodes

LIVE_STATUSES = ("running",)


def judge_live(ranks: list, tree, now: float) -> dict:
    """{"verdict", "samples_per_s", "tokens_per_s", "mfu", "profiling", "pace_rank", "straggler",
    "stalled", "pace_ms"} of the ranks' figures."""
    th = tree.thresholds
    live = [r for r in ranks if r.status in LIVE_STATUSES and r.step_ms is not None]
    pace = {r.rank: r.step_ms - (r.wait_ms or 0.0) for r in live}
    counts = Counter(r.bound for r in live if r.bound)
    mfus = [r.mfu for r in live if r.mfu is not None]
    episode = _ongoing_episode(live, tree)
    return {
        "verdict": counts.most_common(1)[0][0] if counts else None,
        "samples_per_s": _sum(r.samples_per_s for r in live),
        "tokens_per_s": _sum(r.tokens_per_s for r in live),
        "mfu": statistics.median(mfus) if mfus else None,
        "profiling": any(r.profiling for r in ranks),
        "pace_rank": pace_setter(pace, {r.rank: _band(r, th["noise_interval_z"]) for r in live}),
        "pace_ms": {k: round(v, 3) for k, v in pace.items()},
        "straggler": _straggler(live, pace, th) or _episode_straggler(episode, live, th),
        "stalled": _stalled(ranks, th, now),
        "episode": episode,
    }


def _sum(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def _band(r, z: float) -> float:
    return band(r.recent_step_ms, z)


def _straggler(live: list, pace: dict, th: dict) -> dict | None:
    if len(live) < 2:
        return None
    z, excess = th["noise_interval_z"], th["straggler_step_excess"]
    by_rank = {r.rank: r for r in live}
    # Each rank against the median of the others, each median found from one sort: a job of
    # thousands of ranks is judged at every refresh.
    peers_step = _others_median({r.rank: r.step_ms for r in live})
    peers_band = _others_median({r.rank: _band(r, z) for r in live})
    peers_pace = _others_median(pace)
    peers_data = _others_median({r.rank: r.data_wait_ms for r in live})
    candidates = []
    for r in live:
        floor = max(excess * peers_step[r.rank], _band(r, z) + peers_band[r.rank])
        lag = pace[r.rank] - peers_pace[r.rank]
        data_lag = (r.data_wait_ms - peers_data[r.rank]
                    if r.data_wait_ms is not None and peers_data[r.rank] is not None else None)
        worst = max(lag, data_lag or 0.0)
        if worst > floor:
            candidates.append((worst, r.rank, lag, data_lag))
    if not candidates:
        return None
    worst, rank, lag, data_lag = max(candidates)
    cause, text = _likely_cause(by_rank[rank], [p for p in live if p.rank != rank], th)
    return {"rank": rank, "excess_ms": round(worst, 3), "pace_lag_ms": round(lag, 3),
            "data_wait_lag_ms": round(data_lag, 3) if data_lag is not None else None,
            "cause": cause, "text": text}


def _episode_straggler(episode: dict | None, live: list, th: dict) -> dict | None:
    """The rank late in the straggler episode going on, where one rank is (persistent): the
    rule the report names a straggler over time by, for lateness under straggler_step_excess."""
    rank = (episode or {}).get("rank")
    mine = next((r for r in live if r.rank == rank), None)
    if mine is None or episode is None:
        return None
    cause, text = _likely_cause(mine, [p for p in live if p.rank != rank], th)
    late = episode.get("median_lateness_ms")
    return {"rank": rank, "excess_ms": round(late, 3) if isinstance(late, (int, float)) else 0.0,
            "pace_lag_ms": None, "data_wait_lag_ms": None, "cause": cause, "text": text,
            "basis": f"a {episode['kind']} episode since step {episode['first_step']}"}


def _others_median(values: dict) -> dict:
    """Per key, the median of the other keys' values (None values left out; None when no other
    value is known), from one sort."""
    known = sorted((v, k) for k, v in values.items() if v is not None)
    ordered = [v for v, _ in known]
    where = {k: i for i, (_, k) in enumerate(known)}
    out = {}
    for k in values:
        skip = where.get(k, len(ordered))
        m = len(ordered) - (k in where)

        def at(i, skip=skip):
            return ordered[i if i < skip else i + 1]

        out[k] = None if m == 0 else at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2
    return out


def _lag(r, peers: list, attr: str) -> float | None:
    own = getattr(r, attr)
    others = [getattr(p, attr) for p in peers if getattr(p, attr) is not None]
    return own - statistics.median(others) if own is not None and others else None


def _likely_cause(r, peers: list, th: dict) -> tuple[str, str]:
    """Where the straggler's excess lies (`straggler_cause.excess_at`, the report's rule), on
    what a live rank measures: its data wait, its device time, and the rest of its pace."""
    step = statistics.median(p.step_ms for p in peers)
    data, device = _lag(r, peers, "data_wait_ms"), _lag(r, peers, "device_ms")
    paces = [p.step_ms - (p.wait_ms or 0.0) for p in peers if p.step_ms is not None]
    pace = r.step_ms - (r.wait_ms or 0.0) - statistics.median(paces) if r.step_ms is not None and paces else None
    host = pace - (data or 0.0) - (device or 0.0) if pace is not None else None
    where = excess_at({"data": data, "host": host, "device": device}, step, th)
    if where is None:
        return "undetermined", "its data wait, device and host time per step are within noise of its peers'"
    if where == "data":
        return "data_loader", (f"waits {data:.1f} ms more per step for its DataLoader than its peers: "
                               "its input pipeline")
    if where == "device":
        reasons = ", ".join(r.clock_events)
        if reasons:
            return "throttling", f"its device takes {device:.1f} ms more per step, with clocks reduced ({reasons})"
        return "device", f"its device takes {device:.1f} ms more per step than its peers'"
    return "host", (f"its own work takes {host:.1f} ms more per step on the host (CPU time, Python, I/O or "
                    "other processes)")


def _ongoing_episode(live: list, tree) -> dict | None:
    """The straggler episode that reaches the ranks' latest steps, or None."""
    ranks = {r.rank: list(r.recent_steps) for r in live if r.recent_steps}
    result = straggler_episodes(ranks, tree) if len(ranks) >= 2 else None
    ongoing = [e for e in (result or {}).get("episodes") or () if e.get("ongoing")]
    if not ongoing:
        return None
    e = ongoing[-1]
    return {k: e[k] for k in ("kind", "rank", "ranks", "first_step", "last_step", "median_lateness_ms")}


def _stalled(ranks: list, th: dict, now: float) -> list[int]:
    steps = [r.step_ms for r in ranks if r.step_ms is not None]
    typical_s = statistics.median(steps) / 1000.0 if steps else 0.0
    limit = max(th["live_stall_min_s"], th["live_stall_steps"] * typical_s)
    return sorted(r.rank for r in ranks if r.status in LIVE_STATUSES and r.last_step_unix is not None
                  and now - r.last_step_unix > limit)
