"""The core every layer reads numbers through (analyzers/numbers.py, analyzers/dtypes.py):
damaged documents give no value, never a wrong one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diag.analyzers.dtypes import element_bytes
from diag.analyzers.numbers import finite, finite_values, median, number, percent


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


def test_a_number_keeps_infinities_and_drops_nan():
    """memory_to_compute on steps with no compute is +inf: a measurement, not damage."""
    assert number(math.inf) == math.inf and number(-math.inf) == -math.inf and number(2) == 2.0
    assert number(10**400) == math.inf and number(-(10**400)) == -math.inf
    for bad in (True, None, "1", math.nan, [1]):
        assert number(bad) is None, bad


def test_a_rank_with_no_compute_keeps_its_infinite_memory_to_compute():
    """The memory demo's ranks: memory 91% of the step, compute none. The tree's memory question
    reads memory_to_compute, +inf here; dropping it left the job without a verdict."""
    from diag.analyzers.diagnosis import decision_tree as dt
    from diag.analyzers.diagnosis.verdict import rank_measurements

    shares = {"data_share": 0.0, "host_share": 0.04, "comm_share": 0.006, "wait_share": 0.04,
              "memory_share": 0.914, "compute_share": 0.0}
    from diag.analyzers.analysis_types import TraceRankFacts

    m = rank_measurements(TraceRankFacts(measurements={**shares, "memory_to_compute": math.inf}))
    assert m["memory_to_compute"] == math.inf
    assert dt.verdict_from(m, dt.load_tree())["bound"] == "memory"


@pytest.mark.parametrize("x, digits, signed, text", [(0.1234, 0, False, "12%"), (0.1234, 1, False, "12.3%"),
                                                      (-0.05, 1, True, "-5.0%"), (0.05, 1, True, "+5.0%"),
                                                      (None, 1, True, "n/a")])
def test_a_share_is_written_as_a_percentage(x, digits, signed, text):
    assert percent(x, digits, signed) == text


@pytest.mark.parametrize("name, size", [
    ("float", 4), ("c10::BFloat16", 2), ("long int", 8), ("c10::Float8_e4m3fn", 1),  # Kineto's c10 names
    ("Float", 4), ("BFloat16", 2), ("Long", 8),  # the process group's records
    ("float32", 4), ("int64", 8), ("bf16", 2), ("f8e5m2", 1),  # torch's and nccl-tests'
    ("Scalar", None), ("TensorList", None), ("", None), (None, None), (4, None),
])
def test_every_spelling_of_a_dtype_has_its_element_size(name, size):
    assert element_bytes(name) == size
