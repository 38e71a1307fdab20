"""Property tests of diag.analyzers.intervals against a brute-force reference on a grid.

Random interval sets with integer endpoints on [0, GRID) are turned into boolean
occupancy arrays of unit cells; every operation must agree with the same operation on
the arrays, and every result must be normalized (sorted, disjoint, non-touching, non-empty).
"""

from __future__ import annotations

import numpy as np
import pytest

from diag.analyzers import intervals as iv

GRID = 60
CASES = 200


def random_rows(rng, max_rows=8):
    n = int(rng.integers(0, max_rows + 1))
    a = rng.integers(0, GRID, size=n)
    b = rng.integers(0, GRID, size=n)
    # Include empty and reversed rows on purpose: normalize must drop them.
    return np.stack([a, b], axis=1).astype(float) if n else np.empty((0, 2))


def cells(rows) -> np.ndarray:
    occ = np.zeros(GRID, dtype=bool)
    for s, e in np.asarray(rows).reshape(-1, 2):
        if e > s:
            occ[int(s):int(e)] = True
    return occ


def assert_normalized(x):
    assert x.ndim == 2 and x.shape[1] == 2
    if len(x):
        assert np.all(x[:, 1] > x[:, 0]), "empty row survived"
        assert np.all(x[1:, 0] > x[:-1, 1]), "rows overlap, touch or are unsorted"


@pytest.fixture(scope="module")
def cases():
    rng = np.random.default_rng(20261120)
    return [(random_rows(rng), random_rows(rng), random_rows(rng)) for _ in range(CASES)]


def test_normalize_matches_cells(cases):
    for a, _, _ in cases:
        n = iv.normalize(a)
        assert_normalized(n)
        assert np.array_equal(cells(n), cells(a))
        assert iv.total(n) == cells(a).sum()


def test_from_arrays_equals_normalize(cases):
    for a, _, _ in cases:
        assert np.array_equal(iv.from_arrays(a[:, 0], a[:, 1]), iv.normalize(a))


def test_union_intersect_subtract(cases):
    for a, b, c in cases:
        na, nb, nc = iv.normalize(a), iv.normalize(b), iv.normalize(c)
        u = iv.union(na, nb, nc)
        i = iv.intersect(na, nb)
        d = iv.subtract(na, nb)
        for x in (u, i, d):
            assert_normalized(x)
        assert np.array_equal(cells(u), cells(a) | cells(b) | cells(c))
        assert np.array_equal(cells(i), cells(a) & cells(b))
        assert np.array_equal(cells(d), cells(a) & ~cells(b))


def test_clip_and_total(cases):
    rng = np.random.default_rng(7)
    for a, _, _ in cases:
        lo, hi = sorted(rng.integers(0, GRID, size=2).tolist())
        na = iv.normalize(a)
        cl = iv.clip(na, lo, hi)
        assert_normalized(cl)
        ref = cells(a).copy()
        ref[:lo] = False
        ref[hi:] = False
        assert np.array_equal(cells(cl), ref)
        assert iv.total(cl) == ref.sum()


def test_measure_in_windows_matches_clip(cases):
    rng = np.random.default_rng(11)
    for a, _, _ in cases:
        na = iv.normalize(a)
        w = np.sort(rng.integers(0, GRID, size=(5, 2)), axis=1).astype(float)  # may overlap, may be empty
        got = iv.measure_in_windows(na, w)
        want = [cells(a)[int(lo):int(hi)].sum() for lo, hi in w]
        assert np.allclose(got, want)


def test_measure_in_windows_fractional():
    a = iv.normalize([[0.5, 1.25], [2.0, 3.75]])
    got = iv.measure_in_windows(a, np.array([[0.0, 1.0], [1.0, 3.0], [0.75, 3.5], [4.0, 5.0]]))
    assert np.allclose(got, [0.5, 1.25, 2.0, 0.0])


