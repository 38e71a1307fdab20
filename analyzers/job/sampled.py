"""Verdicts of the steps outside profiler windows ("sampled" evidence).

Outside windows the decision tree runs on what the agent always measures (data wait
from `agent.loader()`, step time, device utilisation from NVML/amdsmi) and on the
composition of the most recent window, which tells how the device's busy time splits
between communication, bandwidth-bound and compute-bound work.

The sampled attribution keeps the window's proportions rather than its absolute times,
because profiled steps run slower than unprofiled ones (the profiler's own cost), and
absolute times from a window would overstate the device's share of a normal step.

The agent calls `sampled_verdict` live for each step; the run analysis gives a whole
rank's sampled steps their verdicts at once (`sampled_batch`), which is the same
decision computed for many steps together.
"""

from __future__ import annotations

import math

import numpy as np

from diag.analyzers.diagnosis.decision_tree import CLASSES, Walker, share_ratios, verdict_from

# The classes of a step's non-data time, and of its busy time (a collective waiting for a
# peer occupies the device or gloo's thread as its transfer does).
NON_DATA = ("host", "comm", "wait", "memory", "compute")
BUSY = ("comm", "wait", "memory", "compute")
# A device sample further than this from a step's middle does not describe the step.
SAMPLE_MATCH_S = 5.0


def window_composition(analysis: dict | None) -> dict | None:
    """How a window's steps split their non-data time, from the trace analyzer's rank dict."""
    if not isinstance(analysis, dict):
        return None
    acc = dict.fromkeys(CLASSES, 0.0)
    total = 0.0
    for s in analysis.get("steps") or []:
        sh, d = s.get("shares"), s.get("duration_ms")
        if not isinstance(sh, dict) or not isinstance(d, (int, float)) or d <= 0:
            continue
        total += d
        for b in CLASSES:
            acc[b] += float(sh.get(b) or 0.0) * d
    if total <= 0:
        return None
    mean = {b: acc[b] / total for b in CLASSES}
    non_data = 1.0 - mean["data"]
    if non_data <= 1e-9:
        return None
    busy = sum(mean[b] for b in BUSY)
    comp = {
        "non_data": {b: mean[b] / non_data for b in NON_DATA},
        "busy_split": {b: (mean[b] / busy if busy > 0 else 0.0) for b in BUSY},
        "achieved_bw_frac": _path_value(analysis.get("path"), "achieved_bw_frac"),
        # Waiting is only known where the window's collectives were matched across ranks.
        "wait_measured": bool((analysis.get("wait_split") or {}).get("measured")),
    }
    return comp


def _path_value(path, metric: str):
    for node in path or []:
        if isinstance(node, dict) and node.get("metric") == metric and isinstance(node.get("value"), (int, float)):
            return float(node["value"])
    return None


def sampled_shares(
    duration_s: float | None,
    data_wait_s: float | None,
    utilization: float | None,
    composition: dict | None,
) -> tuple[dict | None, dict]:
    """(the five shares or None, the tree measurements) of one step without a trace."""
    m: dict = {}
    if not isinstance(duration_s, (int, float)) or duration_s <= 0:
        return None, m
    data = min(max((data_wait_s or 0.0) / duration_s, 0.0), 1.0)
    if data_wait_s is not None:
        m["data_share"] = data
    rest = 1.0 - data
    if utilization is not None:
        busy = min(max(float(utilization), 0.0), rest)
        host = rest - busy
        m["busy_share"] = busy
        m["host_share"] = host
        if composition is None:
            return None, m
        split = composition["busy_split"]
        shares = {"data": data, "host": host, **{b: busy * split.get(b, 0.0) for b in BUSY}}
    elif composition is not None:
        nd = composition["non_data"]
        shares = {"data": data, **{b: rest * nd.get(b, 0.0) for b in NON_DATA}}
    else:
        return None, m
    m.update({f"{b}_share": v for b, v in shares.items() if b != "wait" or composition.get("wait_measured")})
    m.update(share_ratios(shares))
    if composition.get("achieved_bw_frac") is not None:
        m["achieved_bw_frac"] = composition["achieved_bw_frac"]
    return shares, m


def sampled_verdict(record: dict, sample: dict | None, composition: dict | None, tree) -> dict:
    """Verdict of one step record from always-on measurements (evidence "sampled")."""
    util = None
    gpu = (sample or {}).get("gpu") if isinstance(sample, dict) else None
    if isinstance(gpu, dict) and isinstance(gpu.get("utilization_ratio"), (int, float)):
        util = float(gpu["utilization_ratio"])
        if not math.isfinite(util):  # a failed reading is no reading
            util = None
    shares, m = sampled_shares(record.get("duration_s"), record.get("data_wait_s"), util, composition)
    if not m:
        return {"bound": None, "shares": None, "path": [], "evidence": "sampled"}
    v = verdict_from(m, tree)
    return {"bound": v["bound"], "shares": shares, "path": v["path"], "evidence": "sampled"}


NO_SAMPLE = -1


def _plain_number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def sample_utilization(samples: list[dict]) -> np.ndarray:
    out = np.full(len(samples), np.nan)
    for i, s in enumerate(samples):
        gpu = s.get("gpu")
        if isinstance(gpu, dict) and isinstance(gpu.get("utilization_ratio"), (int, float)):
            v = float(gpu["utilization_ratio"])
            if math.isfinite(v):  # as sampled_verdict: a failed reading is no reading
                out[i] = v
    return out


