"""What a cause's action is predicted to give once the user applies it: the step expected
with the change the cause names, with a range, kept apart from the ceiling (the replay with
the cause's time gone entirely).

Each model works out how much of the cause's measured time the action takes away, from
rates the run measured where it has them, else from the device's tables and the decision
tree's thresholds, and takes that share of the ceiling's replayed gain: taking away part of
the time a change removes wins that part of its gain, exactly where that time stays on the
step's critical path (a step bound by it). The DataLoader's worker count has its own model
(loader_model.py).
"""

from __future__ import annotations

import statistics

from diag.analyzers.analysis_types import PAGEABLE_HTOD_RE, RankFacts, TraceRankFacts
from diag.analyzers.diagnosis.context import JobContext
from diag.analyzers.diagnosis.inputs import traced_durations
from diag.analyzers.diagnosis.steady import level_drift, median_half_width, warmup_steps
from diag.analyzers.numbers import dict_at

PINNED_HTOD = "pinned"  # Kineto names a pinned copy "Memcpy HtoD (Pinned -> Device)"
HALF_TILE = 8  # elements of a 16-byte tensor-core row in a 2-byte dtype


def scaled_step(ceiling: dict | None, removed_ms: float, taken_ms: float) -> float | None:
    """The step when `taken_ms` of the `removed_ms` per step the ceiling's change removes is
    taken away; None without a replayed ceiling."""
    if not ceiling or removed_ms <= 0:
        return None
    base, ceil = ceiling.get("baseline_step_ms"), ceiling.get("predicted_step_ms")
    if not isinstance(base, (int, float)) or not isinstance(ceil, (int, float)) or base <= 0:
        return None
    return base - (base - ceil) * min(max(taken_ms / removed_ms, 0.0), 1.0)


def _expectation(action: str, ceiling: dict | None, removed_ms: float, taken: tuple[float, float, float],
                 assumes: str, facts: RankFacts, thresholds: dict) -> dict | None:
    """The prediction for an action taking away `taken` (expected, least, most) ms per step
    of the ceiling's `removed_ms`, carried over to the steps outside the profiler where the
    run has them."""
    expected, slow, fast = (scaled_step(ceiling, removed_ms, t) for t in taken)
    if ceiling is None or expected is None or slow is None or fast is None:
        return None
    base = float(ceiling["baseline_step_ms"])
    out = {"action": action, "baseline_step_ms": base, "expected_step_ms": expected,
           "low_ms": min(slow, fast), "high_ms": max(slow, fast), "ceiling_step_ms": ceiling["predicted_step_ms"],
           "limit": "rate", "assumes": assumes}
    plain = untraced_steps(facts, thresholds)
    carried = len(plain) >= 3 and base > 0
    ref = plain if carried else traced_durations(facts)
    ratio = statistics.median(plain) / base if carried else 1.0
    level = base * ratio
    spread = ((median_half_width(ref) or 0.0) + (level_drift(ref) or 0.0) * level) if ref else 0.0
    margin = thresholds["action_model_margin"]
    return {**out, "baseline_step_ms": level, "expected_step_ms": expected * ratio,
            "low_ms": max(0.0, out["low_ms"] * ratio - spread),
            "high_ms": out["high_ms"] * ratio * (1.0 + margin) + spread,
            "ceiling_step_ms": out["ceiling_step_ms"] * ratio,
            "assumes": assumes + (f"; carried over from the traced steps ({base:.1f} ms under the profiler) to the "
                                  f"{len(plain)} steps outside it" if carried else "")}


def untraced_steps(facts: RankFacts, thresholds: dict) -> list[float]:
    """The durations (ms) of a rank's steps outside the profiler's windows, warm-up left out."""
    rows = [(float(d), s.get("evidence")) for s in facts.steps
            if isinstance(d := s.get("duration_ms"), (int, float)) and not isinstance(d, bool)]
    rows = rows[warmup_steps(len(rows), thresholds):]
    return [d for d, evidence in rows if evidence != "trace" and d > 0]


def removal(action: str):
    """The model of an action that removes its cause's time entirely (the values read once
    per step instead of one at a time; no empty_cache() in the loop): its step is the ceiling's."""
    def model(ctx: JobContext, evidence: dict, ceiling: dict | None) -> dict | None:
        if not ceiling:
            return None
        return _expectation(action, ceiling, 1.0, (1.0, 1.0, 1.0),
                            "the action removes the cause's time from the step, as the ceiling does",
                            _facts(ctx, evidence), ctx.tree.thresholds)
    return model


