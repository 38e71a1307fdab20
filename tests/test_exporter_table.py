"""The metric table: conventions, coverage of the issue's metrics, and everything derived from it."""

from __future__ import annotations

import dataclasses

from conftest import REPO
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from diag.exporter import docs
from diag.exporter.metrics_table import BY_NAME, IDENTITY_LABELS, METRICS, Metric, validate
from diag.exporter.registry import MetricState, make_registry

IDENTITY = {"run": "r1", "rank": 3, "local_rank": 1, "host": "node7", "gpu": 1}


def test_table_follows_prometheus_conventions():
    assert validate() == []


def test_validate_catches_broken_entries():
    bad = [
        Metric("steps_total", "counter", "", "x", "step"),  # no prefix
        Metric("diag_steps", "counter", "", "x", "step"),  # counter without _total
        Metric("diag_power_watts_total", "gauge", "watts", "x", "sample.gpu"),  # _total on a gauge
        Metric("diag_temperature", "gauge", "celsius", "x", "sample.gpu"),  # unit not in the name
        Metric("diag_x_seconds", "histogram", "seconds", "x", "step"),  # no buckets
        Metric("diag_y_seconds", "gauge", "seconds", "x", "step", labels=("rank",)),  # identity clash
        Metric("diag_z", "gauge", "", " ", "step"),  # no help
    ]
    problems = validate(bad)
    for m in bad:
        assert any(p.startswith(m.name + ":") for p in problems), m.name


def test_issue_metrics_are_declared_with_the_right_type_and_labels():
    expected = {
        "diag_steps_total": ("counter", ()),
        "diag_step_duration_seconds": ("histogram", ()),
        "diag_step_phase_seconds_total": ("counter", ("phase",)),
        "diag_step_bound_total": ("counter", ("bound",)),
        "diag_last_step_timestamp_seconds": ("gauge", ()),
        "diag_samples_total": ("counter", ()),
        "diag_tokens_total": ("counter", ()),
        "diag_mfu_ratio": ("gauge", ()),
        "diag_data_wait_seconds_total": ("counter", ()),
        "diag_gpu_utilization_ratio": ("gauge", ()),
        "diag_gpu_memory_used_bytes": ("gauge", ()),
        "diag_gpu_memory_total_bytes": ("gauge", ()),
        "diag_gpu_power_watts": ("gauge", ()),
        "diag_gpu_energy_joules_total": ("counter", ()),
        "diag_gpu_temperature_celsius": ("gauge", ()),
        "diag_gpu_sm_clock_hertz": ("gauge", ()),
        "diag_gpu_clock_event_active": ("gauge", ("reason",)),
        "diag_gpu_pcie_bytes_total": ("counter", ("direction",)),
        "diag_gpu_nvlink_bytes_total": ("counter", ("direction",)),
        "diag_gpu_xid_errors_total": ("counter", ()),
        "diag_gpu_ecc_errors_total": ("counter", ()),
        "diag_host_cpu_ratio": ("gauge", ()),
        "diag_host_memory_used_bytes": ("gauge", ()),
        "diag_host_disk_bytes_total": ("counter", ("direction",)),
        "diag_host_network_bytes_total": ("counter", ("direction",)),
        "diag_nccl_bus_bandwidth_bytes_per_second": ("gauge", ("collective",)),
        "diag_nccl_findings": ("gauge", ("id",)),
        "diag_exporter_collect_duration_seconds": ("gauge", ()),
        "diag_exporter_errors_total": ("counter", ("stage",)),
        "diag_build_info": ("info", ("version", "python", "torch")),
        "diag_gpu_info": ("info", ("name", "uuid")),
    }
    for name, (mtype, labels) in expected.items():
        m = BY_NAME[name]
        assert (m.type, m.labels) == (mtype, labels), name
    # Few labels: none beyond the identity has more than one.
    assert all(len(m.labels) <= 1 for m in METRICS if m.type != "info")


def test_registration_exposes_exactly_the_table():
    state = MetricState(IDENTITY)
    text = generate_latest(make_registry([state])).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # prometheus_client strips _total from counter family names.
    declared = {(m.name[:-6] if m.type == "counter" else m.name): m for m in METRICS}
    assert set(families) == set(declared)
    for fam_name, m in declared.items():
        fam = families[fam_name]
        assert fam.documentation == m.help
        assert fam.type == ("gauge" if m.type == "info" else m.type)
        for s in fam.samples:
            assert [s.labels[k] for k in IDENTITY_LABELS] == ["r1", "3", "1", "node7", "1"]


def test_metrics_reference_is_generated_from_the_table():
    committed = (REPO / "dashboards" / "METRICS.md").read_text(encoding="utf-8")
    assert committed == docs.render(), "dashboards/METRICS.md is stale: run python dashboards/generate.py"
    for m in METRICS:
        assert f"`{m.name}`" in committed
    # A change in the table shows in the reference.
    renamed = dataclasses.replace(BY_NAME["diag_steps_total"], help="Renamed help text.")
    import diag.exporter.docs as docs_mod

    original = docs_mod.METRICS
    try:
        docs_mod.METRICS = tuple(renamed if m.name == "diag_steps_total" else m for m in original)
        assert "Renamed help text." in docs_mod.render()
    finally:
        docs_mod.METRICS = original


def _samples(text: str) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_fast_renderer_serves_the_same_samples_as_prometheus_client():
    from diag.exporter.registry import render_text
    from diag.exporter.runtime import Handle
    from diag.step_record import StepRecord

    handles = [Handle({**IDENTITY, "rank": r, "host": 'odd "host"\\name'}) for r in (0, 1)]
    for h in handles:
        h.observe_step(StepRecord(step=0, duration_s=0.3, data_wait_s=0.1, samples=4,
                                  shares={"data": 0.3, "host": 0.0, "comm": 0.5, "memory": 0.1, "compute": 0.1}), "comm")
        h.observe_sample({"t": 1.0, "gpu": {"name": "GPU\nname", "uuid": "u", "clock_events": ["hw_slowdown"],
                                            "power_watts": 100.0}, "host": {"cpu_ratio": 0.25}})
        h.observe_nccl({"schema": "diag.nccl_log/1", "findings": [{"id": 'quote"d'}]})
    states = [h.state for h in handles]
    fast = render_text(states).decode()
    reference = generate_latest(make_registry(states)).decode()
    a, b = _samples(fast), _samples(reference)
    # Scrape counters and collect durations move with each render; everything else is equal.
    moving = ("diag_exporter_scrapes_total", "diag_exporter_collect_duration_seconds")
    assert {k: v for k, v in a.items() if k[0] not in moving} == {k: v for k, v in b.items() if k[0] not in moving}
    assert set(a) == set(b)
    assert len(a) > 100
