"""The report's data model: verdict sentence, confidence, ranked recommendations, what was missing.

Inputs are run directories written with diag.rundir and analysis documents (diag.analysis/1);
every expected figure is computed here from the numbers put into them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rank_documents import diagnosed, ranks_of
from report_helpers import CLASSES, analysis_rank, shares_for, write_run

from diag import atomic_io, rundir
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.views.report_model import Limits, build_model
from diag.report import build_run_model, write_report
from diag.run_documents import RankRecords, RunRecords

# ------------------------------------------------------------------ verdict and recommendations



def _summary(paths: dict) -> dict:
    """summary.json with its diagnosis's parts beside the page's own (as the page model holds them)."""
    summary = json.loads(Path(paths["summary"]).read_text())
    return {**summary["diagnosis"], **summary}


def _model(doc: dict, run: RunRecords | None = None, **kw) -> dict:
    """The page model of a hand-made analysis document, diagnosed as the facade does."""
    return build_model(diagnosed(doc, load_tree(), run), run, **kw)

def test_data_bound_run_headline_numbers_and_first_recommendation(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=30, bound="data", strength=0.45)
    m = build_run_model(run)
    assert m["bound"] == "data"
    text = m["headline"]["text"]
    assert text.startswith("Data-bound: waiting for the DataLoader takes 45% of step time")
    assert "both ranks" in text
    # The first recommendation is the verdict's phase. The run has step records but no traced
    # step to replay: no gain is predicted, and the phase's share is quoted as the upper bound.
    first = m["recommendations"][0]
    assert first["id"] == "phase-data"
    assert first["gain_max_share"] == pytest.approx(0.45, abs=0.005)
    assert first["gain_share"] is None
    assert first["gain"].startswith("No prediction possible (no profiled step was traced to replay)")
    assert "at most 45% of the step" in first["gain"]
    assert m["headline"]["note"] is None  # the largest gain is the verdict's own phase
    # Each recommendation's evidence links to an evidence entry on the page.
    ids = {e["id"] for e in m["evidence"]} | {"memory"}
    for r in m["recommendations"]:
        assert r["evidence"] and set(r["evidence"]) <= ids, r
    # Ranked by expected gain, unquantified ones last.
    gains = [r["gain_share"] for r in m["recommendations"]]
    quantified = [g for g in gains if g is not None]
    assert quantified == sorted(quantified, reverse=True)
    assert gains[: len(quantified)] == quantified


def test_decision_path_shows_question_value_threshold_answer(tmp_path):
    run = write_run(tmp_path / "run", ranks=1, steps=20, bound="comm", strength=0.5)
    m = build_run_model(run)
    nodes = m["decision_path"]["nodes"]
    assert nodes[0]["metric"] == "data_share" and nodes[0]["answer"] == "no"
    last = nodes[-1]
    assert last["metric"] == "comm_share" and last["answer"] == "yes"
    assert last["threshold"] == pytest.approx(0.20)
    assert last["value"] > last["threshold"]


def _late_rank_3(predicted_ms: float) -> dict:
    """Four ranks, rank 3 reaching every all-reduce last (its peers' collectives last 12 ms, its
    own 2 ms), and the job's what-if (the ranks carry no traced steps to replay): ranks at the
    median pace would take `predicted_ms` per step instead of 50."""
    from diag.analyzers.analysis_types import trace_facts_from_document
    from diag.analyzers.job.cross_rank import analyze_job

    ranks = []
    for r in range(4):
        colls = [{"name": "all_reduce", "pg": "0", "seq": i, "ts_us": (i // 3) * 50_000.0 + i * 1000,
                  "dur_us": 2000.0 if r == 3 else 12_000.0, "bytes": 1 << 24, "on": "device", "step": i // 3}
                 for i in range(30)]
        ranks.append(analysis_rank(r, 4, "comm", 0.45, collectives=colls, steps=range(10)))
    job = analyze_job([trace_facts_from_document(r) for r in ranks], load_tree().what_if)
    job.what_if = [{"change": "no_straggler", "description": "Every rank runs at the median rank's pace",
                       "baseline_step_ms": 50.0, "predicted_step_ms": predicted_ms, "speedup": 50.0 / predicted_ms,
                       "fixes": "wait"}]
    return _model({"schema": "diag.analysis/1", "ranks": ranks, "job": job, "errors": []})


def test_straggler_named_in_headline_and_wait_heatmap(tmp_path):
    """Rank 3 reaches every all-reduce last: its peers' collectives last 12 ms, its own 2 ms."""
    m = _late_rank_3(20.0)
    assert [s["rank"] for s in m["stragglers"]] == [3]
    assert "rank 3 is late" in m["headline"]["text"]
    hm = m["charts"]["heatmap_wait"]
    assert hm["ranks"] == [0, 1, 2, 3] and hm["collectives"] == 30
    # The peers wait 10 ms per collective for rank 3; rank 3 waits for nobody.
    assert hm["total_wait_ms"]["3"] == pytest.approx(0.0)
    assert hm["total_wait_ms"]["0"] == pytest.approx(30 * 10.0)
    rec = next(r for r in m["recommendations"] if r["id"] == "straggler-3")
    assert rec["gain_share"] == pytest.approx(0.6)  # the predicted 20 ms of a 50 ms step
    assert rec["gain"].startswith("With rank 3 at its peers' pace: 20.0 ms per step (expected within 20.0 to")
    assert m["recommendations"][0]["id"] == "straggler-3"
    assert "ev-straggler-3" in {e["id"] for e in m["evidence"]}


