"""Per-step attribution: exact shares on constructed traces, and verdicts on the real traces."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rank_documents import trace_rank

from diag.analyzers.intervals import normalize
from diag.analyzers.trace.attribution import BOUNDS, CLASSES, attribute, normalize_shares


def _x(cat, name, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _kernel(name, ts, dur, corr):
    return _x("kernel", name, ts, dur, tid=7, pid=0, stream=7, correlation=corr, **{"External id": corr})


def _write(tmp_path, events, **meta):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"schemaVersion": 1, **meta, "traceEvents": events}))
    return p


def test_gpu_priority_compute_memory_comm_data_host(tmp_path):
    events = [
        _x("user_annotation", "ProfilerStep#1", 0, 100),
        _x("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 20),
        _x("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 75, 15),
        _kernel("volta_sgemm_128x64_nn", 10, 30, 1),  # compute [10, 40)
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 30, 30, 2),  # [30, 60)
        _kernel("void at::native::vectorized_elementwise_kernel<4>(int)", 50, 20, 3),  # memory [50, 70)
        # profile_memory=True: allocator state as instant events; 10 GiB of 40 in use at peak.
        {"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 15,
         "args": {"Device Type": 1, "Device Id": 0, "Total Allocated": 10 * 2**30, "Bytes": 2**30}},
    ]
    props = [{"id": 0, "name": "NVIDIA A100-SXM4-40GB", "totalGlobalMem": 40 * 2**30}]
    r = trace_rank(_write(tmp_path, events, deviceProperties=props))
    (step,) = r["steps"]
    # compute 30; memory 20; comm only where no kernel runs: [40, 50) = 10;
    # data only while the device idles: [0, 10) + [75, 90) = 25; host the rest = 15.
    assert step["shares"] == pytest.approx({"compute": 0.30, "memory": 0.20, "comm": 0.10, "data": 0.25,
                                            "host": 0.15, "wait": 0.0})
    assert sum(step["shares"].values()) == 1.0
    assert r["attribution_order"] == ["compute", "memory", "comm", "data", "host"]
    assert step["measurements"]["memory_to_compute"] == pytest.approx(20 / 30)
    # Data 25% of the step >= 20%: data-bound, and the path shows value and threshold.
    assert step["bound"] == "data"
    assert step["path"][0]["metric"] == "data_share" and step["path"][0]["threshold"] == 0.2
    assert r["measurements"]["memory_used_frac"] == 0.25
    assert "low_memory_use" in [f["id"] for f in r["findings"]]
    assert r["device"] == "NVIDIA A100-SXM4-40GB" and r["device_info"]["peaks"]["key"] == "a100-40gb"


def test_cpu_only_priority_data_compute_memory_comm_host(tmp_path):
    events = [
        _x("user_annotation", "ProfilerStep#3", 0, 100),
        _x("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 20),
        _x("cpu_op", "aten::stack", 5, 10),  # collate inside the DataLoader: data
        _x("cpu_op", "aten::mm", 20, 30),
        _x("cpu_op", "aten::copy_", 20, 5),  # child of the matmul: compute
        _x("cpu_op", "aten::add", 50, 10),  # leaf elementwise: memory
        _x("cpu_op", "aten::add", 60, 2),  # shorter than the dispatch overhead: host
        _x("user_annotation", "gloo:all_reduce", 40, 40, tid=2),  # gloo thread
    ]
    r = trace_rank(_write(tmp_path, events, distributedInfo={"backend": "gloo", "rank": 1, "world_size": 2}))
    assert r["rank"] == 1 and r["world_size"] == 2 and r["timeline"] == "cpu"
    (step,) = r["steps"]
    assert step["step"] == 3
    assert step["shares"] == pytest.approx({"data": 0.20, "compute": 0.30, "memory": 0.10, "comm": 0.20,
                                            "host": 0.20, "wait": 0.0})
    assert r["collectives"] == [{"name": "all_reduce", "pg": None, "seq": None, "ts_us": 40.0, "dur_us": 40.0,
                                 "bytes": None, "on": "host", "op": "gloo:all_reduce", "step": 3,
                                 # the comm share's [60, 80): the collective is exposed only there
                                 "exposed": [[60.0, 80.0]],
                                 "after_backward": None}]  # the step ran no backward pass


def test_attribute_windows_and_exact_sum():
    layers = {"compute": normalize([[0, 3], [10, 11]]), "comm": normalize([[2, 6]])}
    out = attribute(layers, ("compute", "memory", "comm", "data"), np.array([[0, 5], [5, 12]]))
    assert out["us"]["compute"].tolist() == [3, 1]
    assert out["us"]["comm"].tolist() == [2, 1]
    assert out["us"]["host"].tolist() == [0, 5]
    for s in out["shares"]:
        assert sum(s.values()) == 1.0 and set(s) == set(CLASSES)


def test_normalize_shares_sums_to_one_exactly():
    s = normalize_shares({"data": 1 / 3, "host": 1 / 3, "comm": 1 / 3}, 1.0)
    assert sum(s.values()) == 1.0
    assert normalize_shares({}, 0.0)["host"] == 1.0


# --- real traces ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(real_traces):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = trace_rank(real_traces / f"{name}.json.gz")
        return cache[name]

    return get


REAL = ["a100_2rank_nccl", "job128_rank0_sampled", "v100_1rank_compute", "mi250_rocm62_tiny",
        "v100_resnet50_workers0_oldschema"]


@pytest.mark.parametrize("name", REAL)
def test_real_shares_partition_every_step(real, name):
    r = real(name)
    assert sum(r["shares"].values()) == 1.0
    for s in r["steps"]:
        assert sum(s["shares"].values()) == 1.0
        assert all(0.0 <= v <= 1.0 for v in s["shares"].values())
        assert s["bound"] in BOUNDS


def test_v100_compute_is_compute_bound(real):
    r = real("v100_1rank_compute")
    assert r["bound"] == "compute"
    # Every full step is compute-bound too (the first is a warm-up of half the length).
    assert [s["bound"] for s in r["steps"][1:]] == ["compute"] * 4
    assert r["shares"]["compute"] > r["shares"]["memory"] > r["shares"]["host"]


def test_resnet50_num_workers_0_is_data_bound(real):
    # The TensorBoard profiler plugin reported the DataLoader at about 23% of the step.
    r = real("v100_resnet50_workers0_oldschema")
    assert r["shares"]["data"] == pytest.approx(0.23, abs=0.03)
    assert r["bound"] == "data"
    assert r["path"][0]["node"] == "data_wait" and r["path"][0]["answer"] == "yes"


def test_a100_ddp_is_host_bound(real):
    # The GPU is busy only ~23% of each step (HTA: 77.8% idle) and there is no DataLoader
    # wait. The idle gaps are spent on the host: DDP's buffer handling
    # (aten::unflatten_dense_tensors, ~15 ms per step) and launching many tiny ops, while no
    # kernel runs. So the device is starved by the host, not by data or the network.
    r = real("a100_2rank_nccl")
    assert r["device_info"]["peaks"]["key"] == "a100-40gb"
    assert r["shares"]["data"] == 0.0
    assert r["shares"]["host"] > 0.6
    assert r["bound"] == "host"
    assert [p["node"] for p in r["path"]] == ["data_wait", "peer_wait", "device_busy", "idle_cause"]
    assert {c["name"] for c in r["collectives"]} >= {"all_reduce", "broadcast"}
    assert all(c["on"] == "device" and c["pg"] == "0" for c in r["collectives"])


def test_mi250_tiny_is_host_bound(real):
    # A toy model: kernels of a few microseconds, the device idle ~98% of the step.
    r = real("mi250_rocm62_tiny")
    assert r["device_info"]["peaks"]["key"] == "mi250-gcd"
    assert r["shares"]["host"] > 0.9 and r["bound"] == "host"
    # record_shapes is on: FLOPs come from the shapes, the tiny GEMMs sit below the roofline knee.
    gemm = [k for k in r["top_kernels"] if k["name"].startswith("Cijk_")]
    assert gemm and all(k["class"] == "memory" and k["intensity"] < 10 for k in gemm)
    assert r["mfu"] is not None and r["mfu"] < 0.01


def test_sampled_trace_is_flagged(real):
    r = real("job128_rank0_sampled")
    assert r["sampled"] is True
    assert r["findings"][0]["id"] == "sampled_trace"
    assert all(s["evidence"] == "sampled" for s in r["steps"])
    kinds = {c["name"] for c in r["collectives"]}
    assert "all_reduce" in kinds and "all_to_all" in kinds


def test_calls_of_one_collective_running_at_once_expose_their_time_once():
    """Two all-gathers of one process group overlap (a prefetch beside the current one), and a
    reduce-scatter of another group overlaps them both. The all-gathers' parts are disjoint, the
    earlier-started call's first, and add up to the exposed time their spans cover; the
    reduce-scatter keeps all of its own, whoever else runs beside it. Given out of start order."""
    from diag.analyzers.trace.analysis import _exposed

    comm = normalize(np.array([[20.0, 120.0], [140.0, 260.0]]))
    records = [{"name": "all_gather", "pg": "0", "ts_us": 50.0, "dur_us": 150.0},   # 50-200
               {"name": "all_gather", "pg": "0", "ts_us": 0.0, "dur_us": 100.0},    # 0-100
               {"name": "reduce_scatter", "pg": "1", "ts_us": 60.0, "dur_us": 200.0},  # 60-260
               {"name": "all_gather", "pg": "2", "ts_us": 10.0, "dur_us": 20.0}]    # 10-30: another group
    later, earlier, other, own_group = _exposed(records, comm)
    assert earlier["exposed"] == [[20.0, 100.0]]
    assert later["exposed"] == [[100.0, 120.0], [140.0, 200.0]]
    assert other["exposed"] == [[60.0, 120.0], [140.0, 260.0]]
    assert own_group["exposed"] == [[20.0, 30.0]]
    covered = sum(min(200.0, b) - max(0.0, a) for a, b in comm.tolist() if min(200.0, b) > max(0.0, a))
    assert sum(b - a for r in (earlier, later) for a, b in r["exposed"]) == covered == 160.0
