"""The compiled chunk decoder (`diag.analyzers.trace.scan`) builds the columns the Python path
builds: on every real trace, and on damaged, oddly typed and hostile chunks, where it either
gives the same columns or leaves the chunk to the Python path."""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import random
import shutil
import sysconfig
from pathlib import Path

import msgspec
import numpy as np
import pytest
from conftest import real_data_dir

from diag.analyzers.trace import load, scan
from diag.analyzers.trace.column_builder import ColumnBuilder

FIXTURES = Path(__file__).parent / "fixtures"
REAL = sorted((FIXTURES / "real").rglob("*.json.gz")) + sorted(FIXTURES.glob("*.pt.trace.json.gz"))

needs_scanner = pytest.mark.skipif(scan._kineto_scan is None,
                                   reason="the compiled decoder is not built here (no C compiler at install)")


def _buildable() -> bool:
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return headers.exists() and any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))


def test_the_compiled_decoder_is_built_wherever_it_can_be():
    """Where a C compiler and Python's headers exist (CI, this machine), the install built it."""
    if not _buildable():
        pytest.skip("no C compiler or no Python headers: the Python path decodes every trace")
    assert scan._kineto_scan is not None
    assert scan.compiled() or os.environ.get("DIAG_TRACE_DECODER") == "python"


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _differences(a, b) -> list[str]:
    return [f.name for f in dataclasses.fields(a) if f.name != "source"
            and not _same(getattr(a, f.name), getattr(b, f.name))]


class _Counted:
    """The scanner, counting the chunks it took."""

    def __init__(self, real):
        self.real, self.taken = real, 0

    def scan(self, *args):
        out = self.real.scan(*args)
        self.taken += isinstance(out, tuple) and out[0] != "trailing"
        return out


def _load_both(path, monkeypatch):
    monkeypatch.setenv("DIAG_TRACE_DECODER", "python")
    reference = load.load_trace(path)
    monkeypatch.delenv("DIAG_TRACE_DECODER")
    counted = _Counted(scan._kineto_scan)
    monkeypatch.setattr(scan, "_kineto_scan", counted)
    return reference, load.load_trace(path), counted.taken


@needs_scanner
@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_both_decoders_give_the_same_trace_on_the_real_fixtures(path, monkeypatch):
    reference, fast, taken = _load_both(path, monkeypatch)
    assert not _differences(reference, fast)
    # Only a trace whose fields the Python path had to repair (HIP's byte counts written as
    # strings) is left to it whole.
    assert taken >= 1 or reference.repairs, "the compiled decoder took no chunk of this trace"


@needs_scanner
def test_both_decoders_give_the_same_trace_on_the_shared_real_traces(monkeypatch):
    data = real_data_dir()
    if data is None:
        pytest.skip("no real data ($DIAG_REAL_DATA or ../shared/data)")
    paths = sorted((data / "traces").glob("*.json.gz"))
    assert paths
    taken = 0
    for path in paths:
        reference, fast, n = _load_both(path, monkeypatch)
        monkeypatch.undo()
        assert not _differences(reference, fast), path.name
        taken += n
    assert taken >= len(paths) // 2


# -- damaged and hostile chunks --------------------------------------------------------------

_VALUES = [b'"x"', b'"0x1"', b'""', b"null", b"true", b"-0", b"0", b"1e400", b"1.5", b"-1", b"[]", b"{}",
           b'"\\u00e9"', b'"\\ud800"', b"12345678901234567890", b"9223372036854775807", b"1E2",
           b'"\xc3\xa9"', b'"\xff"', b"[[[[1]]]]", b'{"a": {"b": [1, "c"]}}', b"0.1e-30", b"123456789.123456789",
           b"4458677101124.778", b"1e22", b"1e23", b"9007199254740993", b"0.30000000000000004", b"-0.0", b"5e-324"]
_KEYS = [b'"cat"', b'"name"', b'"tid"', b'"ts"', b'"dur"', b'"args"', b'"stream"', b'"correlation"',
         b'"External id"', b'"flops"', b'"bytes"', b'"Ev Idx"', b'"Input Dims"', b'"Collective name"',
         b'"Group size"', b'"Total Allocated"', b'"Device Type"', b'"Device Id"', b'"Process Group Name"',
         b'"na\\u006de"']
_CATS = [b'"kernel"', b'"cpu_op"', b'"cuda_runtime"', b'"ac2g"', b'"gpu_user_annotation"', b'"cpu_instant_event"',
         b'""', b'"Operator"', b'"unknown_cat"', b'"user_annotation"', b'"gpu_memcpy"', b'"Kernel"']


def _mutated(rng: random.Random, events: list[bytes]) -> bytes:
    """A chunk of real events with a few mutations of the kinds damage and hostile writers make."""
    evs = list(events)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(evs))
        e = evs[i]
        kind = rng.randrange(8)
        if kind == 0 and b":" in e:  # a value replaced by one of another type
            at = rng.choice([k for k in range(len(e)) if e[k:k + 1] == b":"])
            end = at + 1
            while end < len(e) and e[end:end + 1] not in b",}":
                end += 1
            e = e[:at + 1] + rng.choice(_VALUES) + e[end:]
        elif kind == 1:  # a key added (or repeated) at the front
            e = b"{" + rng.choice(_KEYS) + b":" + rng.choice(_VALUES) + b"," + e[1:]
        elif kind == 2:  # the category changed or dropped
            e = e.replace(b'"cat":', b'"cat":' + rng.choice(_CATS) + b',"was":', 1) if rng.random() < 0.7 \
                else e.replace(b'"cat"', b'"kat"', 1)
        elif kind == 3:  # a byte flipped
            k = rng.randrange(len(e))
            e = e[:k] + bytes([rng.randrange(256)]) + e[k + 1:]
        elif kind == 4:  # cut short
            e = e[:rng.randrange(1, len(e))]
        elif kind == 5:  # args given fields of every group
            e = e.replace(b'"args":{', b'"args":{' + rng.choice(_KEYS) + b":" + rng.choice(_VALUES) + b",", 1)
        elif kind == 6:  # a name with an escape or non-ASCII text
            e = e.replace(b'"name":"', b'"name":"' + rng.choice([b"\\n", b"\xc3\xa9", b"\\u00e9", b"\\\"", b"ProfilerStep#7"]), 1)
        else:  # an event that is not an object, or an empty one
            e = rng.choice([b"{}", b"[]", b"1", b"null", b'{"ph":"M"}'])
        evs[i] = e
    tail = rng.choice([b"]", b"]", b"]", b"] ,{}", b"]  \n", b"", b"],"])
    return b"[" + b",".join(evs) + tail


