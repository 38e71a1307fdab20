"""The loader's fast paths give exactly the columns of its plain paths.

Fast paths: chunks decoded as a tagged union of per-category structs (falling back to one
generic event struct per chunk), and gzip inflated by ISA-L when python-isal is installed
(falling back to zlib). Both are compared here, on every real trace and on a synthetic
trace that mixes every category the loader reads with events the union does not know.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import zlib

import msgspec
import numpy as np
import pytest

from diag.analyzers.trace import load as trace_load
from diag.analyzers.trace import read_blocks
from diag.analyzers.trace import schema as trace_schema
from diag.analyzers.trace.load import load_trace
from diag.errors import DiagInputError

TRACES = ["a100_2rank_nccl", "job128_rank0_sampled", "job128_rank1_sampled", "v100_1rank_compute",
          "mi250_rocm62_tiny", "v100_resnet50_workers0_oldschema"]


def _generic_only(monkeypatch):
    def refuse(data):
        raise msgspec.ValidationError("fast path switched off by the test")

    monkeypatch.setattr(trace_schema, "_decode_tagged", refuse)


def assert_same_trace(a, b):
    assert a.names == b.names
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("name", TRACES)
def test_tagged_decoding_equals_generic_on_real_traces(real_traces, monkeypatch, name):
    path = real_traces / f"{name}.json.gz"
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 256 << 10)
    outcomes = []
    real = trace_schema._decode_tagged

    def watched(data):
        try:
            events = real(data)
        except msgspec.ValidationError:
            outcomes.append(False)
            raise
        outcomes.append(True)
        return events

    with monkeypatch.context() as m:
        m.setattr(trace_schema, "_decode_tagged", watched)
        fast = load_trace(path)
    # Only the chunks holding metadata events (no "cat") leave the fast path.
    assert sum(outcomes) >= len(outcomes) - 3
    assert any(outcomes) or len(outcomes) <= 3  # a tiny trace: every chunk holds metadata
    _generic_only(monkeypatch)
    assert_same_trace(fast, load_trace(path))


def _synthetic_events():
    ev = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "python"}},  # no "cat"
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#4", "pid": 1, "tid": 11, "ts": 0.0, "dur": 100.0,
         "args": {"External id": 1, "Ev Idx": 0}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "pid": 0, "tid": 7, "ts": 5.0,
         "dur": 90.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 11, "ts": 1.0, "dur": 10.0,
         "args": {"External id": 2, "Ev Idx": 1, "flops": 2.0e9, "Input Dims": [[64, 128], [128, 256]],
                  "Input type": ["float", "float"]}},
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 11, "ts": 20.0, "dur": 3.0,
         "args": {"External id": 3, "Ev Idx": 2, "Collective name": "allreduce", "Process Group Name": "0",
                  "Group size": 2, "In msg nelems": 1024, "dtype": "Float", "Seq": 7}},
        {"ph": "X", "cat": "python_function", "name": "train.py(10): step", "pid": 1, "tid": 11, "ts": 0.5,
         "dur": 99.0, "args": {"Python id": 1}},
        {"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_DataLoaderIter.__next__",
         "pid": 1, "tid": "main", "ts": 30.0, "dur": 4.0, "args": {"External id": 4}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 11, "ts": 2.0,
         "dur": 1.0, "args": {"correlation": 10, "External id": 2, "cbid": 211}},
        {"ph": "X", "cat": "cuda_runtime", "name": "hipMemcpyWithStream", "pid": 1, "tid": 11, "ts": 3.0,
         "dur": 1.0, "args": {"correlation": 11, "stream": "0x0"}},
        {"ph": "s", "id": 10, "pid": 1, "tid": 11, "ts": 2.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": 6.0,
         "dur": 20.0, "args": {"External id": 2, "stream": 7, "correlation": 10, "grid": [1, 2, 3]}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 8,
         "ts": 30.0, "dur": 15.0, "args": {"External id": 3, "stream": 8, "correlation": 12,
                                           "Collective name": "allreduce", "Seq": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
         "ts": 50.0, "dur": 2.0, "args": {"stream": 7, "correlation": 11, "bytes": 4096}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 53.0, "dur": 1.0,
         "args": {"stream": 7, "correlation": 13, "bytes": 64}},
        {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0, "tid": 7, "ts": 55.0, "dur": 1.0,
         "args": {"stream": 7, "correlation": 14}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 11, "ts": 7.0, "s": "t",
         "args": {"Total Allocated": 5.0e8, "Device Type": 1, "Device Id": 0, "Bytes": 1024}},
        {"ph": "X", "cat": "a_category_from_the_future", "name": "x", "pid": 1, "tid": 11, "ts": 8.0, "dur": 1.0},
        {"ph": "X", "cat": "Operator", "name": "aten::add", "pid": 1, "tid": 12, "ts": 60.0, "dur": 5.0,
         "args": {"external id": 20}},
        {"ph": "X", "cat": "Kernel", "name": "elementwise_kernel", "pid": 0, "tid": "stream 7", "ts": 61.0,
         "dur": 3.0, "args": {"external id": 20, "stream": 7, "correlation": 30}},
        {"ph": "f", "id": 10, "pid": 0, "tid": 7, "ts": 6.0, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": 200.0},
    ]
    return ev


@pytest.mark.parametrize("chunk", [64, 300, 1 << 20])
def test_tagged_decoding_equals_generic_on_every_category(tmp_path, monkeypatch, chunk):
    """Chunks with and without events the union does not know (no "cat", a new category):
    the fast path falls back per chunk and the columns stay identical."""
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", chunk)
    doc = {"traceEvents": _synthetic_events() * 3, "distributedInfo": {"rank": 1, "world_size": 2}}
    p = tmp_path / "mixed.json"
    p.write_text(json.dumps(doc))
    fast = load_trace(p)
    with monkeypatch.context() as m:
        _generic_only(m)
        generic = load_trace(p)
    assert_same_trace(fast, generic)
    # And the columns hold what the events say.
    assert fast.n_events == 3 * len(_synthetic_events())
    assert len(fast.dev_ts) == 3 * 6 and len(fast.rt_ts) == 3 * 2 and len(fast.cpu_ts) == 3 * 6
    assert fast.steps == [(4, 0.0, 100.0)]
    assert fast.gpu_step_ts.tolist() == [5.0, 5.0, 5.0]
    assert fast.peak_allocated == {0: 5.0e8}
    hip = fast.name_of(fast.rt_name).index("hipMemcpyWithStream")
    assert fast.rt_stream[hip] == -1
    kinds = dict(zip(fast.name_of(fast.dev_name[:6]), fast.dev_kind[:6].tolist()))
    assert kinds["Memset (Device)"] == trace_schema.KIND_MEMSET and kinds["Stream Sync"] == trace_schema.KIND_SYNC
    add = fast.name_of(fast.cpu_name).index("aten::add")
    assert fast.cpu_ext[add] == 20  # 2021 schema "external id"
    mm = fast.name_of(fast.cpu_name).index("aten::mm")
    assert fast.cpu_flops[mm] == 2.0e9 and mm in fast.shapes
    assert {k[0] for k in fast.coll_args} == {"cpu", "dev"}


def test_fast_path_switches_off_after_repeated_misses(tmp_path, monkeypatch):
    """A trace whose events never carry "cat" is decoded by the generic struct after a few
    chunks, without trying the union on every chunk."""
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 200)
    events = [{"ph": "X", "name": f"op{i}", "ts": float(i), "dur": 1.0, "tid": 1} for i in range(200)]
    events.append({"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 1.0,
                   "args": {"stream": 7, "correlation": 1}})
    p = tmp_path / "nocat.json"
    p.write_text(json.dumps({"traceEvents": events}))
    calls = []
    real = trace_schema._decode_tagged

    def counting(data):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(trace_schema, "_decode_tagged", counting)
    tr = load_trace(p)
    assert len(tr.dev_ts) == 1 and len(tr.cpu_ts) == 0
    assert len(calls) <= 4


INFLATERS = ["zlib", "isal-decompressobj", "isal-reader"]


def _use_inflater(monkeypatch, which):
    if which == "zlib":
        monkeypatch.setattr(read_blocks, "_inflate", zlib)
        monkeypatch.setattr(read_blocks, "_GzipReader", None)
    elif which == "isal-decompressobj":
        pytest.importorskip("isal")
        monkeypatch.setattr(read_blocks, "_GzipReader", None)
    else:
        isal_zlib = pytest.importorskip("isal.isal_zlib")
        monkeypatch.setattr(read_blocks, "_GzipReader", isal_zlib._GzipReader)


@pytest.mark.parametrize("which", INFLATERS)
def test_every_inflater_gives_the_same_columns(real_traces, monkeypatch, which):
    path = real_traces / "v100_1rank_compute.json.gz"
    monkeypatch.setattr(read_blocks, "READ_BYTES", 64 << 10)  # many blocks: the reader's ring wraps
    with monkeypatch.context() as m:
        _use_inflater(m, "zlib")
        reference = load_trace(path)
    _use_inflater(monkeypatch, which)
    assert_same_trace(reference, load_trace(path))


@pytest.mark.parametrize("which", INFLATERS)
def test_every_inflater_reports_truncated_and_corrupt_gzip(tmp_path, real_traces, monkeypatch, which):
    _use_inflater(monkeypatch, which)
    data = (real_traces / "mi250_rocm62_tiny.json.gz").read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DiagInputError, match="truncated gzip"):
        load_trace(cut)
    bad = tmp_path / "corrupt.json.gz"
    bad.write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:200]) + data[200:])
    with pytest.raises(DiagInputError, match="corrupt gzip|JSON"):
        load_trace(bad)


@pytest.mark.parametrize("which", INFLATERS)
def test_concatenated_gzip_members(tmp_path, monkeypatch, which):
    _use_inflater(monkeypatch, which)
    doc = json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": float(i), "dur": 1.0, "args": {"stream": 7, "correlation": i}}
        for i in range(100)]}).encode()
    p = tmp_path / "multi.json.gz"
    half = len(doc) // 2
    p.write_bytes(gzip.compress(doc[:half]) + gzip.compress(doc[half:]))
    tr = load_trace(p)
    assert len(tr.dev_ts) == 100 and tr.dev_corr.tolist() == list(range(100))


@pytest.mark.parametrize("compact", [False, True])
def test_direct_block_decoding_equals_general_path(tmp_path, monkeypatch, compact):
    """Large inflated blocks are decoded straight from the block up to its last event
    boundary; when that boundary lies inside a kernel name the general path takes over.
    Both give the same columns as decoding through the cut buffer alone."""
    tricky = ["void f<{lambda()#1}, {lambda()#2}>(int)", 'q " }, { ], "x": 1}', "k},{k", "plain"]
    events = [{"ph": "X", "cat": "kernel", "name": f"{tricky[i % 4]}#{i % 7}", "pid": 0, "tid": 7,
               "ts": float(i), "dur": 1.0, "args": {"stream": 7, "correlation": i, "External id": i}}
              for i in range(3000)]
    events += [{"ph": "X", "cat": "cpu_op", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1, "ts": 1000.0 * i,
                "dur": 999.0, "args": {"External id": 10**6 + i}} for i in range(3)]
    doc = {"traceEvents": events, "deviceProperties": [{"id": 0}, {"id": 1}], "traceName": "t"}
    text = json.dumps(doc, separators=(",", ":") if compact else None).encode()
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(text, compresslevel=1))
    monkeypatch.setattr(trace_load, "CHUNK_BYTES", 8 << 10)
    monkeypatch.setattr(read_blocks, "READ_BYTES", 2 << 10)
    outcomes = []
    real = trace_load._decode_direct

    def watched(buf, blk, b):
        rest = real(buf, blk, b)
        outcomes.append(rest is not None)
        return rest

    with monkeypatch.context() as m:
        m.setattr(trace_load, "_decode_direct", watched)
        direct = load_trace(p)
    assert any(outcomes), "blocks were never decoded directly"
    monkeypatch.setattr(trace_load, "_decode_direct", lambda buf, blk, b: None)
    general = load_trace(p)
    assert_same_trace(direct, general)
    assert direct.dev_corr.tolist() == list(range(3000))
    assert direct.name_of(direct.dev_name[:4]) == [f"{tricky[i]}#{i}" for i in range(4)]
    assert direct.meta["deviceProperties"] == [{"id": 0}, {"id": 1}]
