"""More real traces (tests/fixtures/real, see SOURCE.md there): an expert-parallel MoE training
step, vLLM tensor parallelism over symmetric memory, an MI300 DDP step over RCCL and an MI300
vLLM decode replayed from a HIP graph with Triton kernels.

Every number diag reports is checked against the same number computed here from the raw JSON
(json.load plus a plain regular expression over kernel names), never against diag's own output.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from functools import cache

import numpy as np
import pytest
from conftest import FIXTURES
from device_steps import device_step_windows
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_paths
from diag.analyzers.trace import event_classes as ec
from diag.analyzers.trace.load import load_trace

REAL = FIXTURES / "real"

# name: (communication kernels as a plain regex, kernels, communication kernels, ProfilerStep spans)
FIXTURE_FACTS = {
    "deepseek_v3_ep64_train_h800":
        (r"::ep::internode::(?:dispatch|combine|notify_dispatch|cached_notify)<", 963, 32, 1),
    "b200_vllm_tp8_symm_mem": (r"^ncclDevKernel_|::multimem_all_reduce_kernel<", 768, 74, 0),
    "mi300_ddp_resnet_rccl_step16": (r"^ncclDevKernel_", 1154, 8, 1),
    "mi300_vllm_decode_hipgraph_triton": (None, 425, 0, 0),
}
EVERY = list(FIXTURE_FACTS)


def _path(name):
    return REAL / f"{name}.json.gz"


@cache
def _raw(name) -> list[dict]:
    with gzip.open(_path(name), "rt") as f:
        return json.load(f)["traceEvents"]


def _kernels(name) -> list[dict]:
    return [e for e in _raw(name) if e.get("cat") == "kernel"]


def _comm_kernels(name) -> list[dict]:
    pattern = FIXTURE_FACTS[name][0]
    return [e for e in _kernels(name) if pattern and re.search(pattern, e["name"])]


def _steps(name) -> list[dict]:
    return [e for e in _raw(name) if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]


@cache
def _doc(name):
    return analyze_paths([str(_path(name))], jobs=1)


def test_fixtures_are_small_and_documented():
    source = (REAL / "SOURCE.md").read_text()
    for name in FIXTURE_FACTS:
        assert _path(name).stat().st_size < 330_000, name
        assert f"{name}.json.gz" in source, name


@pytest.mark.parametrize("name", sorted(FIXTURE_FACTS))
def test_fixture_facts(name):
    """What each fixture holds, counted from the raw JSON (guards against a swapped file)."""
    _, kernels, comm, steps = FIXTURE_FACTS[name]
    assert len(_kernels(name)) == kernels
    assert len(_comm_kernels(name)) == comm
    assert len(_steps(name)) == steps


@pytest.mark.parametrize("name", EVERY)
def test_loaded_and_analysed(name):
    doc = _doc(name)
    assert doc.errors == []
    (rank,) = ranks_of(doc)
    assert rank["n_events"] == len(_raw(name))
    steps = _steps(name)
    if steps:
        assert [s["step"] for s in rank["steps"]] == [int(e["name"].split("#")[1]) for e in steps]
        # Each step until the device ran what it launched (longer than its host span in both).
        windows = device_step_windows(_raw(name))
        assert [s["duration_ms"] for s in rank["steps"]] == pytest.approx([(b - a) / 1e3 for a, b in windows])
    else:
        # Without ProfilerStep spans the whole trace is one window: first event start to last end.
        timed = [e for e in _raw(name) if e.get("ph") == "X" and e.get("cat") in (
            "kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cpu_op", "user_annotation",
            "python_function")]
        span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
        assert [(s["step"], s["duration_ms"]) for s in rank["steps"]] == [(None, pytest.approx(span / 1e3))]


@pytest.mark.parametrize("name", EVERY)
def test_kernels_and_communication_match_the_raw_json(name):
    trace = load_trace(_path(name))
    kernels = trace.dev_kind == 0
    assert int(kernels.sum()) == len(_kernels(name))
    assert len(trace.steps) == len(_steps(name))
    cls = ec.device_classes(trace.names, trace.dev_name, trace.dev_kind)
    comm = cls == ec.COMM
    raw = _comm_kernels(name)
    assert int(comm.sum()) == len(raw)
    assert math.fsum(trace.dev_dur[comm].tolist()) == pytest.approx(math.fsum(e["dur"] for e in raw), abs=1e-6)
    # Every communication kernel becomes one device collective record.
    device_records = [c for c in ranks_of(_doc(name))[0]["collectives"] if c["on"] == "device"]
    assert len(device_records) == len(raw)


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _minus(a_set, b_set):
    out = []
    for a, b in a_set:
        cur = a
        for c, d in b_set:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append([cur, c])
            cur = max(cur, d)
        if cur < b:
            out.append([cur, b])
    return out


def test_expert_parallel_comm_on_its_own_stream_is_overlapped_not_memory():
    """DeepSeek-V3's DualPipe step: DeepEP dispatch/combine run on their own stream under the
    GEMMs. They are communication, and only the part no other device work hides is exposed."""
    name = "deepseek_v3_ep64_train_h800"
    ((lo, hi),) = device_step_windows(_raw(name))  # the step until its device work ended
    pattern = re.compile(FIXTURE_FACTS[name][0])

    def clipped(events):
        return _union([[max(e["ts"], lo), min(e["ts"] + e["dur"], hi)] for e in events
                       if min(e["ts"] + e["dur"], hi) > max(e["ts"], lo)])

    device = [e for e in _raw(name) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm = clipped([e for e in device if e.get("cat") == "kernel" and pattern.search(e["name"])])
    other = clipped([e for e in device if not (e.get("cat") == "kernel" and pattern.search(e["name"]))])
    exposed = sum(b - a for a, b in _minus(comm, other))
    busy_comm = sum(b - a for a, b in comm)
    assert exposed < 0.05 * busy_comm  # the raw data: almost all of it is hidden under compute

    comm_streams = {e["args"]["stream"] for e in _comm_kernels(name)}
    gemm_streams = {e["args"]["stream"] for e in _kernels(name) if "gemm" in e["name"].lower()}
    assert comm_streams and gemm_streams and not comm_streams & gemm_streams

    rank = ranks_of(_doc(name))[0]
    assert rank["shares"]["comm"] == pytest.approx(exposed / (hi - lo), rel=1e-6)
    assert rank["shares"]["comm"] > 0
    assert {c["name"] for c in rank["collectives"]} == {"all_to_all"}
    assert rank["bound"] != "memory"


def test_hip_graph_replay_with_triton_kernels():
    """ROCm 7 vLLM decode: one hipGraphLaunch replays every kernel, Triton ones included."""
    name = "mi300_vllm_decode_hipgraph_triton"
    (launch,) = [e for e in _raw(name) if e.get("cat") == "cuda_runtime" and e["name"] == "hipGraphLaunch"]
    corr = launch["args"]["correlation"]
    replayed = [e for e in _kernels(name) if e["args"].get("correlation") == corr]
    triton = [e for e in _kernels(name) if e["name"].startswith("triton_")]
    assert replayed and triton

    trace = load_trace(_path(name))
    kernels = trace.dev_kind == 0
    assert int((kernels & (trace.dev_corr == corr)).sum()) == len(replayed)
    names = np.array(trace.names, dtype=object)[trace.dev_name[kernels]]
    assert sum(n.startswith("triton_") for n in names) == len(triton)
    assert not (ec.device_classes(trace.names, trace.dev_name, trace.dev_kind) == ec.COMM).any()


def test_symmetric_memory_all_reduce_is_named():
    records = ranks_of(_doc("b200_vllm_tp8_symm_mem"))[0]["collectives"]
    multimem = [c for c in records if "multimem_all_reduce_kernel" in c["kernel"]]
    assert len(multimem) == len([e for e in _kernels("b200_vllm_tp8_symm_mem")
                                 if "multimem_all_reduce_kernel" in e["name"]])
    assert {c["name"] for c in multimem} == {"all_reduce"}


def test_rocm_string_typed_bytes_are_read_not_rejected():
    """The ROCm runtime writes "bytes": "128" on hipMemcpyAsync: each such field is read as a
    number and counted, and the trace is analysed whole."""
    doc = json.loads(gzip.decompress(_path("mi300_ddp_resnet_rccl_step16").read_bytes()))
    strings = [i for i, e in enumerate(doc["traceEvents"])
               if isinstance(e.get("args"), dict) and isinstance(e["args"].get("bytes"), str)]
    trace = load_trace(_path("mi300_ddp_resnet_rccl_step16"))
    assert trace.repairs["fields"] == len(strings) and trace.repairs["events"] == 0
    assert trace.n_events == len(doc["traceEvents"])
    assert trace.repairs["examples"][0] == f"event {strings[0]}: args.bytes = " \
        f"{doc['traceEvents'][strings[0]]['args']['bytes']!r} read as " \
        f"{float(doc['traceEvents'][strings[0]]['args']['bytes'])!r}"