def _facts(ctx: JobContext, evidence: dict) -> RankFacts:
    """The facts of the first rank a cause's evidence names (none: a rank without facts)."""
    ranks = evidence.get("ranks") or []
    return ctx.ranks[ranks[0]].facts if ranks and ranks[0] in ctx.ranks else TraceRankFacts()


def _pinned_rate(facts: RankFacts, thresholds: dict) -> tuple[float, str] | None:
    """The rate (bytes/s) a pinned host-to-device copy reaches on this rank, and where it comes
    from: the trace's own pinned copies, else the device's host link."""
    pinned = [c for c in facts.causes.copies if isinstance(c, dict) and "HtoD" in str(c.get("name"))
              and PINNED_HTOD in str(c.get("name")).lower() and c.get("mb_per_step") and c.get("ms_per_step")]
    mb, ms = sum(float(c["mb_per_step"]) for c in pinned), sum(float(c["ms_per_step"]) for c in pinned)
    if mb >= 1.0 and ms > 0:
        return mb * 1e6 / (ms / 1e3), "the trace's own pinned copies"
    link = (facts.device_info or {}).get("host_link_bw")
    if isinstance(link, (int, float)) and link > 0:
        share = thresholds["pinned_copy_link_share"]
        return link * share, f"{share:.0%} of the device's host link ({link / 1e9:.0f} GB/s each way)"
    return None


def pinned_copies(ctx: JobContext, evidence: dict, ceiling: dict | None) -> dict | None:
    """Pageable host-to-device copies made from pinned memory with non_blocking=True: each copy
    takes its bytes over the pinned rate on the device, and no longer holds the host."""
    facts = _facts(ctx, evidence)
    copies = [c for c in evidence.get("copies") or [] if PAGEABLE_HTOD_RE.search(str(c.get("name")))]
    mb = sum(float(c.get("mb_per_step") or 0.0) for c in copies)
    ms = sum(float(c.get("ms_per_step") or 0.0) for c in copies)
    rate = _pinned_rate(facts, ctx.tree.thresholds)
    if rate is None or mb <= 0 or ms <= 0:
        return None
    spread = ctx.tree.thresholds["pinned_copy_rate_spread"]

    def taken(r: float) -> float:
        return max(0.0, ms - mb * 1e6 / r * 1e3)

    bps, source = rate
    # A non_blocking copy runs while the host goes on launching: where the host's work outlasts
    # it, the copy is hidden entirely, the range's fast end.
    return _expectation(
        "pinned memory and non_blocking copies", ceiling, ms, (taken(bps), taken(bps * (1.0 - spread)), ms),
        f"the {mb:.1f} MB a step then cross at {bps / 1e9:.1f} GB/s ({source}) instead of the "
        f"{mb * 1e6 / (ms / 1e3) / 1e9:.1f} GB/s measured, in order with the device's work on the stream; the "
        "range reaches down to the copy hidden behind the host's work, which is the ceiling", facts,
        ctx.tree.thresholds)


def _half_rate(group: dict, healthy: float | None, thresholds: dict) -> tuple[float, bool]:
    """The fraction of the half-precision peak an fp32 group's op reaches under autocast, and
    whether its shape is one the half-precision tile divides."""
    dims = dict_at(group, "dims")
    tiled = all(int(v) % HALF_TILE == 0 for v in dims.values() if isinstance(v, int)) if dims else \
        not group.get("misaligned")
    if tiled:
        return (healthy or thresholds["half_precision_tiled_peak"]), True
    return thresholds["half_precision_untiled_peak"], False


def _healthy_half_fraction(groups: list[dict]) -> float | None:
    """The fraction of peak the trace's own half-precision matrix ops reach on tiled shapes,
    weighted by their time; None without any."""
    half = [g for g in groups if g.get("dtype") in ("bf16", "fp16") and g.get("peak_fraction")
            and g.get("ms_per_step") and not g.get("misaligned")]
    ms = sum(float(g["ms_per_step"]) for g in half)
    return sum(float(g["peak_fraction"]) * float(g["ms_per_step"]) for g in half) / ms if ms > 0 else None


