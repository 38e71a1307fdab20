"""No claim without its evidence: a GPU process's trace without its device events gets no
class and no cause about the device's work ("can't tell"), on real traces with their device
events stripped, as another CUPTI client or a filter leaves them. (A cold first launch:
tests/test_causes.py.)"""

from __future__ import annotations

import gzip
import json

import pytest
from rank_documents import ranks_of

from diag.analyzers.analyze import analyze_paths

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset"}
# Causes that rest on the device's work (kernels, or the ops whose kernels they time).
DEVICE_CAUSES = {"elementwise_chain", "matrix_ops", "fp32_math", "bandwidth_kernels", "optimizer_step",
                 "launch_bound", "exposed_collectives", "pageable_copies", "allocator_calls",
                 "cpu_work_on_training_thread"}


def _stripped(real_data, tmp_path, name: str, keep, drop_keys=()) -> tuple[str, list]:
    with gzip.open(real_data / "traces" / name) as f:
        doc = json.load(f)
    events = [e for e in doc["traceEvents"] if keep(e)]
    doc = {k: v for k, v in doc.items() if k not in drop_keys} | {"traceEvents": events}
    path = tmp_path / f"stripped-{name}"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return str(path), events


def _assert_cant_tell(doc) -> None:
    d = doc.diagnosis
    assert d.bound is None and ranks_of(doc)[0]["bound"] is None
    assert all(s.get("bound") is None for s in ranks_of(doc)[0]["steps"])
    assert d.headline["text"].startswith("Can't tell: the trace holds no device events")
    assert not DEVICE_CAUSES & {c["id"] for c in d.causes}
    assert not [r for r in d.recommendations if r["id"].startswith("phase-")]
    assert "device_events_missing" in {f["id"] for f in d.findings}


@pytest.mark.parametrize("name", ["v100_1rank_compute.json.gz", "a100_2rank_nccl.json.gz"])
def test_runtime_calls_without_device_events_cant_be_told(real_data, tmp_path, name):
    path, events = _stripped(real_data, tmp_path, name, lambda e: e.get("cat") not in DEVICE_CATS)
    # The input: the runtime's launches are there, their kernels are not.
    assert any(e.get("cat") == "cuda_runtime" and e.get("name") == "cudaLaunchKernel" for e in events)
    assert not any(e.get("cat") == "kernel" for e in events)
    full = analyze_paths([str(real_data / "traces" / name)], jobs=1)
    assert full.diagnosis.bound is not None  # with its device events, the trace has a class
    _assert_cant_tell(analyze_paths([path], jobs=1))


def test_a_host_only_trace_with_nccl_collectives_is_a_gpu_process(real_data, tmp_path):
    """Host ops only: no deviceProperties, no runtime calls, no process-group record; its
    collectives are nccl:* ops, and NCCL runs only on GPUs."""
    host = {"cpu_op", "user_annotation", "python_function", None, "Trace"}
    path, events = _stripped(real_data, tmp_path, "a100_2rank_nccl.json.gz", lambda e: e.get("cat") in host,
                             drop_keys=("distributedInfo", "deviceProperties"))
    assert any(str(e.get("name", "")).startswith("nccl:") for e in events)
    assert not any(e.get("cat") in ("cuda_runtime", "kernel") for e in events)
    doc = analyze_paths([path], jobs=1)
    assert ranks_of(doc)[0]["device_events_missing"] is True
    _assert_cant_tell(doc)


def test_a_sampled_trace_names_no_cause_from_its_ops(real_traces):
    """job128's traces hold a small share of the host events the profiler numbered (filtered
    after recording): its steps count as sampled, not traced, so no rule reads their ops as a
    step's whole work. Its facts are kept as measured; only the diagnosis weighs them."""
    from diag.analyzers.diagnosis.inputs import traced_steps, weighed_facts

    doc = analyze_paths([str(real_traces / f"job128_rank{r}_sampled.json.gz") for r in (0, 1)], jobs=1)
    for r in doc.ranks:
        assert r.verdict.sampled is True
        assert {s["evidence"] for s in r.facts.steps} == {"trace"}  # as measured
        assert traced_steps(r.facts) > 0 and traced_steps(weighed_facts(r)) == 0
    assert doc.diagnosis.causes == []
    assert "sampled_trace" in {f["id"] for f in doc.diagnosis.findings}
