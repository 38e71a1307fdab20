"""Each ProfilerStep's window computed from a raw Kineto trace's events, by the rule of the
TensorBoard profiler plugin that diag follows: a step lasts until the device has run the work
its host span launched (matched by correlation id), and starts where the step before ended;
the first step starts after the device work queued before it (launched before the first step,
or with no launch in the trace and running before the first step's own work)."""

from __future__ import annotations

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "Runtime", "runtime")


def host_steps(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                  and e.get("cat") not in ("gpu_user_annotation",) and e.get("ph") == "X")


def launch_steps(events: list[dict]) -> dict[int, int]:
    """Correlation id -> the step whose host span holds the runtime call that made it; -1 for
    calls made before the first step. Calls between steps are left out."""
    steps = host_steps(events)
    out = {}
    for e in events:
        if e.get("cat") in RUNTIME_CATS and "correlation" in (e.get("args") or {}):
            k = -1 if steps and e["ts"] < steps[0][0] else next(
                (i for i, (lo, hi) in enumerate(steps) if lo <= e["ts"] < hi), None)
            if k is not None:
                out[e["args"]["correlation"]] = k
    return out


def device_step_windows(events: list[dict]) -> list[tuple[float, float]]:
    steps = host_steps(events)
    if not steps:
        return []
    launched = launch_steps(events)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    owner = [launched.get((e.get("args") or {}).get("correlation")) for e in device]
    first_own = min((e["ts"] for e, k in zip(device, owner) if k == 0), default=steps[0][1])
    before = [e["ts"] + e["dur"] for e, k in zip(device, owner) if k == -1 or (k is None and e["ts"] < first_own)]
    prev_end = max(before, default=float("-inf"))
    out = []
    for k, (lo, hi) in enumerate(steps):
        start = max(lo, prev_end)
        end = max([hi, start] + [e["ts"] + e["dur"] for e, o in zip(device, owner) if o == k])
        out.append((start, end))
        prev_end = end
    return out
