"""Profiler windows asked for over the metrics endpoint (`diag top`'s `p`), limited so that
nothing reachable from the network can make a rank profile more than the user allowed: off
unless enabled, one window at a time, at most `on_demand_max` per run, one per
`on_demand_interval_s`, and starting no later than `on_demand_max_ahead` steps ahead."""

from __future__ import annotations

import time
from collections.abc import Callable


class OnDemandWindows:
    def __init__(self, settings, event: Callable[..., None]):
        self.settings = settings  # AgentConfig.profiler
        self._event = event
        self.count = 0
        self.last = float("-inf")  # time.monotonic() of the last window granted

    def request(self, windows, status: str, first_step: int | None) -> int | None:
        """The first step of the window asked for; the caller chose it for every rank, so the
        ranks profile the same steps. None: profiling is off; ProfileRefused says why a request
        is turned down."""
        from diag.exporter.server import ProfileRefused

        cfg = self.settings
        if not cfg.on_demand:
            raise ProfileRefused("windows asked for over the endpoint are off on this rank "
                                 "(profile_on_demand=True or DIAG_PROFILER_ON_DEMAND=1 turns them on)")
        if windows is None or not windows.enabled:
            return None
        if status != "running":
            raise ProfileRefused(f"training has ended on this rank ({status})")
        # A caller repeating the request (or flooding the port) gets the window already asked
        # for, never a run of windows.
        pending = windows.requested_step
        if pending is not None:
            return pending
        active = windows.window_steps
        if active is not None:
            return active[0]
        now, current = time.monotonic(), windows.current_step
        if first_step is not None and not current <= first_step <= current + cfg.on_demand_max_ahead:
            raise ProfileRefused(f"step {first_step} is outside steps {current}-{current + cfg.on_demand_max_ahead}")
        if self.count >= cfg.on_demand_max:
            raise ProfileRefused(f"this run took its {cfg.on_demand_max} windows asked for over the endpoint")
        if now - self.last < cfg.on_demand_interval_s:
            raise ProfileRefused(f"one window asked for over the endpoint in {cfg.on_demand_interval_s:g} s: "
                                 f"next in {cfg.on_demand_interval_s - (now - self.last):.0f} s")
        self.count += 1
        self.last = now
        first = windows.request(first_step)
        self._event("profiler", f"on-demand window requested at step {first} over the metrics endpoint")
        return first
