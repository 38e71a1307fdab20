"""What-if: the critical path of each traced step, and its replay under changed durations.

Real GPU traces check that the graph explains the measured steps (the critical path within
5% of each step). A hand-built trace checks the replay where the answer is known by hand:
hidden communication that surfaces when compute gets faster. CPU traces, the job's
coupling of ranks, the config file's own changes and `diag compare --applied` follow.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES
from device_steps import device_step_windows, host_steps
from rank_documents import trace_rank

from diag.analyzers.analysis_types import TraceRankFacts
from diag.analyzers.diagnosis import decision_tree as dt
from diag.analyzers.diagnosis.stragglers import straggler_what_if
from diag.analyzers.whatif.job import job_what_if

REAL_FIXTURES = sorted((FIXTURES / "real").glob("*.json.gz"))
SHARED_TRACES = ("a100_2rank_nccl.json.gz", "job128_rank0_sampled.json.gz", "job128_rank1_sampled.json.gz",
                 "mi250_rocm62_tiny.json.gz", "v100_1rank_compute.json.gz", "v100_resnet50_workers0_oldschema.json.gz")
STANDARD = ("no_data_wait", "no_host_gaps", "no_exposed_comm", "comm_2x", "memory_kernels_2x", "compute_2x",
            "fuse_elementwise_chain", "tensor_core_math", "half_precision_matrix_ops", "no_sync_points",
            "slow_bandwidth_kernels_at_target", "no_cpu_work_on_thread", "no_python_gaps", "no_allocator_calls",
            "no_pageable_copies", "compressed_collective", "ddp_no_sync_accumulation", "no_launch_cost",
            "no_straggler")


def _check_paths(rank: dict) -> int:
    """Every replayed step: critical path within 5% of the measured step; no change ever slower."""
    n = 0
    for s in rank["steps"]:
        if "critical_path" not in s:
            continue
        n += 1
        assert s["critical_path"]["length_ms"] == pytest.approx(s["duration_ms"], rel=0.05), s["step"]
        assert s["replayed_ms"] == pytest.approx(s["duration_ms"], rel=0.05), s["step"]
    for e in rank["what_if"]:
        if e["predicted_step_ms"] is not None:
            assert e["predicted_step_ms"] <= e["baseline_step_ms"] + 1e-9, e
    return n


@pytest.mark.parametrize("name", SHARED_TRACES)
def test_critical_path_reproduces_each_step_of_real_gpu_traces(real_traces, name):
    rank = trace_rank(real_traces / name)
    assert _check_paths(rank) == len(rank["steps"])  # these traces have few steps: all are replayed
    assert rank["critical_path"]["max_error"] < 0.05


@pytest.mark.parametrize("path", REAL_FIXTURES, ids=[p.name for p in REAL_FIXTURES])
def test_critical_path_reproduces_each_step_of_trimmed_real_traces(path):
    rank = trace_rank(path)
    assert _check_paths(rank) >= 1


def _exposed_loader_ms(path) -> float:
    """The median, over a trace's steps, of the DataLoader's time inside the step's window
    (tests/device_steps.py): the part of the wait no device work of the step before hides."""
    with gzip.open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    loader = [e for e in events if str(e.get("name", "")).startswith("enumerate(DataLoader)")]
    exposed = [sum(max(0.0, d["ts"] + d["dur"] - max(d["ts"], start)) for d in loader if lo <= d["ts"] < hi)
               for (lo, hi), (start, _) in zip(host_steps(events), device_step_windows(events))]
    return float(np.median(exposed)) / 1e3


def test_no_data_wait_on_a_real_input_bound_trace(real_traces):
    """V100 ResNet-50 with num_workers=0: the DataLoader wait is on the critical path, less its
    first ~12 ms, which the device spends finishing the step before. Removing it saves at most
    that wait, and less where device work it hid comes to light."""
    path = real_traces / "v100_resnet50_workers0_oldschema.json.gz"
    rank = trace_rank(path)
    cp = rank["critical_path"]
    pred = next(e for e in rank["what_if"] if e["change"] == "no_data_wait")
    assert cp["by_class_ms"]["data"] == pytest.approx(_exposed_loader_ms(path), rel=0.05)
    saved = pred["baseline_step_ms"] - pred["predicted_step_ms"]
    # The replay's own error on these steps (its baseline against the measured step) bounds
    # how far a saving may pass the wait it removes.
    slack = float(np.median([abs(s["replayed_ms"] - s["duration_ms"]) for s in rank["steps"] if "replayed_ms" in s]))
    assert 0.5 * cp["by_class_ms"]["data"] < saved <= cp["by_class_ms"]["data"] * 1.01 + slack
    comm = next(e for e in rank["what_if"] if e["change"] == "no_exposed_comm")
    assert comm["predicted_step_ms"] is None and "no comm time in the traced steps" in comm["note"]


def _kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


def _runtime(name, ts, dur, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _hand_trace(path):
    """One 1,000 µs step: a 600 µs GEMM on stream 7 and a 400 µs all-reduce on stream 20 hidden
    beside it, a device synchronise that returns 5 µs after the GEMM, then 375 µs of Python."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        _runtime("cudaLaunchKernel", 10, 5, 1),
        _runtime("cudaLaunchKernel", 16, 5, 2),
        _runtime("cudaDeviceSynchronize", 22, 603, 3),
        _kernel("ampere_sgemm_128x64_nn", 20, 600, 7, 1),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 25, 400, 20, 2),
    ]
    doc = {"traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB",
                                                        "totalGlobalMem": 85899345920, "numSms": 108}]}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def test_replay_surfaces_hidden_communication(tmp_path):
    rank = trace_rank(_hand_trace(tmp_path / "hand.json.gz"))
    step = rank["steps"][0]
    assert step["duration_ms"] == pytest.approx(1.0)
    path = step["critical_path"]["by_class_ms"]
    assert path["compute"] == pytest.approx(0.6) and "comm" not in path  # the all-reduce is hidden
    w = {k: v * 1e3 for k, v in step["what_if_ms"].items()}
    # Twice-as-fast compute ends at 320 µs, but the synchronise also waits for the all-reduce
    # (ends at 425): 425 + 5 + 375 = 805 µs, not the 700 a share-based estimate gives.
    assert w["compute_2x"] == pytest.approx(805.0, abs=0.5)
    assert w["no_exposed_comm"] == pytest.approx(1000.0, abs=0.5)  # hidden already: nothing to win
    assert w["comm_2x"] == pytest.approx(1000.0, abs=0.5)
    # No host gaps (as with CUDA graphs): launches at the step's start, the GEMM sets the pace.
    assert w["no_host_gaps"] == pytest.approx(600.0, abs=0.5)