def nearest_samples(times: np.ndarray, mids: np.ndarray) -> np.ndarray:
    """Index of the sample nearest each time (the earlier one on a tie), or -1 beyond SAMPLE_MATCH_S."""
    if len(times) == 0:
        return np.full(len(mids), NO_SAMPLE, dtype=np.int64)
    i = np.searchsorted(times, mids, side="left")
    lo = np.clip(i - 1, 0, len(times) - 1)
    hi = np.clip(i, 0, len(times) - 1)
    d_lo = np.where(i - 1 >= 0, np.abs(times[lo] - mids), np.inf)
    d_hi = np.where(i < len(times), np.abs(times[hi] - mids), np.inf)
    best = np.where(d_lo <= d_hi, lo, hi)
    return np.where(np.abs(times[best] - mids) <= SAMPLE_MATCH_S, best, NO_SAMPLE)


def sampled_batch(recs: list[dict], comp_of: list, util: np.ndarray, tree, walker: Walker) -> list:
    """Per record: (bound, shares, sig) for the records the vectorised path covers, else None."""
    n = len(recs)
    out: list = [None] * n
    ok = [i for i, r in enumerate(recs)
          if _plain_number(r.get("duration_s")) and r["duration_s"] > 0
          and (r.get("data_wait_s") is None or _plain_number(r["data_wait_s"]))]
    if not ok:
        return out
    idx = np.array(ok, dtype=np.int64)
    dur = np.array([float(recs[i]["duration_s"]) for i in ok])
    dw_raw = [recs[i].get("data_wait_s") for i in ok]
    has_dw = np.array([w is not None for w in dw_raw])
    dw = np.array([float(w or 0.0) for w in dw_raw])
    u = util[idx]
    has_u = ~np.isnan(u)
    # The few distinct window compositions, indexed per row (-1: none, the table's last entry).
    table: list[dict] = []
    seen: dict[int, int] = {}
    cid = []
    for i in ok:
        c = comp_of[i]
        if c is None:
            cid.append(-1)
            continue
        k = seen.get(id(c))
        if k is None:
            k = seen[id(c)] = len(table)
            table.append(c)
        cid.append(k)
    cidx = np.array(cid, dtype=np.int64)
    has_c = cidx >= 0
    m = len(ok)

    def per_row(values: list) -> np.ndarray:
        return np.array([*values, np.nan], dtype=float)[cidx]

    def split(key: str, b: str) -> np.ndarray:
        return per_row([c[key][b] for c in table])

    data = np.minimum(np.maximum(dw / dur, 0.0), 1.0)
    rest = 1.0 - data
    busy = np.minimum(np.maximum(np.where(has_u, u, 0.0), 0.0), rest)
    host_u = rest - busy
    nan = np.full(m, np.nan)
    shares = {"data": data}
    with np.errstate(invalid="ignore"):
        shares["host"] = np.where(has_u, host_u, rest * split("non_data", "host"))
        for b in BUSY:
            shares[b] = np.where(has_u, busy * split("busy_split", b), rest * split("non_data", b))
    has_shares = has_c
    cols = {
        "data_share": np.where(has_dw | has_shares, data, nan),
        "busy_share": np.where(has_u, busy, nan),
        "host_share": np.where(has_u | has_shares, shares["host"], nan),
    }
    for b in BUSY:
        cols[f"{b}_share"] = np.where(has_shares, shares[b], nan)
    wait_known = per_row([1.0 if c.get("wait_measured") else np.nan for c in table])
    cols["wait_share"] = cols["wait_share"] * wait_known
    mem, cmp_ = cols["memory_share"], cols["compute_share"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(cmp_ > 0, mem / np.where(cmp_ > 0, cmp_, 1.0), np.where(mem > 0, np.inf, nan))
    cols["memory_to_compute"] = np.where(has_shares, ratio, nan)
    bw = per_row([c["achieved_bw_frac"] if c.get("achieved_bw_frac") is not None else np.nan for c in table])
    cols["achieved_bw_frac"] = np.where(has_shares, bw, nan)
    # Derived as decision_tree.derive does.
    derived_busy = (cols["comm_share"] + np.nan_to_num(cols["wait_share"]) + cols["memory_share"]
                    + cols["compute_share"])
    cols["busy_share"] = np.where(np.isnan(cols["busy_share"]), derived_busy, cols["busy_share"])
    ds, hs = cols["data_share"], cols["host_share"]
    idle = ds + hs
    with np.errstate(divide="ignore", invalid="ignore"):
        cols["data_fraction_of_idle"] = np.where(idle > 0, ds / np.where(idle > 0, idle, 1.0), 0.0)
    cols["data_fraction_of_idle"][np.isnan(idle)] = np.nan

    sig, verdict = walker.walk(cols, m)
    sig_l = sig.tolist()
    guessed = {k: walker.guessed(k) for k in set(sig_l)}  # once per distinct path, not per step
    bound = [None if guessed[k] else b for k, b in zip(sig_l, verdict)]
    empty = ~(has_dw | has_u | has_shares)  # no measurement at all: no verdict, empty path
    share_rows = np.column_stack([shares[b] for b in CLASSES]).tolist()
    empty_l, has_sh_l = empty.tolist(), has_shares.tolist()
    for j, i in enumerate(ok):
        if empty_l[j]:
            out[i] = (None, None, ())
        elif has_sh_l[j]:
            out[i] = (bound[j], dict(zip(CLASSES, share_rows[j])), walker.sigs[sig_l[j]])
        else:
            out[i] = (bound[j], None, walker.sigs[sig_l[j]])
    return out