def test_exclusive_by_priority_partitions_the_window(cases):
    rng = np.random.default_rng(3)
    for a, b, c in cases:
        lo, hi = sorted(rng.integers(0, GRID, size=2).tolist())
        window = iv.normalize([[lo, hi]])
        layers = [("x", iv.normalize(a)), ("y", iv.normalize(b)), ("z", iv.normalize(c))]
        parts = iv.exclusive_by_priority(layers, window, "rest")
        win = cells([[lo, hi]])
        # Brute force: first layer covering a cell wins, else rest.
        ref_x = win & cells(a)
        ref_y = win & cells(b) & ~cells(a)
        ref_z = win & cells(c) & ~cells(a) & ~cells(b)
        ref_rest = win & ~cells(a) & ~cells(b) & ~cells(c)
        for name, ref in (("x", ref_x), ("y", ref_y), ("z", ref_z), ("rest", ref_rest)):
            assert_normalized(parts[name])
            assert np.array_equal(cells(parts[name]), ref), name
        assert sum(iv.total(p) for p in parts.values()) == hi - lo


def test_exclusive_by_priority_repeated_names_merge():
    w = iv.normalize([[0, 10]])
    parts = iv.exclusive_by_priority([("a", iv.normalize([[0, 2]])), ("a", iv.normalize([[2, 4]]))], w, "a")
    assert np.array_equal(parts["a"], np.array([[0.0, 10.0]]))


def test_empty_inputs():
    e = iv.EMPTY
    assert iv.union() is iv.EMPTY or len(iv.union()) == 0
    assert len(iv.intersect(e, iv.normalize([[0, 1]]))) == 0
    assert np.array_equal(iv.subtract(iv.normalize([[0, 1]]), e), np.array([[0.0, 1.0]]))
    assert iv.total(e) == 0.0
    assert iv.measure_in_windows(e, np.array([[0, 1]])).tolist() == [0.0]
    assert len(iv.clip(iv.normalize([[0, 5]]), 3, 3)) == 0


def test_window_of_each_timestamp():
    windows = np.array([[0.0, 10.0], [10.0, 15.0], [20.0, 30.0]])
    ts = np.array([-1.0, 0.0, 9.99, 10.0, 15.0, 19.0, 20.0, 29.9, 30.0])
    assert iv.window_of(ts, windows).tolist() == [-1, 0, 0, 1, -1, -1, 2, 2, -1]
    assert iv.window_of(ts, np.empty((0, 2))).tolist() == [-1] * len(ts)
    assert iv.window_of(np.empty(0), windows).tolist() == []


def test_index_of_ids_dense_and_sparse():
    from diag.analyzers.trace.columns import index_of

    want = np.array([3, 9, 4, -1, 5])
    # A negative key is no id; an absent or negative wanted id is -1; a huge id takes the search path.
    assert index_of(np.array([5, -1, 3, 9]), want).tolist() == [2, 3, -1, -1, 0]
    assert index_of(np.array([5, -1, 3, 10 ** 12]), want).tolist() == [2, -1, -1, -1, 0]
    assert index_of(np.array([-1]), want).tolist() == [-1] * 5


def test_span_holding_looks_only_at_spans_of_the_points_own_group():
    start, end, groups = np.array([10.0, 0.0, 0.0]), np.array([20.0, 5.0, 30.0]), np.array([1, 1, 2])
    ts = np.array([0.0, 5.0, 5.5, 20.0, 20.5, 25.0, 25.0])
    on = np.array([1, 1, 1, 1, 1, 2, 3])
    # Closed spans: their ends hold; a gap holds nothing; a group without spans gets none.
    assert iv.span_holding(ts, on, start, end, groups).tolist() == [1, 1, -1, 0, -1, 2, -1]


@pytest.mark.parametrize("spread", [1, 10**9])  # dense ids (a table by id), sparse ones (binary search)
def test_each_wanted_id_is_found_at_its_row(spread):
    from diag.analyzers.trace.columns import index_of

    keys = np.array([5, -1, 7, 3, -1, 11], dtype=np.int64) * spread
    want = np.array([7, 3, 4, -1, 11, 12, 5], dtype=np.int64) * spread
    assert index_of(keys, want).tolist() == [2, 3, -1, -1, 5, -1, 0]
    assert index_of(np.array([-1, -2]), want).tolist() == [-1] * len(want)