@pytest.mark.parametrize("predicted_ms,minor", [(47.6, True), (47.5, False)])  # 4.8% and 5% of a 50 ms step
def test_a_change_predicted_under_five_percent_is_a_note_after_the_changes(predicted_ms, minor):
    """A straggler whose removal wins under recommendation_min_gain of the step is no change to
    make: it follows every other recommendation, marked minor, and no view leads with it."""
    from diag.report.html import render
    from diag.report.markdown import render as render_md

    assert load_tree().thresholds["recommendation_min_gain"] == 0.05
    m = _late_rank_3(predicted_ms)
    rec = next(r for r in m["recommendations"] if r["id"] == "straggler-3")
    assert rec["minor"] is minor
    assert (m["recommendations"][-1] is rec) is minor and m["recommendations"][0]["minor"] is False
    md = render_md(m)
    section = md[md.index("## What to change, in order"):md.index("## Decision path")]
    assert ("Notes, each predicted to win under 5% of the step:" in section) is minor
    assert (f"**{rec['title']}**" in section) is not minor
    page = render(m)
    assert ('class="recs-minor"' in page) is minor


def test_verdict_and_largest_gain_disagreeing_is_explained():
    """Comm-bound by the tree (30% > 20%), but bandwidth-bound kernels hold 60% of the step."""
    sh = {"data": 0.0, "host": 0.05, "comm": 0.30, "memory": 0.60, "compute": 0.05}
    r = analysis_rank(0, 1, "comm", steps=range(5))
    for st in r["steps"]:
        st["shares"] = sh
    # Predictions: halving the bandwidth-bound kernels saves more than overlapping all communication.
    what_if = [{"change": c, "description": c, "baseline_step_ms": 100.0, "predicted_step_ms": p,
                "speedup": 100.0 / p, "fixes": f}
               for c, p, f in (("memory_kernels_2x", 70.0, "memory"), ("no_exposed_comm", 85.0, "comm"),
                               ("comm_2x", 90.0, "comm"))]
    m = _model({"ranks": [r], "job": {"what_if": what_if}})
    assert m["bound"] == "comm"
    assert [x["id"] for x in m["recommendations"][:2]] == ["phase-memory", "phase-comm"]
    assert m["recommendations"][0]["gain_share"] == pytest.approx(0.30)
    # The comm recommendation quotes the better of the two changes that fix communication.
    assert m["recommendations"][1]["prediction"]["change"] == "no_exposed_comm"
    assert "comm-bound because the decision tree asks" in m["headline"]["note"]