def test_cpu_traces_replay_their_chain_of_classes():
    data = trace_rank(FIXTURES / "cpu_data_rank0.pt.trace.json.gz")
    e = {x["change"]: x for x in data["what_if"]}
    waited = data["critical_path"]["by_class_ms"]["data"]
    assert e["no_data_wait"]["predicted_step_ms"] == pytest.approx(e["no_data_wait"]["baseline_step_ms"] - waited,
                                                                  rel=0.05)
    compute = trace_rank(FIXTURES / "cpu_compute_rank0.pt.trace.json.gz")
    e = {x["change"]: x for x in compute["what_if"]}
    work = compute["critical_path"]["by_class_ms"]["compute"]
    assert e["compute_2x"]["predicted_step_ms"] == pytest.approx(e["compute_2x"]["baseline_step_ms"] - work / 2,
                                                                rel=0.05)
    assert e["memory_kernels_2x"]["predicted_step_ms"] is None  # no memory-bound work traced


def test_job_entry_follows_the_slowest_paced_rank():
    """Two ranks, one step: rank 1 computes 30 ms longer and rank 0 waits for it in the all-reduce."""
    def rank(r, dur, wait, saved_compute):
        return TraceRankFacts(rank=r, steps=[{
            "step": 1, "duration_ms": dur, "replayed_ms": dur, "present_classes": ["comm", "compute"],
            "shares": {"wait": wait / dur}, "critical_path": {"by_class_ms": {"compute": dur - wait}},
            "what_if_ms": {"compute_2x": dur - saved_compute, "no_exposed_comm": dur - wait - 5.0}}])

    changes = [c for c in dt.load_tree().what_if if c["id"] in ("compute_2x", "no_exposed_comm", "no_straggler")]
    cp, entries = job_what_if([rank(0, 100.0, 30.0, 30.0), rank(1, 100.0, 0.0, 45.0)], changes)
    e = {x["change"]: x for x in entries}
    assert cp["rank"] == 1
    assert e["no_straggler"]["predicted_step_ms"] == pytest.approx(70.0)  # rank 0's own pace
    # Both ranks halve their compute: rank 1 (55 ms) still sets the pace.
    assert e["compute_2x"]["predicted_step_ms"] == pytest.approx(55.0)
    # No communication: each rank at its own pace without the collective (rank 1: 95 ms).
    assert e["no_exposed_comm"]["predicted_step_ms"] == pytest.approx(95.0)