def _outcome(data: bytes, fast: bool):
    """What a fresh builder makes of one chunk on one path: its trace, or the error's class."""
    b = ColumnBuilder()
    try:
        if fast:
            if not scan.take(b, data):
                return "declined"
        else:
            b.add(*b.decode(data))
    except msgspec.ValidationError:
        return "ValidationError"
    except msgspec.DecodeError as exc:
        return "DecodeError: trailing" if "trailing characters" in str(exc) else "DecodeError"
    if b.n_dev == 0 and b.n_cpu == 0:
        return ("empty", b.n, b.decode.misses, b.peak, b.gpu_steps)
    return b.build("chunk", {}), b.decode.misses


def _sample_events() -> list[bytes]:
    doc = msgspec.json.decode(gzip.decompress((FIXTURES / "real" / "mi300_vllm_decode_hipgraph_triton.json.gz").read_bytes()))
    raw = [msgspec.json.encode(e) for e in doc["traceEvents"]]
    host = msgspec.json.decode(gzip.decompress((FIXTURES / "cpu_host_rank0.pt.trace.json.gz").read_bytes()))
    raw += [msgspec.json.encode(e) for e in host["traceEvents"][:400]]
    return raw


@needs_scanner
def test_damaged_and_hostile_chunks_get_the_python_paths_columns_or_are_left_to_it(monkeypatch):
    monkeypatch.delenv("DIAG_TRACE_DECODER", raising=False)
    rng = random.Random(20261129)
    events = _sample_events()
    taken = declined = 0
    for case in range(1500):
        start = rng.randrange(len(events) - 40)
        data = _mutated(rng, events[start:start + rng.randint(1, 40)])
        fast = _outcome(data, fast=True)
        if fast == "declined":
            declined += 1
            continue
        slow = _outcome(data, fast=False)
        if fast == "DecodeError: trailing":
            assert slow == fast, (case, data[:300])
            continue
        taken += 1
        assert not isinstance(slow, str), (case, slow, data[:300])
        if isinstance(fast[0], str):
            assert fast == slow, (case, data[:300])
        else:
            assert not _differences(fast[0], slow[0]) and fast[1] == slow[1], (case, data[:300])
    # Both kinds occur: the comparison ran, and damage was left to the Python path.
    assert taken >= 150 and declined >= 150, (taken, declined)


def _decimal(rng: random.Random) -> str:
    """A JSON number as profilers write them: integers (up to 18 digits; longer ones are left to
    the Python path), fixed and exponent forms up to 20 significant digits (past what a double
    holds exactly, and past the fast conversion's 2^53)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20))).lstrip("0") or "0"
    if len(digits) > 18 or (rng.random() < 0.6 and len(digits) > 1):
        cut = rng.randint(1, len(digits) - 1)
        digits = f"{digits[:cut]}.{digits[cut:]}"
    if rng.random() < 0.3:
        digits += f"e{rng.choice(['', '+', '-'])}{rng.randint(0, 40)}"
    return ("-" if rng.random() < 0.2 else "") + digits


@needs_scanner
def test_numbers_convert_exactly_as_msgspec_converts_them(monkeypatch):
    """Every start and duration, to the last bit, whichever conversion the scanner takes."""
    monkeypatch.delenv("DIAG_TRACE_DECODER", raising=False)
    rng = random.Random(7)
    events = [f'{{"ph":"X","cat":"cpu_op","name":"op","tid":1,"ts":{_decimal(rng)},"dur":{_decimal(rng)}}}'
              for _ in range(5000)]
    data = ("[" + ",".join(events) + "]").encode()
    fast, slow = _outcome(data, fast=True), _outcome(data, fast=False)
    assert not isinstance(fast, str) and not isinstance(slow, str), (fast, slow)
    a, b = fast[0], slow[0]
    assert len(a.cpu_ts) > 1000  # the durations the profiler never writes (negative, huge) are left out alike
    assert a.cpu_ts.tobytes() == b.cpu_ts.tobytes() and a.cpu_dur.tobytes() == b.cpu_dur.tobytes()


@needs_scanner
@pytest.mark.parametrize("data", [b"", b"x", b"{}", b"  ", b"[", b"[{", b"[]", b"[] x", b"[,]", b"[{}]", b'[{"cat":1}]',
                                  b"\x00" * 64, b"[" * 100_000, b'[{"args":' * 70 + b"1" + b"}" * 70 + b"]"])
def test_the_scanner_answers_any_bytes_without_raising(data):
    """Not an array, an unclosed one, nesting past its bound: an offset (the Python path reads
    it), or whole columns; never an exception or a crash."""
    for view in (data, bytearray(data), memoryview(data)):
        out = scan._kineto_scan.scan(view, scan._CATS, scan._GROUP_OF_CODE, True)
        assert isinstance(out, int) or (isinstance(out, tuple) and len(out) in (2, 3)), out