def test_memory_capacity_advice_from_nvml_samples(tmp_path):
    run = write_run(tmp_path / "run", ranks=1, steps=20, bound="compute", gpu=True)
    m = build_run_model(run)
    mem = m["memory"]
    # 4 GiB used (NVML) of 80 GiB: 5%, below the 80% threshold -> raise the batch.
    assert mem["used_fraction_max"] == pytest.approx(4 / 80)
    assert mem["advice"]["title"].startswith("Use the free device memory")
    assert any("raise the batch" in r["title"].lower() or r["id"] == "memory-capacity"
               or r["id"] == "finding-low_memory_use" for r in m["recommendations"])


def test_a_healthy_memory_use_is_said_with_the_tree_s_own_range(tmp_path):
    """5% of capacity is healthy once memory_capacity is 4% and memory_nearly_full 50%: the page
    says so with those figures, not a fixed 80-95%."""
    from diag.report.html import render

    run = write_run(tmp_path / "run", ranks=1, steps=20, bound="compute", gpu=True)
    m = build_run_model(run, tree=load_tree(overrides={"memory_capacity": 0.04, "memory_nearly_full": 0.5}))
    mem = m["memory"]
    assert mem.get("advice") is None
    assert mem["note"] == "Memory use is in the healthy range (4% to 50% of capacity): no change needed."
    page = render(m)
    assert mem["note"] in page and "80-95%" not in page


def test_memory_breakdown_levers_and_batch_headroom_from_model_facts(tmp_path):
    """4 GiB peak (NVML) of 80 GiB, 32 samples per step, and the model facts the agent records
    for 0.25 Gi parameters in bf16 with AdamW (fp32 moments) on 2 data-parallel ranks."""
    run = write_run(tmp_path / "run", ranks=2, steps=20, bound="compute", gpu=True)
    gib = 2**30
    facts = {"params": gib // 4, "param_bytes": gib // 2, "grad_bytes": gib // 2, "optimizer_state_bytes": 2 * gib,
             "buffer_bytes": 0, "sharded": False, "optimizer": "AdamW"}
    for r in (0, 1):
        path = run / rundir.rank_dir_name(r) / rundir.RANK_FILE
        info = json.loads(path.read_text())
        atomic_io.atomic_write_json(path, {**info, "model": facts})
    m = build_run_model(run)
    mem = m["memory"]
    b = mem["breakdown"]
    assert b["model_states_bytes"] == 3 * gib and b["peak_bytes"] == 4 * gib
    assert b["activations_and_other_bytes"] == 1 * gib and b["activations_per_sample_bytes"] == gib / 32
    levers = {x["id"]: x["bytes"] for x in mem["levers"]}
    # Half of each sharded state moves to the other rank.
    assert levers["zero1"] == gib and levers["zero2"] == 1.25 * gib and levers["zero3"] == 1.5 * gib
    assert levers["recompute"] == pytest.approx(gib * 32 / 34)  # keeps 2sbh of 34sbh
    assert levers["double_batch"] == -gib
    # 0.85 x 80 GiB - 4 GiB = 64 GiB free at 1/32 GiB per sample: up to 32 + 2048 samples.
    head = mem["batch_headroom"]
    assert head["free_bytes"] == 64 * gib and head["samples_max"] == 32 + 2048
    assert "from 32 to about 2080 samples" in mem["advice"]["actions"][0]
    paths = write_report(run)
    md = Path(paths["markdown"]).read_text()
    assert "| ZeRO-3 (FSDP FULL_SHARD): also shard the parameters | +1.50 GiB |" in md
    assert "| Activations and other (peak - states) | 1.00 GiB |" in md


def test_throttle_events_marked_and_benign_reasons_ignored(tmp_path):
    run = write_run(tmp_path / "run", ranks=1, steps=200, bound="compute", gpu=True, step_s=0.05)
    m = build_run_model(run)
    tl = m["charts"]["timelines"]
    keys = [x["key"] for x in tl["metrics"]]
    assert {"gpu_util", "gpu_mem", "gpu_power", "gpu_clock", "host_cpu"} <= set(keys)
    # write_run marks sw_power_cap on every 7th of its 10 samples: t = 0 and 7.
    assert [e["t"] for e in tl["throttle"]] == [0, 7]
    assert all(e["reasons"] == "sw_power_cap" for e in tl["throttle"])


