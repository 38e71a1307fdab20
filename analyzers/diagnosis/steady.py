"""A run's steady state: which steps are warm-up, and how much the rest scatter.

One warm-up rule and one noise estimate serve every judgement that needs them: the rank's
measurement set, borderline verdicts, and whether a change between two runs is real.

- Warm-up: the steps before a rank's first profiler window (the profiler's own schedule
  skips start-up); without windows, the first `warmup_fraction` of the steps, at least one
  and at most `warmup_max_steps`, none in a run shorter than `warmup_min_run_steps`
  (`model.warmup_steps`, which the run analysis counts its steps by too).
- Noise: the robust spread of the steps themselves (1.4826 x the median absolute
  deviation: a normal sample's standard deviation, unmoved by a few outlier steps), and
  from it the interval of a median (its standard error is about 1.2533 sigma / sqrt(n)).
"""

from __future__ import annotations

import math
import statistics

from diag.analyzers.model import warmup_steps  # noqa: F401 (the warm-up rule, read through here)
from diag.analyzers.numbers import finite_values as _finite

MAD_TO_SIGMA = 1.4826
MEDIAN_SE = 1.2533  # standard error of a median, in sigma / sqrt(n), for a normal sample
MIN_STEPS = 3  # fewer steps give no spread worth the name
Z_95 = 1.959964


def robust_sigma(values) -> float | None:
    """1.4826 x MAD of the finite values; None for fewer than MIN_STEPS of them."""
    vals = _finite(values)
    if len(vals) < MIN_STEPS:
        return None
    med = statistics.median(vals)
    return MAD_TO_SIGMA * statistics.median(abs(v - med) for v in vals)


def median_standard_error(values) -> float | None:
    """The standard error of the finite values' median; None for fewer than MIN_STEPS of them."""
    vals = _finite(values)
    sigma = robust_sigma(vals)
    return None if sigma is None else MEDIAN_SE * sigma / math.sqrt(len(vals))


def median_half_width(values, z: float = Z_95) -> float | None:
    """Half the width of the interval of the values' median (z standard errors)."""
    se = median_standard_error(values)
    return None if se is None else z * se


def interval_level(z: float) -> float:
    """The share of a normal distribution within z standard errors (0.95 for 1.96)."""
    return math.erf(z / math.sqrt(2.0))


def median_ratio_interval(before, after, z: float = Z_95) -> tuple[float, float, float]:
    """(median(after) / median(before), low, high): the interval from both medians' standard
    errors, combined on the log scale (the ratio's relative errors add in quadrature)."""
    mb, ma = statistics.median(before), statistics.median(after)
    ratio = ma / mb
    rel = math.hypot(_relative_se(before, mb), _relative_se(after, ma))
    return ratio, ratio * math.exp(-z * rel), ratio * math.exp(z * rel)


def level_drift(values, blocks: int = 4, min_block: int = 4) -> float | None:
    """How far a run's own pace wanders, relative to its median: the standard deviation of the
    medians of `blocks` consecutive blocks of its steps (None with fewer than `min_block` steps
    a block). A rerun on the same machine can land anywhere within about this much: the
    machine's load changes over minutes, which the step-to-step scatter does not show."""
    vals = _finite(values)
    size = len(vals) // blocks
    if size < min_block:
        return None
    medians = [statistics.median(vals[i * size:(i + 1) * size]) for i in range(blocks)]
    whole = statistics.median(vals)
    return statistics.stdev(medians) / whole if whole > 0 else None


def level(values) -> dict | None:
    """A run's level, all a comparison with another run needs of its steady values:
    {"steps", "median", "relative_se" (the median's standard error over it), "drift"
    (level_drift, 0 where too few steps)}; None without a positive median."""
    vals = _finite(values)
    if not vals:
        return None
    med = statistics.median(vals)
    if med <= 0:
        return None
    return {"steps": len(vals), "median": med, "relative_se": _relative_se(vals, med),
            "drift": level_drift(vals) or 0.0}


_MAX_LOG_SPREAD = 700.0  # math.exp overflows past about 709.8


def levels_ratio_interval(before: dict, after: dict, z: float = Z_95) -> tuple[float, float, float]:
    """(after's median over before's, low, high): median_ratio_interval widened by each run's
    drift, the interval of two runs' levels rather than of two samples of one level."""
    ratio = after["median"] / before["median"]
    rel = math.hypot(before["relative_se"], after["relative_se"], before["drift"], after["drift"])
    # A spread past what a float holds (a damaged saved level) is an unbounded interval.
    spread = min(z * rel, _MAX_LOG_SPREAD)
    return ratio, ratio * math.exp(-spread), ratio * math.exp(spread)




def _relative_se(values, median: float) -> float:
    return (median_standard_error(values) or 0.0) / median if median > 0 else 0.0
