"""One vocabulary for clock events ("throttle reasons"): what each reason a sampler records
means for speed. The report's throttle markers, the straggler cause and the exporter's label
values all read this table.

The names are those the samplers write into `gpu.clock_events` (NVML's reasons, decoded in
`diag.collectors.gpu_nvml.CLOCK_EVENT_REASONS`; tests/test_gpu_nvml.py checks that both list
the same names).
"""

from __future__ import annotations

# reason -> what lowered the clocks: "none" (idle, or clocks set on purpose) or the limit hit.
# In NVML's bit order, which is the exporter's label order.
CLOCK_EVENTS = {
    "gpu_idle": "none",
    "applications_clocks_setting": "none",
    "sw_power_cap": "power",
    "hw_slowdown": "hardware",
    "sync_boost": "none",  # clocks held together across a sync-boost group, on purpose
    "sw_thermal": "thermal",
    "hw_thermal": "thermal",
    "hw_power_brake": "power",
    "display_clock_setting": "none",
    "board_limit": "hardware",
    "reliability": "hardware",
}
THROTTLE_REASONS = frozenset(r for r, kind in CLOCK_EVENTS.items() if kind != "none")


def throttle_reasons(events) -> list[str]:
    """The reasons among a sample's clock events that mean the device ran slower than asked."""
    if not isinstance(events, (list, tuple, set, frozenset)):
        return []
    return sorted({str(e) for e in events} & THROTTLE_REASONS)


# What slows a device on its own account. A power cap is not among them: GPUs at full GEMM
# load sit at their power limit (H100s report sw_power_cap in nearly every sample on every
# board), so a power cap says the device is working hard, not that it is slower than its
# peers; only a clock below theirs says that.
SLOWING_KINDS = frozenset({"thermal", "hardware"})


def slowing_reasons(events) -> list[str]:
    """The reasons among a sample's clock events that slow a device beyond what its peers
    at the same load see: thermal and hardware slowdowns."""
    return [r for r in throttle_reasons(events) if CLOCK_EVENTS[r] in SLOWING_KINDS]