# ------------------------------------------------------------------ bad runs still report


def test_missing_rank_is_named_and_report_written(tmp_path):
    run = write_run(tmp_path / "run", ranks=3, steps=20, bound="data")
    shutil.rmtree(run / "rank-00001")
    paths = write_report(run)
    m = _summary(paths)
    assert m["run"]["missing_ranks"] == [1]
    assert m["run"]["world_size"] == 3
    assert any("Rank(s) 1 left no data" in x["what"] for x in m["missing"])
    assert "on 2 of 3 ranks" in m["headline"]["text"]
    assert "rank" in Path(paths["markdown"]).read_text().lower()


def test_truncated_and_corrupt_files_are_listed_and_the_rest_reported(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=30, bound="host", step_segment=10)
    steps_dir = run / "rank-00000" / "steps"
    seg = sorted(steps_dir.glob("steps-*.jsonl"))[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])  # truncated mid-record
    (run / "rank-00001" / "windows" / "window-000010.json").write_text('{"first_step": 10, "analysis": {')
    (run / "rank-00001" / "rank.json").write_bytes(b"\x00\x01garbage")
    paths = write_report(run)
    m = _summary(paths)
    probs = "\n".join(m["problems"])
    assert "steps-000002.jsonl" in probs and "not a JSON record" in probs
    assert "window-000010.json" in probs
    assert "rank.json" in probs
    assert m["bound"] == "host"
    assert m["run"]["ranks_present"] == [0, 1]
    assert "damaged or unreadable" in " ".join(m["confidence"]["reasons"])
    html = Path(paths["html"]).read_text()
    assert "Damaged or unreadable input" in html


def test_no_profiler_window_says_so_and_lowers_confidence(tmp_path):
    with_trace = build_run_model(write_run(tmp_path / "a", ranks=1, steps=30, bound="data"))
    without = build_run_model(write_run(tmp_path / "b", ranks=1, steps=30, bound="data", windows=False))
    assert any(x["what"].startswith("No profiler window") for x in without["missing"])
    assert not any(x["what"].startswith("No profiler window") for x in with_trace["missing"])
    assert without["confidence"]["score"] < with_trace["confidence"]["score"]
    assert "sampled measurements only" in " ".join(without["confidence"]["reasons"])
    assert without["top_kernels"] == []


def test_run_without_any_step_still_reports(tmp_path):
    run = tmp_path / "run"
    atomic_io.atomic_write_json(run / rundir.MANIFEST, {"schema": rundir.RUN_SCHEMA, "world_size": 2})
    atomic_io.atomic_write_json(run / "rank-00000" / rundir.RANK_FILE, {"rank": 0, "world_size": 2})
    paths = write_report(run)
    m = _summary(paths)
    assert m["bound"] is None
    assert m["headline"]["text"].startswith("No verdict")
    # Nothing was measured, so nothing is quantified: only findings' advice (the missing rank) remains.
    assert all(r["gain_share"] is None for r in m["recommendations"])
    assert not any(r["id"].startswith("phase-") for r in m["recommendations"])
    assert m["run"]["missing_ranks"] == [1]


def test_not_a_run_directory_is_a_one_line_input_error(tmp_path):
    from diag.errors import DiagInputError

    (tmp_path / "x").mkdir()
    with pytest.raises(DiagInputError, match="not a diag run directory"):
        write_report(tmp_path / "x")
    with pytest.raises(DiagInputError, match="no such run directory"):
        write_report(tmp_path / "nope")


# ------------------------------------------------------------------ NCCL sections from real files


