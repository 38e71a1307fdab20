"""The predictions of a cause's own action (diagnosis.action_models), against the fixed
variants the same H200 ran (tests/fixtures/real/h200/cases.json, bench/gpu_trace_cases.py),
and against their thresholds and rates on made-up facts."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from merged_ranks import merged

from diag.analyzers.analyze import analyze_paths
from diag.analyzers.diagnosis import action_models as am
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.trace import devices

H200 = Path(__file__).parent / "fixtures" / "real" / "h200"
CASES = {c["case"]: c for c in json.loads((H200 / "cases.json").read_text())["cases"]}


def _cause(case: str, cause_id: str) -> dict:
    doc = analyze_paths([str(H200 / f"{case}.json.gz")], jobs=1)
    return next(c for c in doc.diagnosis.causes if c["id"] == cause_id)


def _measured_step(case: str, expected: dict) -> float:
    """The fixed variant's step in the traced step's units: the traced baseline over the
    speedup the fix measured outside the profiler."""
    c = CASES[case]
    return expected["baseline_step_ms"] * c["fixed_wall_step_ms"] / c["wall_step_ms"]


@pytest.mark.parametrize("case,cause_id,action", [("matmul_fp32_odd", "fp32_math", "bf16 autocast"),
                                                  ("pageable_copy", "pageable_copies", "pinned memory")])
def test_the_action_predicted_is_within_35_percent_of_the_fix_measured(case, cause_id, action):
    cause = _cause(case, cause_id)
    e = cause["expected"]
    measured = _measured_step(case, e)
    assert e["action"].startswith(action) and cause["gain"].startswith(f"With {e['action']}:")
    assert abs(e["expected_step_ms"] - measured) / measured <= 0.35
    assert e["low_ms"] <= measured <= e["high_ms"]
    # The ceiling, the cause gone entirely, is apart and never slower than the action.
    assert e["ceiling_step_ms"] == cause["what_if"]["predicted_step_ms"] <= e["expected_step_ms"]


def test_the_pinned_rate_is_the_device_links_share():
    """64 MiB a step at 80% of PCIe 5's 63 GB/s on the H200; the copy measured at the trace's rate."""
    e = _cause("pageable_copy", "pageable_copies")
    ev = e["evidence"]
    pageable = [c for c in ev["copies"] if "Pageable" in c["name"]]
    mb = sum(c["mb_per_step"] for c in pageable)
    assert devices.HOST_LINK_BW["h200"] == 63e9
    assert f"cross at {63 * 0.8:.1f} GB/s" in e["expected"]["assumes"]
    assert f"{mb:.1f} MB" in e["expected"]["assumes"]


def _ctx(analysis: dict, **thresholds):
    tree = dt.load_tree()
    tree.thresholds.update(thresholds)
    return types.SimpleNamespace(ranks=merged({0: {"analysis": analysis}}), tree=tree)


CEILING = {"baseline_step_ms": 100.0, "predicted_step_ms": 20.0}


def test_the_step_takes_the_share_of_the_ceilings_gain_the_action_takes_away():
    assert am.scaled_step(CEILING, 80.0, 40.0) == 60.0
    assert am.scaled_step(CEILING, 80.0, 200.0) == 20.0  # never past the ceiling
    assert am.scaled_step(CEILING, 80.0, -1.0) == 100.0
    assert am.scaled_step({"baseline_step_ms": 100.0, "predicted_step_ms": None}, 80.0, 40.0) is None


def _copy_evidence(mb: float = 100.0, ms: float = 10.0) -> dict:
    return {"ranks": [0], "copies": [{"name": "Memcpy HtoD (Pageable -> Device)", "mb_per_step": mb, "ms_per_step": ms}]}


def test_pinned_copies_take_the_traces_own_pinned_rate_before_the_link():
    link = {"device_info": {"host_link_bw": 50e9}}
    own = {**link, "copies": [{"name": "Memcpy HtoD (Pinned -> Device)", "mb_per_step": 50.0, "ms_per_step": 2.5}]}
    # 100 MB at the trace's own 20 GB/s: 5 ms of the 10 ms measured taken away.
    e = am.pinned_copies(_ctx(own), _copy_evidence(), CEILING)
    assert e["expected_step_ms"] == pytest.approx(100.0 - 80.0 * 5.0 / 10.0)
    assert "the trace's own pinned copies" in e["assumes"]
    # Without pinned copies, at 80% of the link's 50 GB/s: 2.5 ms, so 7.5 ms taken away.
    e = am.pinned_copies(_ctx(link), _copy_evidence(), CEILING)
    assert e["expected_step_ms"] == pytest.approx(100.0 - 80.0 * 7.5 / 10.0)
    assert e["low_ms"] == CEILING["predicted_step_ms"]  # the copy hidden behind the host's work
    assert e["high_ms"] > e["expected_step_ms"]


def test_no_pinned_prediction_without_a_rate_or_a_ceiling():
    assert am.pinned_copies(_ctx({"device_info": {}}), _copy_evidence(), CEILING) is None
    assert am.pinned_copies(_ctx({"device_info": {"host_link_bw": 25e9}}), _copy_evidence(), None) is None


def _math_evidence(ms: float) -> dict:
    return {"ranks": [0], "precision": "fp32", "ms_per_step": ms,
            "peaks_tflops": {"fp32": 20.0, "tf32": 160.0, "bf16": 320.0}}


def _group(dims: dict, ms: float, tflops: float, dtype: str = "fp32", frac: float | None = None) -> dict:
    return {"dtype": dtype, "dims": dims, "ms_per_step": ms, "tflops": tflops, "peak_fraction": frac,
            "misaligned": [f"{k}={v}" for k, v in dims.items() if v % 8]}


def _math_analysis(*groups) -> dict:
    fp32 = sum(g["ms_per_step"] for g in groups if g["dtype"] == "fp32")
    return {"math": {"fp32_ms_per_step": fp32, "tf32_ms_per_step": 0.0},
            "matrix_ops": {"groups": list(groups)}}


@pytest.mark.parametrize("dims,frac_key", [({"M": 4096, "K": 4096, "N": 4096}, "half_precision_tiled_peak"),
                                           ({"M": 4096, "K": 4095, "N": 4096}, "half_precision_untiled_peak")])
def test_autocast_runs_each_group_at_the_rate_its_shape_allows(dims, frac_key):
    ctx = _ctx(_math_analysis(_group(dims, 40.0, 16.0)))
    e = am.autocast(ctx, _math_evidence(40.0), CEILING)
    frac = ctx.tree.thresholds[frac_key]
    after = 40.0 * 16.0 / (frac * 320.0)
    removed = 40.0 * (1.0 - 20.0 / 320.0)
    assert e["expected_step_ms"] == pytest.approx(100.0 - 80.0 * (40.0 - after) / removed)
    assert e["low_ms"] < e["expected_step_ms"] < e["high_ms"]


def test_autocast_takes_the_traces_own_half_precision_rate_on_tiled_shapes():
    own = _group({"M": 8192, "K": 8192, "N": 8192}, 5.0, 256.0, dtype="bf16", frac=0.8)
    ctx = _ctx(_math_analysis(_group({"M": 4096, "K": 4096, "N": 4096}, 40.0, 16.0), own))
    e = am.autocast(ctx, _math_evidence(40.0), CEILING)
    after = 40.0 * 16.0 / (0.8 * 320.0)
    assert e["expected_step_ms"] == pytest.approx(100.0 - 80.0 * (40.0 - after) / (40.0 * (1 - 20.0 / 320.0)))
    assert "the trace's own half-precision matrix ops" in e["assumes"] and e["action"] == "bf16 autocast"


def test_no_autocast_prediction_without_the_ops_shapes():
    ctx = _ctx({"math": {"fp32_ms_per_step": 40.0}, "matrix_ops": None})
    assert am.autocast(ctx, _math_evidence(40.0), CEILING) is None
