"""The small core every layer reads documents through: a value as a finite float or nothing,
the median of what is finite, a share written as a percentage, and a section as a dict or an
empty one. Documents come from
files a user may have damaged, so a bool, a string, NaN or an infinity is never a value, and a
section that is not a mapping is empty.

Neutral: the analysis, the diagnosis, the views and the agent import it; it imports nothing
of diag.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Iterable, Mapping
from typing import Any


def finite(v) -> float | None:
    """`v` as a float when it is a finite real number (numpy scalars included), else None."""
    t = type(v)
    if t is float:
        return v if v - v == 0.0 else None  # False for NaN and +-Inf; the common case first
    if t is bool or not isinstance(v, numbers.Real):
        return None
    try:
        v = float(v)
    except OverflowError:  # an int past any float
        return None
    return v if math.isfinite(v) else None


def number(v) -> float | None:
    """`v` as a float when it is a real number other than NaN: an infinity is kept (a ratio
    over a share of zero, such as memory_to_compute on a step with no compute, is one)."""
    if type(v) is bool or not isinstance(v, numbers.Real):
        return None
    try:
        v = float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf  # type: ignore[operator]  # a Real compares with 0
    return None if v != v else v


def finite_values(values: Iterable) -> list[float]:
    """The finite values, as floats, in their order; the rest left out."""
    return [x for x in map(finite, values) if x is not None]


def median(values: Iterable) -> float | None:
    """The median of the finite values (the mean of the two middle ones for an even count);
    None when there is none."""
    vals = finite_values(values)
    return float(statistics.median(vals)) if vals else None


def percent(x: float | None, digits: int = 0, signed: bool = False) -> str:
    """A share as the pages and sentences write it: 0.123 is "12%" (digits=0), "+12.3%" signed
    with digits=1; "n/a" for an unknown one."""
    if x is None:
        return "n/a"
    return f"{x * 100:+.{digits}f}%" if signed else f"{x * 100:.{digits}f}%"


def dict_at(doc: Mapping[str, Any], key: str) -> dict:
    """doc[key] where it is a dict, else an empty one."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}