def test_nccl_log_and_bench_feed_the_comm_verdict(tmp_path, real_nccl):
    from diag.analyzers.nccl import expected as nccl_expected
    from diag.analyzers.nccl import nccl_tests

    run = write_run(tmp_path / "run", ranks=2, steps=20, bound="comm", strength=0.4)
    # An NCCL_DEBUG=INFO log in which inter-node traffic uses TCP sockets, as the agent would save it.
    (run / "rank-00000" / "nccl").mkdir()
    shutil.copy(real_nccl / "nccllog_NVIDIA-nccl_1232.txt", run / "rank-00000" / "nccl" / "nccl.log")
    # A real nccl-tests all_reduce table, saved the way `diag nccl --run-dir` saves it with the
    # topology given on its command line (A100 NVLink inside a node, 200 Gb/s RoCE between nodes).
    bench = nccl_tests.parse_file(real_nccl / "nccltests_NVIDIA-nccl_1453.txt")
    bench["topology"] = nccl_expected.topology_from_flags("nvlink3", "roce_200")
    atomic_io.atomic_write_json(run / "nccl_bench.json", bench)
    m = build_run_model(run)
    n = m["nccl"]
    assert {t["transport"] for t in n["transports"]} >= {"NET/Socket", "SHM"}
    assert any(f["id"] == "net_socket_fallback" for f in n["log_findings"])
    # The log says TCP sockets, and so does the bandwidth diagnosis: the headline says it once.
    assert m["headline"]["text"].count("TCP sockets") == 1
    assert n["log_sentences"][0] == "NCCL fell back to TCP sockets between nodes"
    chart = m["charts"]["nccl_busbw"]
    sizes = [r["size_bytes"] for t in bench["tests"] for r in t["rows"]]
    assert chart["series"] and max(max(s["x"]) for s in chart["series"]) == max(sizes)
    assert any(r["id"] == "nccl-net_socket_fallback" for r in m["recommendations"])
    # x% of expected: the table's large-message busbw over the slower of NVLink 3 (300 GB/s x 80%)
    # and the one NIC the log shows between its 2 nodes (25 GB/s x 96%).
    measured, _ = nccl_expected.large_message_busbw(bench["tests"][0])
    expected = min(300.0 * 0.80, 25.0 * 0.96)
    assert n["busbw_fraction"] == pytest.approx(measured / expected, rel=1e-6)
    assert f"{measured / expected:.0%} of the expected bus bandwidth" in m["headline"]["text"]
    assert chart["expected"][0]["busbw_gbps"] == pytest.approx(expected)
    rec = next(r for r in m["recommendations"] if r["id"] == "nccl-bandwidth")
    # No traced step to replay in this run: the gain is not predicted, only bounded.
    assert rec["gain_share"] is None and rec["gain_max_share"] == pytest.approx(m["phase_shares"]["comm"])
    assert not any(x["what"] == "No NCCL log." for x in m["missing"])


def test_recorded_backend_decides_whether_a_missing_nccl_log_is_named(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=10, bound="comm", strength=0.4)

    def named() -> bool:
        return any(x["what"] == "No NCCL log." for x in build_run_model(run)["missing"])

    assert not named()  # the agent recorded gloo: no NCCL log is expected
    manifest = atomic_io.read_json(run / rundir.MANIFEST)
    atomic_io.atomic_write_json(run / rundir.MANIFEST, {**manifest, "backend": "nccl"})
    assert named()
    # No backend in the manifest (an older agent, a killed rank 0): the ranks' record decides.
    atomic_io.atomic_write_json(run / rundir.MANIFEST, {k: v for k, v in manifest.items() if k != "backend"})
    for r in (0, 1):
        path = run / rundir.rank_dir_name(r) / rundir.RANK_FILE
        atomic_io.atomic_write_json(path, {**atomic_io.read_json(path), "backend": "nccl"})
    assert named()
    # `diag run` left the job's logs in RUN_DIR/nccl/: they are read, nothing is missing.
    (run / "nccl").mkdir()
    (run / "nccl" / "nccl.node1.77.log").write_text(
        "node1:77:77 [0] NCCL INFO NCCL version 2.18.3+cuda12.2\n"
        "node1:77:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n")
    assert not named()


