"""The one rule on which rank sets a job's pace.

In a job synchronised by collectives every rank leaves a collective when the last one
arrives, so a step lasts as long as the slowest rank's own work: its *pace*, its step less
its waiting for peers. The rank with the longest pace sets it, when it leads the other
ranks' median by more than the noise bands of both (the interval of each median,
`steady.median_half_width`); where no rank leads by that much, no rank is named (a
synchronised job whose waits were not measured looks so, and so do ranks within noise).
A named straggler is the rank the others wait for, so it sets the pace whatever its lead.

The job verdict takes its measurements from the pace-setting ranks (`verdict.py`) and
`diag top` names the pace-setting rank (`live.py`), both by this rule. The what-if's critical
path (`whatif/job.py`) is no judgement: it is the path the replay follows, through the rank
whose pace is longest in each step, and it names the rank that is so in most steps.
"""

from __future__ import annotations

import statistics

from diag.analyzers.diagnosis.steady import median_half_width


def pace_setter(paces: dict[int, float], bands: dict[int, float]) -> int | None:
    """The rank setting the pace from each rank's pace (ms) and the noise band of it (ms):
    the longest, when it leads the others' median by more than its band and their median
    band; None with fewer than two ranks or no such lead. Ties go to the lower rank."""
    if len(paces) < 2:
        return None
    top = max(paces, key=lambda r: (paces[r], -r))
    peers = [r for r in paces if r != top]
    lead = paces[top] - statistics.median(paces[r] for r in peers)
    band = bands.get(top, 0.0) + statistics.median(bands.get(r, 0.0) for r in peers)
    return top if lead > band else None


def band(values, z: float) -> float:
    """The noise band of a rank's pace from its recent step times (0.0 with too few)."""
    return median_half_width(list(values), z) or 0.0
