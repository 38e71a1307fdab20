"""Stragglers over time: which rank the others wait for, step by step, grouped into episodes.

Each step s and rank r get a lateness L[s, r] (ms): how much later than the ranks' median it was
ready for the step's collectives. What a late step costs the job is counted against the median
rank, of an even number of ranks the faster middle one, an actual rank (as in the job's
what-if): with two ranks, the whole gap.
- In a traced step, where a window matched the collectives across ranks: the rank's pace (its
  step less its waiting for peers) against the median rank's.
- In any other step: its data wait against the median rank's. In a job synchronised by its
  collectives every rank's step lasts as long as the slowest rank's, so the step records of
  the others do not show it; a rank that waits longer for its batch makes the others wait as
  much longer in their collectives. A rank slower at its own compute shows in windows only.

A step is straggled when its latest rank's lateness exceeds `straggler_episode_min_share` of
the median step and the run's own noise: z times the spread of each rank's lateness from one
step to the next (its robust sigma, over the square root of 2), which a rank late by the same
amount in every step does not widen, times the lead that the latest rank reaches by chance in no
more than the tail `noise_interval_z` leaves (2.5% of the steps at 1.96) when no rank is late: the
latest of many ranks is the largest of many draws, so the factor grows with the ranks. A traced
step counts only where its late rank is late in more than `straggler_step_fraction` of the
traced steps: a window's steps are not independent (the profiler can weigh on one rank for the
whole window), and that is the consistency `stragglers.py` asks of a rank it names. Its data
wait is judged too, as in any step: a late batch inside a window still counts.

Straggled steps, with gaps of up to `straggler_episode_gap_steps` bridged, form episodes of at
least `straggler_episode_min_steps` steps. Where the episodes span `straggler_persistent_fraction`
of the run (of its traced steps, where traces showed most of the lateness: a pace late at the
collectives shows in profiler windows only), its straggler is chronic and every episode is of its
kind:
- persistent: one rank is the late one in `straggler_episode_same_rank` of their straggled
  steps, or carries that share of the time they lost, and its own episodes span that fraction
  too (a bad node, or its data shard);
- rotating: no rank is that dominant (contention shared by the nodes, or data skew).
A dominant rank whose own episodes are shorter (a burst of its own among episodes of a busy
machine's scheduling noise) makes no chronic pattern.
Otherwise each episode is a burst of its own: transient when one rank is that dominant in it (a
checkpoint, a noisy neighbour, a thermal event), rotating when not.
Its cost is what the job waited beyond the median rank over its steps; an episode that reaches
the last recorded steps is ongoing. Pure: new values.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from diag.analyzers.diagnosis.inputs import bucket_mean, bucket_starts, num
from diag.analyzers.diagnosis.steady import robust_sigma

CHART_BINS = 120  # columns of the rank x time chart at most
KINDS = ("persistent", "rotating", "transient")
# The null distribution of the latest rank's lead: simulated steps, ranks (beyond, the lead grows
# by little), and the seed that keeps it fixed.
NULL_STEPS, NULL_MAX_RANKS, NULL_SEED = 2000, 256, 20261126


def straggler_episodes(steps_by_rank: Mapping[int, Sequence], tree) -> dict | None:
    """The episodes of the ranks' analysed steps (rank -> its steps as its analysis gives them),
    or None with fewer than two ranks sharing steps."""
    table = _lateness_table(steps_by_rank)
    if table is None:
        return None
    steps, rank_ids, basis, data, step_ms, start, source = table
    th = tree.thresholds
    factor = _null_lead_factor(len(rank_ids), 1.0 - NormalDist().cdf(th["noise_interval_z"]))
    median_step = float(np.nanmedian(step_ms)) if np.isfinite(step_ms).any() else 0.0
    noise, who, cost, straggled = _judged(basis, source, factor, median_step, th)
    straggled = _consistent_in_traces(straggled, who, source, th["straggler_step_fraction"])
    pace_late = straggled & (source == 1)  # late by a pace that only a trace shows
    # A traced step's data wait is measured as any other's: a late batch counts there too.
    _, who_d, cost_d, straggled_d = _judged(data, np.zeros_like(source), factor, median_step, th)
    by_data = (source == 1) & ~straggled & straggled_d
    who, cost, straggled = np.where(by_data, who_d, who), np.where(by_data, cost_d, cost), straggled | by_data
    runs = _runs(straggled, th["straggler_episode_gap_steps"], th["straggler_episode_min_steps"])
    chronic = _chronic_kind(runs, who, cost, straggled, pace_late, source, th)
    episodes = [_episode(i0, i1, steps, rank_ids, who, cost, straggled, start, step_ms, th, len(steps), chronic)
                for i0, i1 in runs]
    total_ms = float(np.nansum(step_ms))
    for e in episodes:
        e["share_of_job_time"] = round(e["cost_ms"] / total_ms, 4) if total_ms > 0 else None
    return {
        "observed_steps": len(steps),
        "traced_steps": int((source == 1).sum()),
        "noise_ms": {"data_wait": round(noise[0], 3), "trace": round(noise[1], 3)},
        "threshold_ms": round(max(th["straggler_episode_min_share"] * median_step, noise[0]), 3),
        "straggled_steps": int(straggled.sum()),
        "episodes": episodes,
        "pattern": max(episodes, key=lambda e: e["cost_ms"])["kind"] if episodes else None,
        "chart": _chart(steps, rank_ids, basis - _lower_median(basis)[:, None]),
    }


def _rank_columns(analysed: Sequence):
    """(step, duration ms, data wait ms, pace ms, traced, start unix) of a rank's analysed steps,
    as arrays in step order; None without steps."""
    rows = {}
    for s in analysed:
        if isinstance(s, dict) and type(s.get("step")) is int and (d := num(s.get("duration_ms"))) is not None:
            rows[s["step"]] = s, d
    if not rows:
        return None
    order = sorted(rows)
    cols = np.full((len(order), 4), np.nan)
    traced = np.zeros(len(order), dtype=bool)
    for i, n in enumerate(order):
        s, d = rows[n]
        dw = num(s.get("data_wait_ms"))
        wait = num(s["shares"].get("wait")) if isinstance(s.get("shares"), dict) else None
        traced[i] = s.get("evidence") == "trace" and wait is not None
        cols[i] = (d, np.nan if dw is None else dw, d * (1.0 - wait) if wait is not None and traced[i] else np.nan,
                   np.nan if num(s.get("start_unix")) is None else s["start_unix"])
    return np.array(order, dtype=np.int64), cols, traced


def _lateness_table(steps_by_rank: Mapping[int, Sequence]):
    """(step numbers, rank ids, when each rank was ready [step, rank] (its pace or data wait, ms),
    its data wait [step, rank], the job's step ms, start unix, source: 1 traced, 0 data wait) over the steps at least two
    ranks share; None without two ranks. Columnar: a run has up to 10^6 steps per rank."""
    per = {rid: c for rid, c in ((rid, _rank_columns(s)) for rid, s in steps_by_rank.items()) if c is not None}
    if len(per) < 2:
        return None
    rank_ids = sorted(per)
    numbers, counts = np.unique(np.concatenate([per[r][0] for r in rank_ids]), return_counts=True)
    steps = numbers[counts >= 2]
    if not len(steps):
        return None
    n, m = len(steps), len(rank_ids)
    dur, data, pace, start = (np.full((n, m), np.nan) for _ in range(4))
    traced = np.zeros((n, m), dtype=bool)
    for j, rid in enumerate(rank_ids):
        own, cols, tr = per[rid]
        keep = np.isin(own, steps)
        at = np.searchsorted(steps, own[keep])
        dur[at, j], data[at, j], pace[at, j], start[at, j] = cols[keep].T
        traced[at, j] = tr[keep]
    # A step is judged on its trace where every rank present in it was traced.
    present = np.isfinite(dur)
    by_trace = (traced | ~present).all(axis=1) & (traced.sum(axis=1) >= 2)
    basis = np.where(by_trace[:, None], pace, data)
    with warnings.catch_warnings():  # rows with no start time: NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        first_start = np.nanmin(start, axis=1)
    return steps, rank_ids, basis, data, np.nanmax(dur, axis=1), first_start, by_trace.astype(np.int8)


def _lower_median(a: np.ndarray) -> np.ndarray:
    """Each row's median of its finite values; of an even count, the lower middle value (an
    actual rank's). NaN for a row with none."""
    finite = np.isfinite(a).sum(axis=1)
    ordered = np.sort(a, axis=1)  # NaN sorts last
    at = np.maximum((finite - 1) // 2, 0)
    out = ordered[np.arange(len(a)), at]
    return np.where(finite > 0, out, np.nan)


@lru_cache(maxsize=64)
def _null_lead_factor(ranks: int, tail: float) -> float:
    """How many sigmas (as `_sigma_ms` estimates them) the latest rank leads the lower median rank
    by in no more than `tail` of the steps when no rank is late: from the ranks' lateness drawn
    as independent normals, a fixed sample, so the same run is always judged the same."""
    m = min(max(ranks, 2), NULL_MAX_RANKS)
    x = np.random.default_rng(NULL_SEED).standard_normal((NULL_STEPS, m))
    late = x - np.median(x, axis=1)[:, None]
    sigma = (robust_sigma((late[1:] - late[:-1]).ravel().tolist()) or math.nan) / math.sqrt(2.0)
    return float(np.quantile(late.max(axis=1), 1.0 - tail)) / sigma


def _sigma_ms(late: np.ndarray, source: np.ndarray, src: int) -> float:
    """The robust spread of a rank's lateness from one step to the next (over the square root of 2),
    between consecutive steps both judged on `src` (1: a trace's pace, 0: the data wait)."""
    same = (source[1:] == src) & (source[:-1] == src)
    diffs = (late[1:] - late[:-1])[same]
    sigma = robust_sigma(diffs[np.isfinite(diffs)].tolist())
    return sigma / math.sqrt(2.0) if sigma else 0.0


def _judged(basis: np.ndarray, source: np.ndarray, factor: float, median_step: float, th: dict):
    """({source: noise ms}, the latest rank per step, what it cost (ms behind the lower median
    rank), whether the step is straggled) of the readiness `basis` [step, rank]. Judged against
    the ranks' median; the cost is counted against the lower median rank, an actual rank, as the
    job's what-if counts it. Each measure has its own noise: a trace's pace scatters more than a
    data wait."""
    with warnings.catch_warnings():  # a step whose ranks recorded no data wait has no median: NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        late = basis - np.nanmedian(basis, axis=1)[:, None]
    behind = basis - _lower_median(basis)[:, None]
    noise = {src: factor * _sigma_ms(late, source, src) for src in (0, 1)}
    floor = np.maximum(th["straggler_episode_min_share"] * median_step, np.where(source == 1, noise[1], noise[0]))
    worst = np.where(np.isfinite(late), late, -np.inf)
    who = np.argmax(worst, axis=1)
    rows = np.arange(len(basis))
    return noise, who, behind[rows, who], worst[rows, who] > floor


def _consistent_in_traces(straggled: np.ndarray, who: np.ndarray, source: np.ndarray, fraction: float) -> np.ndarray:
    """The straggled steps, less traced ones whose late rank is late in no more than `fraction`
    of the run's traced steps. A window's few steps are no independent draws (the profiler
    weighs on one rank for the whole window), so a pace seen late in traces counts where the
    rank is late across them, as `stragglers.py` requires of a rank it names."""
    traced = source == 1
    if not traced.any():
        return straggled
    late_share = np.bincount(who[traced & straggled], minlength=int(who.max()) + 1) / int(traced.sum())
    return straggled & (~traced | (late_share[who] > fraction))


def _runs(flags: np.ndarray, gap: int, min_steps: int) -> list[tuple[int, int]]:
    """[first, last] index ranges of flagged steps, gaps of up to `gap` unflagged steps bridged,
    each with at least `min_steps` flagged steps."""
    idx = np.flatnonzero(flags)
    if not len(idx):
        return []
    runs, first, prev = [], int(idx[0]), int(idx[0])
    for i in idx[1:].tolist():
        if i - prev - 1 > gap:
            runs.append((first, prev))
            first = i
        prev = i
    runs.append((first, prev))
    return [(a, b) for a, b in runs if int(flags[a:b + 1].sum()) >= min_steps]


def _top_rank_share(who: np.ndarray, cost: np.ndarray) -> tuple[int, float]:
    """(the rank most often late over these steps, the larger of its share of the straggled
    steps and of the time they lost). Either way of counting alone is thrown by the machine's
    noise: a few other steps late by a little turn a burst on one rank rotating by count, one
    step late by a lot does so by time."""
    counts = np.bincount(who)
    top = int(np.argmax(counts))
    lost = np.bincount(who, weights=np.maximum(cost, 0.0), minlength=len(counts))
    total = float(lost.sum())
    by_time = float(lost[top]) / total if total > 0 else 1.0
    return top, max(float(counts[top]) / max(len(who), 1), by_time)


def _chronic_kind(runs, who, cost, straggled, pace_late, source, th) -> str | None:
    """Where episodes span `straggler_persistent_fraction` of the run, however profiler windows or
    quiet steps cut them into pieces, the run has one chronic straggler pattern: persistent when
    one rank is the late one in `straggler_episode_same_rank` of their straggled steps or carries
    that share of the time they lost (_top_rank_share) and its own episodes span that fraction
    too; rotating when no rank is that dominant. A dominant rank whose own episodes are shorter
    (a burst among episodes of the machine's noise) makes no chronic pattern: each episode is
    judged alone. Where most of their straggled steps are late by their pace in traces (late at
    the collectives, which steps outside the windows can not show), the span is counted in traced
    steps. None for a run mostly free of stragglers."""
    if _span(runs, straggled, pace_late, source) < th["straggler_persistent_fraction"]:
        return None
    late = _within(runs, len(straggled)) & straggled
    top, share = _top_rank_share(who[late], cost[late])
    if share < th["straggler_episode_same_rank"]:
        return "rotating"
    own = straggled & (who == top)
    own_runs = _runs(own, th["straggler_episode_gap_steps"], th["straggler_episode_min_steps"])
    return "persistent" if _span(own_runs, own, pace_late & own, source) >= th["straggler_persistent_fraction"] \
        else None


def _within(runs, n: int) -> np.ndarray:
    """The steps inside the runs, as a mask over n steps."""
    sel = np.zeros(n, dtype=bool)
    for i0, i1 in runs:
        sel[i0:i1 + 1] = True
    return sel


def _span(runs, straggled, pace_late, source) -> float:
    """The share of the run the runs span: of its traced steps where most of their straggled
    steps are late by their pace in traces, else of all its steps."""
    sel = _within(runs, len(straggled))
    traced = source == 1
    if traced.any() and int((sel & pace_late).sum()) * 2 > int((sel & straggled).sum()):
        return int((sel & traced).sum()) / int(traced.sum())
    return int(sel.sum()) / len(sel) if len(sel) else 0.0


def _episode(i0, i1, steps, rank_ids, who, cost, straggled, start, step_ms, th, observed, chronic) -> dict:
    sel = np.arange(i0, i1 + 1)
    sel = sel[straggled[sel]]
    late_counts = Counter(rank_ids[k] for k in who[sel].tolist())
    top_index, share = _top_rank_share(who[sel], cost[sel])
    top = rank_ids[top_index]
    dominant = share >= th["straggler_episode_same_rank"]
    span = i1 - i0 + 1
    kind = chronic or ("transient" if dominant else "rotating")
    # The lateness of the rank the episode names: steps another rank led by a little (the
    # machine's noise, bridged into the episode) are not its.
    own = sel[who[sel] == top_index] if dominant else sel
    end = start[i1] + step_ms[i1] / 1000.0 if np.isfinite(start[i1]) and np.isfinite(step_ms[i1]) else None
    return {
        "kind": kind,
        "rank": top if dominant else None,
        "ranks": [r for r, _ in late_counts.most_common(16)],
        "late_steps_by_rank": {str(r): c for r, c in late_counts.most_common(16)},
        "first_step": int(steps[i0]),
        "last_step": int(steps[i1]),
        "steps": span,
        "straggled_steps": len(sel),
        "start_unix": float(start[i0]) if np.isfinite(start[i0]) else None,
        "end_unix": float(end) if end is not None else None,
        # Still going at the last step the run recorded (gaps bridged): the job's current episode.
        "ongoing": i1 >= observed - 1 - th["straggler_episode_gap_steps"],
        "cost_ms": round(float(cost[sel].sum()), 3),
        "median_lateness_ms": round(float(np.median(cost[own])), 3),
    }


def _chart(steps: np.ndarray, rank_ids: list, late: np.ndarray) -> dict:
    """Rank x time: each rank's mean lateness in up to CHART_BINS step ranges."""
    starts = bucket_starts(len(steps), CHART_BINS)
    grid = bucket_mean(late, starts).T
    return {"ranks": list(rank_ids), "first_steps": steps[starts].tolist(),
            "lateness_ms": [[round(float(x), 3) if np.isfinite(x) else None for x in row] for row in grid]}


_ADVICE = {
    "persistent": "The same rank is late step after step: look at its node. Its device (clocks, temperature, "
                  "XID errors in the samples), its host (CPU saturation, other processes) or its data shard "
                  "(larger or slower-to-read samples); drain or replace the node, or rebalance its shard.",
    "rotating": "The late rank moves from step to step: something every node shares, or the data. Look for "
                "contention on the network or a shared file system, and for data skew (sequence lengths or sample "
                "sizes that vary between batches: bucket by length, balance the batches across ranks).",
    "transient": "A burst on one rank: something ran beside the training in those steps (a checkpoint, an "
                 "evaluation, logging, a noisy neighbour, a garbage-collection pause, a thermal event). Match "
                 "the steps against that rank's events and samples.",
}


def episode_finding(result: dict | None, tree) -> dict | None:
    """A finding for the costliest episode (the others counted), or None without episodes."""
    if not result or not result["episodes"]:
        return None
    eps = result["episodes"]
    e = max(eps, key=lambda x: x["cost_ms"])
    where = f"steps {e['first_step']}-{e['last_step']}"
    share = e.get("share_of_job_time")
    cost = f"the job waited {e['cost_ms'] / 1000.0:.2f} s beyond its median rank" + (
        f" ({share:.0%} of its time)" if share is not None else "")
    if e["kind"] == "rotating":
        ranks = ", ".join(str(r) for r in e["ranks"][:8])
        msg = f"Rotating straggler over {where}: the late rank moved between ranks {ranks}; {cost}."
    else:
        span = e["steps"] / max(result["observed_steps"], 1)
        msg = (f"{e['kind'].capitalize()} straggler: rank {e['rank']} was late in {e['straggled_steps']} of "
               f"{where} ({span:.0%} of the run); {cost}.")
    if len(eps) > 1:
        kinds = Counter(x["kind"] for x in eps)
        msg += " " + ", ".join(f"{n} {k}" for k, n in kinds.items()) + f" episode{'s' if len(eps) > 1 else ''} in all."
    severe = share is not None and share >= tree.thresholds["straggler_episode_min_share"]
    return {"id": f"straggler_{e['kind']}", "severity": "warning" if severe else "info", "message": msg,
            "advice": _ADVICE[e["kind"]],
            "evidence": {"episodes": len(eps), "kind": e["kind"], "rank": e["rank"], "first_step": e["first_step"],
                         "last_step": e["last_step"], "cost_ms": e["cost_ms"], "share_of_job_time": share,
                         "noise_ms": result["noise_ms"], "threshold_ms": result["threshold_ms"]}}
