"""Dashboards, alert rules and provisioning: generated from the table, checked by promtool."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, require_executable

from diag.exporter.metrics_table import series_names

DASH = REPO / "dashboards"
GENERATED = ("diag-training.json", "diag-gpu.json", "diag-communication.json", "diag-exporter.json",
             "alerts.yml", "METRICS.md")
REQUIRED_ALERTS = {"DiagStepStalled", "DiagStraggler", "DiagGpuXidError", "DiagGpuThermalThrottling",
                   "DiagOutOfMemory", "DiagCommShareHigh", "DiagDataWaitHigh"}
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def load(name):
    return json.loads((DASH / name).read_text(encoding="utf-8"))


def panels(dash):
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_regenerating_changes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(DASH / "generate.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name in GENERATED:
        fresh = (tmp_path / name).read_text(encoding="utf-8")
        assert fresh == (DASH / name).read_text(encoding="utf-8"), (
            f"dashboards/{name} differs from the generator's output: run python dashboards/generate.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(GENERATED)


def test_generator_rejects_a_metric_missing_from_the_table():
    sys.path.insert(0, str(DASH))
    try:
        import generate
    finally:
        sys.path.remove(str(DASH))
    assert generate.unknown_metrics("rate(diag_steps_total[5m]) / diag_step_duration_seconds_count") == []
    assert generate.unknown_metrics("rate(diag_step_total[5m])") == ["diag_step_total"]


@pytest.mark.parametrize("name", [n for n in GENERATED if n.endswith(".json")])
def test_dashboard_structure(name):
    dash = load(name)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for var in ("run", "host", "rank"):
        assert variables[var]["type"] == "query" and variables[var]["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert variables[var]["includeAll"] and variables[var]["allValue"] == ".*"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    known = set(series_names())
    for p in panels(dash):
        assert p["type"] in ("timeseries", "stat", "table", "bargauge"), (p["title"], p["type"])
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            names = set(re.findall(r"\b(diag_[a-z0-9_]+)", t["expr"]))
            assert names <= known, (p["title"], names - known)
            if names:
                # diag's own series carry the identity labels the variables filter on.
                assert "$run" in t["expr"] and "$rank" in t["expr"], p["title"]
            else:
                # Otherwise only the series Prometheus records for every target, filtered by job.
                assert set(re.findall(r"\b([a-z_]+)\{", t["expr"])) <= PROMETHEUS_OWN, p["title"]
                assert "$job" in t["expr"], p["title"]


def test_training_overview_has_the_issue_panels():
    exprs = "\n".join(t["expr"] for p in panels(load("diag-training.json")) for t in p["targets"])
    assert "rate(diag_samples_total" in exprs and "diag_mfu_ratio" in exprs  # throughput and MFU
    assert "histogram_quantile(0.5, sum by (rank, le)" in exprs
    assert "histogram_quantile(0.95, sum by (rank, le)" in exprs  # p50/p95 per rank
    assert "rate(diag_step_bound_total" in exprs  # bound class share
    assert "rate(diag_step_phase_seconds_total" in exprs  # phase fractions
    assert re.search(r"max by \(run\) .*quantile by \(run\) \(0\.5", exprs)  # stragglers max/median
    assert "time() - " in exprs and "diag_last_step_timestamp_seconds" in exprs  # stall timer
    comm = "\n".join(t["expr"] for p in panels(load("diag-communication.json")) for t in p["targets"])
    assert 'phase="comm"' in comm and "diag_nccl_bus_bandwidth_bytes_per_second" in comm
    assert "diag_nccl_findings" in comm


def test_alert_rules_cover_the_issue_and_name_only_table_metrics():
    doc = yaml.safe_load((DASH / "alerts.yml").read_text(encoding="utf-8"))
    rules = doc["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert names >= REQUIRED_ALERTS
    known = set(series_names())
    for r in rules:
        used = set(re.findall(r"\b(diag_[a-z0-9_]+)", r["expr"]))
        assert used and used <= known, r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_every_alert_has_firing_and_silent_unit_tests():
    tests = yaml.safe_load((DASH / "alerts_test.yml").read_text(encoding="utf-8"))["tests"]
    firing, silent = set(), set()
    for t in tests:
        for case in t["alert_rule_test"]:
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
    rules = {r["alert"] for r in yaml.safe_load((DASH / "alerts.yml").read_text())["groups"][0]["rules"]}
    assert firing == rules and silent == rules


def test_promtool_checks_and_unit_tests_pass():
    promtool = require_executable("promtool", "Debian package prometheus")
    check = subprocess.run([promtool, "check", "rules", str(DASH / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=DASH,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_promtool_unit_tests_catch_a_broken_threshold(tmp_path):
    """The unit tests are not vacuous: a rule with a wrong threshold fails them."""
    promtool = require_executable("promtool", "Debian package prometheus")
    text = (DASH / "alerts.yml").read_text(encoding="utf-8")
    broken = text.replace("diag_last_step_timestamp_seconds) > 300", "diag_last_step_timestamp_seconds) > 3000")
    assert broken != text
    (tmp_path / "alerts.yml").write_text(broken, encoding="utf-8")
    (tmp_path / "alerts_test.yml").write_text((DASH / "alerts_test.yml").read_text(), encoding="utf-8")
    unit = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode != 0 and "DiagStepStalled" in unit.stdout + unit.stderr


def test_grafana_provisioning_files():
    ds = yaml.safe_load((DASH / "provisioning" / "datasources" / "diag-prometheus.yml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((DASH / "provisioning" / "dashboards" / "diag.yml").read_text())
    provider = prov["providers"][0]
    assert prov["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]


def test_diag_dashboards_writes_the_files_of_the_repository(tmp_path, capsys):
    """What a wheel's user gets: the same bytes as dashboards/, and nothing replaced unasked."""
    from diag import cli
    from diag.commands.dashboards import FILES

    out = tmp_path / "dash"
    assert cli.main(["dashboards", "--out", str(out)]) == 0
    for name in FILES:
        assert (out / name).read_bytes() == (DASH / name).read_bytes(), name
    assert cli.main(["dashboards", "--out", str(out)]) == 2  # exists already
    assert "--force" in capsys.readouterr().err
    assert cli.main(["dashboards", "--out", str(out), "--force"]) == 0
