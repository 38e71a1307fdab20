"""Interval algebra on numpy arrays: the one module every time attribution shares.

An interval set is a float64 array of shape (n, 2) whose rows are [start, end),
sorted, disjoint and non-empty ("normalized"). Every function takes and returns
normalized sets, except `normalize`, which makes one from arbitrary rows.
Times are in whatever unit the caller uses (microseconds for Kineto traces).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EMPTY = np.empty((0, 2), dtype=np.float64)


def from_arrays(starts, ends) -> np.ndarray:
    """Rows [start, end) from two arrays, normalized."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    return normalize(np.stack([s, e], axis=1) if s.size else EMPTY)


def normalize(rows) -> np.ndarray:
    """Sort, drop empty rows and merge overlapping or touching ones."""
    iv = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    iv = iv[iv[:, 1] > iv[:, 0]]
    if len(iv) <= 1:
        return iv.copy() if len(iv) else EMPTY
    if not (np.all(iv[1:, 0] >= iv[:-1, 0])):
        iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])
    first = np.empty(len(iv), dtype=bool)
    first[0] = True
    first[1:] = iv[1:, 0] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.r_[heads[1:] - 1, len(iv) - 1]
    return np.stack([iv[heads, 0], reach[tails]], axis=1)


def union(*sets: np.ndarray) -> np.ndarray:
    parts = [s for s in sets if len(s)]
    if not parts:
        return EMPTY
    return normalize(np.concatenate(parts))


def _sweep(a: np.ndarray, b: np.ndarray, keep) -> np.ndarray:
    """Elementary segments between all boundaries of a and b, kept where keep(in_a, in_b)."""
    if not len(a) and not len(b):
        return EMPTY
    pts = np.concatenate([a.ravel(), b.ravel()])
    da = np.zeros(len(pts), dtype=np.int8)
    db = np.zeros(len(pts), dtype=np.int8)
    na = a.size
    da[:na:2], da[1:na:2] = 1, -1
    db[na::2], db[na + 1 :: 2] = 1, -1
    order = np.argsort(pts, kind="stable")
    pts, da, db = pts[order], da[order], db[order]
    in_a = np.cumsum(da)[:-1] > 0
    in_b = np.cumsum(db)[:-1] > 0
    sel = keep(in_a, in_b) & (pts[1:] > pts[:-1])
    return normalize(np.stack([pts[:-1][sel], pts[1:][sel]], axis=1))


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if not len(a) or not len(b):
        return EMPTY
    return _sweep(a, b, lambda x, y: x & y)


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Parts of a not covered by b."""
    if not len(a) or not len(b):
        return a
    return _sweep(a, b, lambda x, y: x & ~y)


def clip(a: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return intersect(a, np.array([[lo, hi]], dtype=np.float64)) if hi > lo else EMPTY


def total(a: np.ndarray) -> float:
    return float(np.sum(a[:, 1] - a[:, 0])) if len(a) else 0.0


def window_of(ts: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Each timestamp's row in `windows` (sorted, disjoint [lo, hi) rows), or -1 outside them all."""
    if not len(windows) or not len(ts):
        return np.full(len(ts), -1, dtype=np.int64)
    k = np.searchsorted(windows[:, 0], ts, side="right") - 1
    inside = (k >= 0) & (ts < windows[np.maximum(k, 0), 1])
    return np.where(inside, k, -1)


def span_holding(ts: np.ndarray, groups: np.ndarray, start: np.ndarray, end: np.ndarray,
                 span_groups: np.ndarray) -> np.ndarray:
    """Each timestamp's span, as its index into start/end, among the spans of its own group
    (a thread), [start, end] closed, the spans of a group disjoint; -1 where none holds it."""
    out = np.full(len(ts), -1, dtype=np.int64)
    for g in np.unique(span_groups).tolist():
        mine = np.flatnonzero(span_groups == g)
        mine = mine[np.argsort(start[mine], kind="stable")]
        sel = np.flatnonzero(groups == g)
        i = np.searchsorted(start[mine], ts[sel], side="right") - 1
        hit = (i >= 0) & (ts[sel] <= end[mine[np.maximum(i, 0)]])
        out[sel[hit]] = mine[i[hit]]
    return out


def measure_in_windows(a: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Covered length of a inside each window row [lo, hi); windows may overlap.

    O((n + w) log n): a cumulative-length function evaluated at the window ends,
    so per-step totals never loop over steps in Python.
    """
    windows = np.asarray(windows, dtype=np.float64).reshape(-1, 2)
    if not len(a) or not len(windows):
        return np.zeros(len(windows))
    lengths = a[:, 1] - a[:, 0]
    before = np.r_[0.0, np.cumsum(lengths)]

    def covered_until(t):
        k = np.searchsorted(a[:, 0], t, side="right") - 1
        kk = np.clip(k, 0, len(a) - 1)
        partial = np.clip(t - a[kk, 0], 0.0, lengths[kk])
        return np.where(k < 0, 0.0, before[kk] + partial)

    return covered_until(windows[:, 1]) - covered_until(windows[:, 0])


def exclusive_by_priority(
    layers: Sequence[tuple[str, np.ndarray]], window: np.ndarray, rest: str
) -> dict[str, np.ndarray]:
    """Give every moment of `window` to exactly one name: the first layer covering it, else `rest`.

    This is the TensorBoard profiler plugin's rule: overlaps resolve in priority
    order, so the parts always add up to the window.
    """
    remaining = window
    out: dict[str, np.ndarray] = {}
    for name, layer in layers:
        taken = intersect(remaining, layer)
        out[name] = union(out[name], taken) if name in out else taken
        remaining = subtract(remaining, taken)
    out[rest] = union(out[rest], remaining) if rest in out else remaining
    return out