# ------------------------------------------------------------------ scale


def test_big_run_is_aggregated_and_says_so():
    """A model of many ranks and steps stays small: bucketed series, bands, and notes saying so."""
    ranks = [analysis_rank(r, 16, "comm", 0.4, steps=range(3000)) for r in range(16)]
    for r in ranks:
        for s in r["steps"]:
            s["duration_ms"] = 50.0 + (s["step"] % 7)
    samples = {r: RankRecords(samples=[{"t": 1000.0 + i, "gpu": {"utilization_ratio": 0.5}, "host": {"cpu_ratio": 0.2}}
                                       for i in range(1500)]) for r in range(16)}
    lim = Limits()
    m = _model({"schema": "diag.analysis/1", "ranks": ranks, "job": {}}, RunRecords(ranks=samples), limits=lim)
    ch = m["charts"]
    assert len(ch["phases"]["x"]) <= lim.series_points
    assert len(ch["heatmap_step"]["z"][0]) <= lim.heatmap_columns
    assert ch["timelines"]["band"] is True
    assert len(ch["timelines"]["metrics"][0]["t"]) <= lim.timeline_points
    notes = " ".join(m["notes"])
    assert "3000 steps are shown as" in notes and "min, median and max" in notes
    # Bucket means preserve the overall mean of the phase shares.
    comm = [v for v in ch["phases"]["y"]["comm"]]
    assert sum(comm) / len(comm) == pytest.approx(shares_for("comm", 0.4)["comm"], abs=1e-6)
    assert m["step_stats"]["steps"] == 3000


def test_shares_are_renormalised_and_garbage_ignored():
    bad = analysis_rank(0, 1, "data", 0.5, steps=range(4))
    bad["steps"][0]["shares"] = {p: 2.0 for p in CLASSES}  # sums to 10: renormalised to 0.2 each
    bad["steps"][1]["shares"] = {"data": "x"}  # garbage: ignored
    bad["steps"][2]["duration_ms"] = float("nan")
    m = _model({"ranks": [bad], "job": {}})
    assert m["phase_shares"] is not None
    assert sum(m["phase_shares"].values()) == pytest.approx(1.0)


def test_real_gpu_trace_through_the_real_analyzer(real_traces, tmp_path):
    """A100 trace with NCCL kernels: the report's tables and verdict follow the analysis document."""
    from diag.analyzers.analyze import analyze_paths
    from diag.report import write_report_from_analysis

    doc = analyze_paths([str(real_traces / "a100_2rank_nccl.json.gz")])
    m = build_model(doc)
    rank = ranks_of(doc)[0]
    assert m["bound"] == doc.job.bound
    top = max(rank["top_kernels"], key=lambda k: k["time_ms"])
    assert m["top_kernels"][0]["name"] == top["name"] and m["top_kernels"][0]["class"] == top["class"]
    assert m["top_kernels"][0]["time_ms"] == pytest.approx(top["time_ms"])
    assert m["run"]["devices"] == [f"1 x {rank['device']}"]
    assert m["run"]["name"] == "a100_2rank_nccl.json.gz"
    paths = write_report_from_analysis(doc, tmp_path)
    page = Path(paths["html"]).read_text()
    assert "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)" in page


@pytest.mark.parametrize("part,problem", [("analyze_run", "run analysis failed"),
                                          ("judge_run_rank", "judging the run analysis failed")])
def test_report_survives_a_failing_run_analysis(tmp_path, monkeypatch, part, problem):
    """A bug in the run analysis, or in judging its facts (which come first and are judged
    after), costs the user the precise verdict, not the report."""
    from diag.analyzers import analyze

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(analyze, part, broken)
    run = write_run(tmp_path / "run", ranks=2, steps=20, bound="memory", strength=0.6)
    m = build_run_model(run)
    assert any(f"{problem} (RuntimeError: boom)" in p for p in m["problems"])
    # The analysed windows the agent saved still give the verdict.
    assert m["bound"] == "memory"
    assert m["top_kernels"]