def test_json_contract_per_rank_and_for_the_job():
    out = subprocess.run([sys.executable, "-m", "diag", "analyze", "--json",
                          str(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz"),
                          str(FIXTURES / "cpu_comm_rank1.pt.trace.json.gz")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    keys = {"change", "description", "baseline_step_ms", "predicted_step_ms", "speedup"}
    for block in [r["what_if"] for r in doc["ranks"]] + [doc["job"]["what_if"]]:
        assert block and all(keys <= set(x) for x in block)
    assert [x["change"] for x in doc["job"]["what_if"]] == list(STANDARD)
    assert [x["change"] for x in doc["ranks"][0]["what_if"]] == list(STANDARD[:-1])  # no_straggler: job only
    comm = next(x for x in doc["job"]["what_if"] if x["change"] == "no_exposed_comm")
    assert comm["speedup"] > 1.5  # this job is all exposed communication
    assert doc["diagnosis"]["what_if"]["changes"] == doc["job"]["what_if"]


def test_config_file_adds_a_change_and_rejects_a_bad_one(tmp_path):
    good = tmp_path / "diag.toml"
    good.write_text('[[what_if]]\nid = "data_half"\ndescription = "Half the data wait"\nscale = { data = 0.5 }\n')
    tree = dt.load_tree(good)
    assert [c["id"] for c in tree.what_if][-1] == "data_half"
    rank = trace_rank(FIXTURES / "cpu_data_rank0.pt.trace.json.gz", tree=tree)
    e = {x["change"]: x for x in rank["what_if"]}
    half = e["data_half"]["baseline_step_ms"] - e["data_half"]["predicted_step_ms"]
    full = e["no_data_wait"]["baseline_step_ms"] - e["no_data_wait"]["predicted_step_ms"]
    assert half == pytest.approx(full / 2, rel=0.02)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[what_if]]\nid = "x"\nscale = { gpu = 0.5 }\n')
    out = subprocess.run([sys.executable, "-m", "diag", "analyze", "--config", str(bad),
                          str(FIXTURES / "cpu_data_rank0.pt.trace.json.gz")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown part 'gpu'" in lines[0]


def test_prediction_check_in_compare():
    from diag.analyzers.diagnosis.change import prediction_check

    def model(base, pred=None):
        return [{"change": "no_data_wait", "description": "d", "baseline_step_ms": base, "fixes": "data",
                 "predicted_step_ms": pred, "speedup": base / pred if pred else None}]

    # A phase that fell is no evidence of a change: none is inferred (tests/test_compare_grading.py).
    assert prediction_check(model(100.0, 60.0), model(64.0), None) is None
    c = prediction_check(model(100.0, 60.0), model(64.0), "no_data_wait")
    assert c["change"] == "no_data_wait" and not c["inferred"] and c["kind"] == "ceiling"
    assert c["error"] == pytest.approx(60.0 / 64.0 - 1)
    assert "an error of -6.2%" in c["text"]
    c = prediction_check(model(100.0, None), model(64.0), "no_data_wait")
    assert c["error"] is None and c["text"].startswith("No prediction for no_data_wait (as given)")


def test_compare_rejects_an_unknown_change(tmp_path):
    out = subprocess.run([sys.executable, "-m", "diag", "compare", str(tmp_path), str(tmp_path),
                          "--applied", "faster_everything"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown change 'faster_everything'" in out.stderr


def test_comm_bandwidth_gain_interpolates_the_replayed_points():
    from diag.analyzers.diagnosis.recommendations import _comm_at

    w = [{"change": "no_exposed_comm", "description": "d", "baseline_step_ms": 100.0, "predicted_step_ms": 60.0},
         {"change": "comm_2x", "description": "d", "baseline_step_ms": 100.0, "predicted_step_ms": 80.0}]
    assert _comm_at(w, 0.25)["predicted_step_ms"] == pytest.approx(70.0)
    assert _comm_at(w, 0.75)["predicted_step_ms"] == pytest.approx(90.0)


def test_ranks_trading_places_are_noise_not_a_straggler():
    """Eight steps in which the two ranks take turns being 10 ms slower: neither is a straggler."""
    def rank(r):
        steps = []
        for k in range(8):
            slow = (k + r) % 2 == 0
            steps.append({"step": k, "duration_ms": 100.0, "replayed_ms": 100.0, "present_classes": ["compute"],
                          "shares": {"wait": 0.0 if slow else 0.1}, "critical_path": {"by_class_ms": {}},
                          "what_if_ms": {}})
        return TraceRankFacts(rank=r, steps=steps)

    tree = dt.load_tree()
    changes = [c for c in tree.what_if if c["id"] == "no_straggler"]
    _, entries = job_what_if([rank(0), rank(1)], changes)
    (e,) = straggler_what_if(entries, tree)
    assert e["predicted_step_ms"] is None and "within the run's own step-to-step noise" in e["note"]
    assert "pace_lag_ms_by_step" in entries[0]  # the facts are left as they were


def test_a_steady_lag_beyond_the_noise_is_a_straggler():
    """The same job with rank 1 10 ms slower in every step: its lag is clear of the noise."""
    def rank(r):
        steps = [{"step": k, "duration_ms": 100.0, "replayed_ms": 100.0, "present_classes": ["compute"],
                  "shares": {"wait": 0.1 if r == 0 else 0.0}, "critical_path": {"by_class_ms": {}},
                  "what_if_ms": {}} for k in range(8)]
        return TraceRankFacts(rank=r, steps=steps)

    tree = dt.load_tree()
    _, entries = job_what_if([rank(0), rank(1)], [c for c in tree.what_if if c["id"] == "no_straggler"])
    (e,) = straggler_what_if(entries, tree)
    assert e["predicted_step_ms"] == pytest.approx(90.0) and "pace_lag_ms_by_step" not in e


def _step_spans(events):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("cat") != "gpu_user_annotation"]


def test_removing_the_sync_ops_takes_exactly_their_time_off_each_step():
    """A CPU trace whose steps call .item() 60 times (tests/fixtures/make_cpu_traces.py,
    profile_host): replayed without them, each step is shorter by the aten::item ops'
    durations in it, read from the file (all of it host time: item and the
    _local_scalar_dense inside it are host ops)."""
    path = FIXTURES / "cpu_host_rank0.pt.trace.json.gz"
    rank = trace_rank(path)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    items = [e for e in events if e.get("name") == "aten::item" and e.get("ph") == "X"]
    checked = 0
    for step, (lo, hi) in zip(rank["steps"], _step_spans(events)):
        removed = sum(e["dur"] for e in items if lo <= e["ts"] < hi) / 1e3
        assert removed > 0
        # Timestamps of ~1e15 µs carry float64 rounding of about 0.001 µs per edge.
        assert step["replayed_ms"] - step["what_if_ms"]["no_sync_points"] == pytest.approx(removed, abs=1e-5)
        checked += 1
    assert checked == len(rank["steps"]) >= 3
    # A trace with no .item() calls has nothing to remove: no prediction, said so.
    compute = trace_rank(FIXTURES / "cpu_compute_rank0.pt.trace.json.gz")
    entry = next(e for e in compute["what_if"] if e["change"] == "no_sync_points")
    assert entry["predicted_step_ms"] is None


def test_a_removal_change_is_checked_and_survives_being_recorded(tmp_path):
    tree = dt.load_tree()
    recorded = {"schema": dt.SETTINGS_SCHEMA, "thresholds": {}, "what_if": [dict(c) for c in tree.what_if]}
    again = dt.load_tree(recorded=recorded)
    assert [c for c in again.what_if if "remove" in c] == [c for c in tree.what_if if "remove" in c]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[what_if]]\nid = "x"\nremove = "everything"\n')
    with pytest.raises(dt.TreeError, match="remove must be one of elementwise_chain"):
        dt.load_tree(bad)
    both = tmp_path / "both.toml"
    both.write_text('[[what_if]]\nid = "x"\nremove = "fp32_math"\nscale = { compute = 0.5 }\n')
    with pytest.raises(dt.TreeError, match="give scale or remove, not both"):
        dt.load_tree(both)


def test_a_change_with_steps_is_replayed_on_that_many_device_steps(real_traces, tmp_path):
    """The cause changes set steps = 4 (each replay of a device step costs milliseconds): on a
    V100 trace of 5 steps they are replayed on 4, evenly spaced, and the others on all 5."""
    rank = trace_rank(real_traces / "v100_1rank_compute.json.gz")
    replayed = [s for s in rank["steps"] if "what_if_ms" in s]
    assert len(replayed) == 5
    assert sum("tensor_core_math" in s["what_if_ms"] for s in replayed) == 4
    assert all("compute_2x" in s["what_if_ms"] for s in replayed)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[what_if]]\nid = "x"\nscale = { compute = 0.5 }\nsteps = 0\n')
    with pytest.raises(dt.TreeError, match="steps must be a whole number >= 1"):
        dt.load_tree(bad)


def test_a_copy_that_blocks_its_own_call_keeps_the_replay_in_order():
    """HTA's AlexNet benchmark (tests/fixtures/real): blocking copies wait for the work they
    launch, and one stream runs two nodes in another order than their calls launched them.
    The replay still places every node after what it depends on, so a step without its host
    time is its device work (68 ms), not the 30 s the host spent before launching it."""
    import numpy as np

    from diag.analyzers.trace import timeline
    from diag.analyzers.trace.load import load_trace, step_windows
    from diag.analyzers.whatif import graph as wg
    from diag.analyzers.whatif import replay as wr

    trace = load_trace(str(FIXTURES / "real" / "a100_alexnet_benchmark_allocator.json.gz"))
    tl = timeline.attributed_timeline(trace, step_windows(trace), True, None)
    classes, layers = tl.classes, tl.layers
    (g,) = wg.step_graphs(trace, classes, layers["data"], step_windows(trace))
    order = wr.topo_order(g)
    assert sorted(order) == sorted([(1, i) for i in range(g.n_host)] + [(0, j) for j in range(len(g.d_start))])
    at = {node: k for k, node in enumerate(order)}
    self_wait = wr._self_waits(g)
    assert self_wait.any()  # the blocking copies
    late = [j for j in range(len(g.d_start)) if g.d_launch[j] >= 0 and not self_wait[j]
            and at[(0, j)] < at[(1, int(g.d_launch[j]))]]
    assert late == []
    out = wr.replay(g, {"base": {}, "no_host": {"host": 0.0, "launch": 0.0, "sync": 0.0, "slack": 0.0}}, order)
    device_us = float(np.sum(g.d_end - g.d_start))
    assert out["base"] == pytest.approx(g.hi - g.lo, rel=0.01)
    assert out["no_host"] <= device_us * 1.01


def test_a_dependency_cycle_from_contradicting_timestamps_ends_the_walk_with_one_error():
    """Two device nodes each recorded as the other's predecessor on its stream (timestamps
    that contradict each other, as a damaged trace gives): the critical path's walk is bounded
    and says why, instead of following the cycle forever."""
    import numpy as np

    from diag.analyzers.whatif import replay as wr
    from diag.analyzers.whatif.graph import StepGraph

    one = np.array([0], dtype=np.int64)
    g = StepGraph(7, 0.0, 100.0, np.array([1.0]), np.array([2.0]), np.zeros(1), -one, np.zeros(1, dtype=bool), 0.0,
                  np.array([10.0, 20.0]), np.array([90.0, 95.0]), ["compute", "compute"],
                  np.array([-1, -1]), np.array([1, 0]), np.array([-1, -1]))
    with pytest.raises(ValueError, match="has a cycle"):
        wr.critical_path(g)


def test_a_synchronous_copy_seen_ending_after_its_call_still_holds_it():
    """A pageable copy on an H200 (tests/fixtures/real/h200/skew): cudaMemcpyAsync returns when
    its copy is done, yet the trace's device clock puts the copy's end 0.2 to 8 us after the call
    returned. The call still waits for its copy, so the step with the copy gone is shorter by
    about the copy's time, not unchanged."""
    import gzip
    import json

    import numpy as np

    from diag.analyzers.analyze import analyze_paths

    path = FIXTURES / "real" / "h200" / "skew" / "pageable_copy.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    calls = {e["args"]["correlation"]: e for e in events if e.get("name") == "cudaMemcpyAsync"}
    copies = [e for e in events if "Pageable" in str(e.get("name")) and e.get("cat") == "gpu_memcpy"]
    late = [c["ts"] + c["dur"] - calls[c["args"]["correlation"]]["ts"] - calls[c["args"]["correlation"]]["dur"]
            for c in copies]
    assert len(copies) == 3 and all(0 < x < 25 for x in late)  # the premise: each copy ends after its call
    doc = analyze_paths([str(path)], jobs=1)
    cause = next(c for c in doc.diagnosis.causes if c["id"] == "pageable_copies")
    w = cause["what_if"]
    copy_ms = float(np.median([c["dur"] for c in copies])) / 1e3
    assert w["baseline_step_ms"] - w["predicted_step_ms"] >= 0.8 * copy_ms


def test_a_loop_of_item_calls_is_one_span_and_a_launch_between_ends_it():
    import numpy as np

    from diag.analyzers.trace.removals import _value_loops

    spans = np.array([[0.0, 10.0], [15.0, 25.0], [40.0, 50.0], [200.0, 210.0]])
    # 15 -> 25 body of 5 us: one loop; a kernel launched at 30 ends it; 150 us of other work
    # after 50 is no loop body.
    got = _value_loops(spans, np.array([30.0]))
    assert got.tolist() == [[0.0, 25.0], [40.0, 50.0], [200.0, 210.0]]
    assert _value_loops(spans[:1], np.array([])).tolist() == [[0.0, 10.0]]


def test_keeping_the_values_on_the_device_removes_the_whole_loop_over_them():
    """An H200 trace of 32 .item() calls a step (tests/fixtures/real/h200/item_sync): the loop
    over the values (each index, its read, the Python between) is host time the change removes,
    less the runtime calls the step's graph holds apart; the replay takes about that off."""
    import gzip
    import json

    from diag.analyzers.analyze import analyze_paths

    path = FIXTURES / "real" / "h200" / "item_sync.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = [e for e in events if str(e.get("name")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    loops = []
    for s in steps:
        items = [e for e in events if e.get("name") == "aten::item" and s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        lo, hi = min(e["ts"] for e in items), max(e["ts"] + e["dur"] for e in items)
        calls = sum(e["dur"] for e in events if e.get("cat") == "cuda_runtime" and lo <= e["ts"] < hi)
        loops.append((hi - lo, calls))
    doc = analyze_paths([str(path)], jobs=1)
    w = next(c for c in doc.diagnosis.causes if c["id"] == "host_sync_points")["what_if"]
    saved_us = 1000 * (w["baseline_step_ms"] - w["predicted_step_ms"])
    span_us = sorted(span for span, _ in loops)[len(loops) // 2]
    body_us = sorted(span - calls for span, calls in loops)[len(loops) // 2]
    assert 0.8 * body_us <= saved_us <= span_us
