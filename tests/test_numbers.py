"""The core every layer reads numbers through (analyzers/numbers.py): damaged documents give
no value, never a wrong one."""

from __future__ import annotations

import math

import numpy as np

from diag.analyzers.numbers import finite, finite_values, median


def test_only_finite_reals_are_values():
    assert finite(1.5) == 1.5 and finite(3) == 3.0 and type(finite(3)) is float
    assert finite(np.float32(2.5)) == 2.5 and finite(np.int64(7)) == 7.0
    for bad in (True, False, None, "1.0", math.nan, math.inf, -math.inf, 10**400, [1.0], {"x": 1}):
        assert finite(bad) is None, bad


def test_median_of_what_is_finite():
    assert median([3, 1, 2]) == 2.0 and median([4, 1, 3, 2]) == 2.5
    assert median([1.0, math.nan, None, "9", True, 5.0]) == 3.0
    assert median([]) is None and median([math.nan]) is None
    assert finite_values(x for x in [1, None, 2.5]) == [1.0, 2.5]