def _ceiling_removed(math: dict, peaks: dict, fast: float) -> float:
    """What the ceiling's change (tensor_core_math) removes per step: the fp32 kernels, and the
    TF32 ones where the half-precision peak is higher, at that peak's fraction they reach now."""
    out = 0.0
    for kind in ("fp32", "tf32"):
        if peaks.get(kind) and peaks[kind] < fast:
            out += float(math.get(f"{kind}_ms_per_step") or 0.0) * (1.0 - peaks[kind] / fast)
    return out


def autocast(ctx: JobContext, evidence: dict, ceiling: dict | None) -> dict | None:
    """fp32 (or TF32) matrix ops run under bf16 autocast: each op group at the rate half
    precision reaches on its shapes (`_half_rate`) instead of its measured rate. The casts of
    fp32 operands (one pass over memory each) are left out: small beside large matrix ops."""
    th, facts = ctx.tree.thresholds, _facts(ctx, evidence)
    peaks = evidence.get("peaks_tflops") or {}
    kind, ms = evidence.get("precision"), float(evidence.get("ms_per_step") or 0.0)
    fast = peaks.get("bf16") or peaks.get("fp16")
    slow = peaks.get(kind) or peaks.get("fp32")
    groups = [g for g in ((facts.causes.matrix_ops or {}).get("groups") or []) if isinstance(g, dict)]
    mine = [g for g in groups if g.get("dtype") == "fp32" and g.get("tflops") and g.get("ms_per_step")]
    if not fast or not slow or not mine or ms <= 0:
        return None
    healthy = _healthy_half_fraction(groups)
    spread = th["half_precision_rate_spread"]

    def after(scale: float) -> float:
        """The groups' time per step with half precision at `scale` times its expected rate."""
        out = 0.0
        for g in mine:
            frac, _ = _half_rate(g, healthy, th)
            out += float(g["ms_per_step"]) * min(1.0, float(g["tflops"]) / (frac * scale * fast))
        return out

    covered = sum(float(g["ms_per_step"]) for g in mine)
    # Kernels of the precision without an op shape (no record_shapes) move as the groups do.
    share = ms / covered if covered > 0 else 1.0
    removed = _ceiling_removed(facts.causes.math or {}, peaks, fast)
    expected, least, most = (max(0.0, (covered - after(s)) * share) for s in (1.0, 1.0 - spread, 1.0 + spread))
    untiled = [g for g in mine if not _half_rate(g, healthy, th)[1]]
    half = "bf16" if peaks.get("bf16") else "fp16"  # V100: fp16 tensor cores only
    rates = (f"{healthy:.0%} of the {fast:g} TFLOP/s {half} peak (the trace's own half-precision matrix ops)"
             if healthy else f"{th['half_precision_tiled_peak']:.0%} of the {fast:g} TFLOP/s {half} peak")
    if untiled:
        rates += (f" on tiled shapes and {th['half_precision_untiled_peak']:.0%} on the "
                  f"{len(untiled)} op group(s) whose dimensions are not multiples of {HALF_TILE}")
    return _expectation(
        f"{half} autocast", ceiling, removed, (expected, least, most),
        f"the matrix ops then run at {rates}, against their measured {covered:.1f} ms; the casts to {half} are "
        "not counted; the ceiling is every such kernel at the half-precision peak's fraction it reaches now",
        facts, th)


def collective(ctx: JobContext, evidence: dict, ceiling: dict | None) -> dict | None:
    """The exposed collective's action. Where DDP all-reduces after every micro-batch, no_sync()
    on all but the last: its change replays exactly the all-reduces it leaves out, gone. Else
    the compression hook the backend runs, halving the bytes as the ceiling's change does, with
    the range down to half that gain for a collective partly bound by its latency; None where
    no hook pays (gloo)."""
    if evidence.get("micro_batches"):
        return removal("no_sync() on all but the last micro-batch")(ctx, evidence, ceiling)
    hook = evidence.get("compression_hook")
    if not hook or not ceiling:
        return None
    return _expectation(
        f"the {hook.split('_')[0]} compression hook", ceiling, 1.0, (1.0, 0.5, 1.0),
        "the collective's time halves with its bytes; the range's slow end is half that gain, for a collective "
        "partly bound by its latency; the casts before and after it are not counted", _facts(ctx, evidence),
        ctx.tree.thresholds)
