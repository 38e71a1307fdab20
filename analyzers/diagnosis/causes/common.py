"""What the cause rules share: rank lists and times as the causes quote them, the traced
steps' durations, and the DataLoader settings the agents recorded."""

from __future__ import annotations

from diag.analyzers.analysis_types import RankFacts
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import recorded_loader, traced_durations


def ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def upper_median(vals: list[float]) -> float | None:
    """The middle value, the upper of the two middle ones for an even count: always a value
    that was measured."""
    vals = sorted(vals)
    return vals[len(vals) // 2] if vals else None


def traced_step_ms(facts: RankFacts) -> float | None:
    """The median duration of the rank's traced steps."""
    return upper_median(traced_durations(facts))


def traced_mean_ms(facts: RankFacts) -> float | None:
    """The mean duration of the rank's traced steps: what per-step facts (totals over the
    traced steps, divided by their count) are shares of."""
    vals = traced_durations(facts)
    return sum(vals) / len(vals) if vals else None


def times_text(n: float) -> str:
    return "once" if round(n, 2) == 1 else f"{round(n, 2):g} times"


def ms_text(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms:.2f} ms"


def recorded_loaders(ctx: JobContext) -> dict[int, dict]:
    """The DataLoader settings each rank's agent recorded (rank -> settings)."""
    out = {}
    for rank, merged in ctx.ranks.items():
        loader = recorded_loader(merged.facts)
        if isinstance(loader, dict) and isinstance(loader.get("num_workers"), int):
            out[rank] = loader
    return out
