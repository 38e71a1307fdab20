"""The streaming Kineto loader against a plain json.load reference, on real traces and edge cases."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import numpy as np
import pytest

from diag.analyzers.trace import load as trace_load
from diag.analyzers.trace import read_blocks
from diag.analyzers.trace.load import load_trace, step_windows
from diag.errors import DiagInputError

DEVICE_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset", "cuda_sync"}
RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver"}
CPU_CATS = {"cpu_op", "Operator", "user_annotation", "python_function"}

TRACES = ["a100_2rank_nccl", "job128_rank0_sampled", "job128_rank1_sampled", "v100_1rank_compute",
          "mi250_rocm62_tiny", "v100_resnet50_workers0_oldschema"]


def reference_counts(path):
    with gzip.open(path) as f:
        doc = json.load(f)
    c = Counter()
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat")
        c["device" if cat in DEVICE_CATS else "runtime" if cat in RUNTIME_CATS else "cpu" if cat in CPU_CATS
          else "other"] += 1
    return doc, c


@pytest.mark.parametrize("name", TRACES)
def test_real_trace_columns_match_json(real_traces, name):
    path = real_traces / f"{name}.json.gz"
    doc, ref = reference_counts(path)
    tr = load_trace(path)
    assert tr.n_events == len(doc["traceEvents"])
    assert len(tr.dev_ts) == ref["device"]
    assert len(tr.rt_ts) == ref["runtime"]
    assert len(tr.cpu_ts) == ref["cpu"]
    # Device time adds up to the same total as the reference.
    dev_total = sum(e["dur"] for e in doc["traceEvents"] if e.get("cat") in DEVICE_CATS and e.get("ph") == "X")
    assert tr.dev_dur.sum() == pytest.approx(dev_total)
    assert tr.meta.get("deviceProperties") == doc.get("deviceProperties")
    assert tr.meta.get("distributedInfo") == doc.get("distributedInfo")
    steps = sorted({int(e["name"].split("#")[1]) for e in doc["traceEvents"]
                    if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") in CPU_CATS})
    assert [s[0] for s in tr.steps] == steps


def test_old_schema_string_tids_and_streams(real_traces):
    tr = load_trace(real_traces / "v100_resnet50_workers0_oldschema.json.gz")
    # 2021 schema: tid "stream 7", stream in args; kernels still get their integer stream.
    assert set(np.unique(tr.dev_stream).tolist()) == {7}
    assert tr.steps[0][0] == 16 and len(tr.steps) == 6
    assert tr.op_coverage is None  # no "Ev Idx" in 2021 traces


def test_hip_runtime_stream_string_is_not_a_device_stream(real_traces):
    tr = load_trace(real_traces / "mi250_rocm62_tiny.json.gz")
    names = tr.name_of(tr.rt_name)
    i = names.index("hipMemcpyWithStream")
    assert tr.rt_stream[i] == -1 and tr.rt_corr[i] == 117
    assert tr.gpu_step_ts.size == 1  # ProfilerStep#1 is also annotated on the GPU timeline


def test_sampled_traces_have_low_op_coverage(real_traces):
    assert load_trace(real_traces / "job128_rank0_sampled.json.gz").op_coverage < 0.05
    assert load_trace(real_traces / "a100_2rank_nccl.json.gz").op_coverage == pytest.approx(1.0)


def _write(path, doc, gz=False, compact=False):
    text = json.dumps(doc, separators=(",", ":") if compact else None)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _kernel(ts, name="k", dur=1.0, corr=1):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"stream": 7, "correlation": corr, "External id": corr}}


@pytest.mark.parametrize("compact", [False, True])
def test_chunk_boundaries_inside_strings(tmp_path, monkeypatch, compact):
    """Tiny chunks force boundaries everywhere, including `}, {` inside kernel names."""
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 64)
    monkeypatch.setattr(read_blocks, "READ_BYTES", 17)
    tricky = ["void f<{lambda()#1}, {lambda()#2}>(int)", 'quote " and }, { and ], "x": 1}', "plain"]
    events = [_kernel(float(i), name=tricky[i % 3], corr=i) for i in range(50)]
    doc = {"traceName": "x", "traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
           "distributedInfo": {"rank": 3, "world_size": 4}}
    p = _write(tmp_path / "t.json.gz", doc, gz=True, compact=compact)
    tr = load_trace(p)
    assert len(tr.dev_ts) == 50
    assert tr.name_of(tr.dev_name[:3]) == tricky
    assert tr.meta["distributedInfo"]["rank"] == 3
    assert tr.meta["deviceProperties"][0]["name"] == "NVIDIA H100"
    assert tr.meta["traceName"] == "x"


def test_empty_trace_events_is_an_error(tmp_path):
    p = _write(tmp_path / "e.json", {"schemaVersion": 1, "traceEvents": []})
    with pytest.raises(DiagInputError, match="no events"):
        load_trace(p)


def test_without_profiler_steps_the_whole_trace_is_one_window(tmp_path):
    p = _write(tmp_path / "n.json", {"traceEvents": [_kernel(10.0, dur=5), _kernel(30.0, dur=2, corr=2)]})
    tr = load_trace(p)
    assert step_windows(tr) == [(None, 10.0, 32.0)]


@pytest.mark.parametrize("content, problem", [
    (b"", "empty file"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1}, {"ph": "X"', "truncated"),
    (b'{"schemaVersion": 1, "other": []}', "no traceEvents"),
    (b"[1, 2, 3]", "not a Kineto trace"),
    (b"\x00\x01garbage", "not JSON"),
    # Its only event has no readable timestamp: skipped, which leaves nothing to analyse.
    (b'{"traceEvents": [{"ph": "X", "cat": 5, "ts": "x"}]}', "trace has no events"),
])
def test_bad_json_is_one_clear_error(tmp_path, content, problem):
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(DiagInputError, match=problem) as exc:
        load_trace(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


def test_parallel_decoding_equals_serial(tmp_path, monkeypatch, real_traces):
    """Worker processes decode slices cut at quote-parity boundaries; the merged columns,
    names, steps and extras are identical to decoding in this process."""
    src = real_traces / "a100_2rank_nccl.json.gz"
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 1 << 20)  # ~40 slices for 2 workers
    serial = load_trace(src, workers=1)
    par = load_trace(src, workers=2)
    assert par.n_events == serial.n_events
    names_s, names_p = np.array(serial.names, dtype=object), np.array(par.names, dtype=object)
    assert np.array_equal(names_s[serial.dev_name], names_p[par.dev_name])
    assert np.array_equal(names_s[serial.cpu_name], names_p[par.cpu_name])
    for col in ("dev_ts", "dev_dur", "dev_stream", "dev_corr", "dev_ext", "rt_ts", "rt_corr", "cpu_ts", "cpu_dur",
                "cpu_tid", "cpu_ext", "cpu_kind", "dev_kind"):
        assert np.array_equal(getattr(serial, col), getattr(par, col)), col
    assert par.steps == serial.steps and par.meta == serial.meta
    assert par.coll_args == serial.coll_args and par.op_coverage == serial.op_coverage


def test_parallel_decoding_skips_damaged_events_as_serial_does(tmp_path, monkeypatch, real_traces):
    raw = gzip.decompress((real_traces / "a100_2rank_nccl.json.gz").read_bytes())
    i = raw.find(b'"name":', len(raw) // 2) + 6
    # A colon turned into a semicolon: the quotes still pair up, so the slice goes to a worker.
    (tmp_path / "flip.json.gz").write_bytes(gzip.compress(raw[:i] + b";" + raw[i + 1:]))
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 1 << 20)
    serial = load_trace(tmp_path / "flip.json.gz", workers=1)
    par = load_trace(tmp_path / "flip.json.gz", workers=2)
    assert serial.repairs["events"] == par.repairs["events"] == 1
    assert par.n_events == serial.n_events and np.array_equal(par.dev_ts, serial.dev_ts)


def test_quote_parity_boundaries():
    events = [{"name": "a\\"}, {"name": 'x"}, {"y'}, {"name": '\\"}, {'}, {"name": "q}, {", "v": 1}, {"n": 2}]
    text = json.dumps(events)[1:-1].encode()
    truth, pos = [], 0
    for e in events[:-1]:
        t = json.dumps(e).encode()
        pos = text.index(t, pos) + len(t)
        truth.append(pos)
    found, start = [], 0
    while (end := trace_load._boundary_outside_strings(text, start, start)) is not None:
        found.append(end)
        start = text.index(b"{", end)
    assert found == truth
