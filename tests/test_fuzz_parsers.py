"""Bad input never hangs or crashes: oddly typed fields are repaired, damaged events skipped,
and a minute of mutation fuzzing over real traces, nccl-tests outputs and NCCL logs ends in
results or one-line errors only."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES
from fuzz_mutations import analysis_seeds, fuzz, live_seeds, run_one, run_seeds, seeds
from rank_documents import trace_rank

from diag.analyzers.analyze import analyze_paths
from diag.analyzers.trace.load import load_trace


def _events(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def _write(doc: dict, path: Path, gz: bool = True) -> Path:
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.fixture
def a100(real_traces) -> dict:
    return _events(real_traces / "a100_2rank_nccl.json.gz")


def _first(doc: dict, pred) -> int:
    return next(i for i, e in enumerate(doc["traceEvents"]) if pred(e))


def test_a_number_written_as_a_string_is_read(a100, real_traces, tmp_path):
    """The ROCm case: "bytes": "128" on one event rejected a whole 229k-event trace."""
    i = _first(a100, lambda e: e.get("cat") == "gpu_memcpy")
    a100["traceEvents"][i]["args"]["bytes"] = "128"
    k = _first(a100, lambda e: e.get("cat") == "kernel" and "correlation" in e.get("args", {}))
    corr = a100["traceEvents"][k]["args"]["correlation"]
    a100["traceEvents"][k]["args"]["correlation"] = str(corr)
    trace = load_trace(_write(a100, tmp_path / "odd.json.gz"))
    clean = load_trace(real_traces / "a100_2rank_nccl.json.gz")
    assert trace.n_events == clean.n_events and len(trace.dev_ts) == len(clean.dev_ts)
    assert trace.repairs["fields"] == 2 and trace.repairs["events"] == 0
    assert f"event {i}: args.bytes = '128' read as 128.0" in trace.repairs["examples"]
    assert f"event {k}: args.correlation = '{corr}' read as {corr}" in trace.repairs["examples"]
    assert 128.0 in trace.dev_bytes.tolist() and corr in trace.dev_corr.tolist()


def test_null_list_and_object_fields_are_ignored_for_that_event_alone(a100, tmp_path):
    evs = a100["traceEvents"]
    kernels = [i for i, e in enumerate(evs) if e.get("cat") == "kernel"]
    evs[kernels[0]]["dur"] = None           # the kernel is untimed, the others stay
    evs[kernels[1]]["args"] = ["a", "list"]  # args ignored
    evs[kernels[2]]["ts"] = [1, 2]           # no timestamp: the event is skipped
    evs[kernels[3]]["tid"] = {"odd": 1}      # any thread id tells threads apart
    evs.insert(3, "not an event")
    doc = trace_rank(str(_write(a100, tmp_path / "odd.json.gz")))
    rep = doc["repairs"]
    assert rep["events"] == 2 and rep["fields"] == 2, rep
    assert any(f"event {kernels[2] + 1}: unreadable timestamp" in x for x in rep["examples"]), rep
    assert doc["findings"][0]["id"] == "repaired_trace" and doc["bound"] == "host"


def test_a_flipped_byte_inside_a_key_skips_one_event_and_ends(real_traces, tmp_path):
    """Once a chunked-decoder loop: a quote flipped into a key of a 35 MB trace."""
    raw = gzip.decompress((real_traces / "v100_resnet50_workers0_oldschema.json.gz").read_bytes())
    i = raw.find(b'"name"', len(raw) // 10)
    (tmp_path / "flip.json").write_bytes(raw[:i + 2] + b'"' + raw[i + 3:])
    doc = trace_rank(str(tmp_path / "flip.json"))
    clean = trace_rank(str(real_traces / "v100_resnet50_workers0_oldschema.json.gz"))
    assert doc["n_events"] == clean["n_events"] - 1
    assert doc["repairs"]["events"] == 1 and "corrupt JSON" in doc["repairs"]["examples"][0]
    assert doc["bound"] == clean["bound"] == "data"


def test_invalid_utf8_inside_a_gzipped_trace_is_skipped(real_traces, tmp_path):
    raw = gzip.decompress((real_traces / "mi250_rocm62_tiny.json.gz").read_bytes())
    i = raw.find(b'"name": "', raw.find(b'"traceEvents"')) + 9  # in an event's name
    (tmp_path / "utf8.json.gz").write_bytes(gzip.compress(raw[:i] + b"\xff\xfe" + raw[i:]))
    doc = trace_rank(str(tmp_path / "utf8.json.gz"))
    assert doc["repairs"]["events"] == 1 and "invalid UTF-8" in doc["repairs"]["examples"][0]
    # In the metadata (the device's name), the device details survive with a replaced character.
    j = raw.find(b'"name": "') + 9
    (tmp_path / "meta.json.gz").write_bytes(gzip.compress(raw[:j] + b"\xff" + raw[j:]))
    doc = trace_rank(str(tmp_path / "meta.json.gz"))
    assert doc["repairs"]["fields"] == 1 and doc["repairs"]["examples"][0].startswith("metadata: invalid UTF-8")
    assert doc["device_info"]["name"].startswith("\ufffdAMD")


def test_unrepairable_input_is_a_one_line_error(tmp_path):
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "cat": "kernel"')[:-6])
    doc = analyze_paths([tmp_path / "t.json.gz"])
    (err,) = doc.errors
    assert "\n" not in err["error"] and "gzip" in err["error"]


@pytest.mark.slow
def test_fuzzing_finds_no_traceback_and_no_hang(real_data, tmp_path):
    """400 mutations (`python bench/bench_fuzz.py` runs thousands) of every real seed, of a run directory's segments and
    of saved analysis documents: truncation, bit flips,
    garbage, invalid UTF-8, repeated and deleted spans, shuffled lines, retyped values, empty
    documents, nesting, integers beyond 64 bits, odd times, markup and terminal escapes in
    names, long strings, odd step numbers, gzip bombs and damaged gzip."""
    found = seeds(real_data, FIXTURES) + run_seeds(tmp_path) + live_seeds() + analysis_seeds(tmp_path, FIXTURES)
    assert {s.kind for s in found} == {"trace", "nccl_tests", "nccl_log", "run", "live", "metrics", "analysis"}
    assert len(found) >= 40
    result = fuzz(found, n_inputs=400, seed=20261124, workers=2, timeout_s=20.0, check_every=25)
    assert result["inputs"] == 400
    bad = ("traceback", "hang", "over_memory", "escaping")
    assert all(result[k] == 0 for k in bad), result["failures"][:3]
    # The mutants are not all rejected: most stay readable and are analysed.
    assert result["ok"] > result["error"] > 0


def test_the_runner_tells_a_traceback_from_an_error(tmp_path, monkeypatch):
    from diag.analyzers.nccl import nccl_tests

    (tmp_path / "x.json").write_text("{}")
    assert run_one("trace", str(tmp_path / "x.json"))[0] == "error"

    def crash(path):
        raise KeyError("count")

    monkeypatch.setattr(nccl_tests, "parse_file", crash)
    status, detail = run_one("nccl_tests", str(tmp_path / "x.json"))
    assert status == "traceback" and "KeyError: 'count'" in detail


def test_oddly_typed_numbers_in_nccl_tests_json_rows(real_nccl, tmp_path):
    """The --json fork's rows with a count that is a string or infinite: found by the
    fuzzer as tracebacks; each such row keeps its other numbers or is left out."""
    from diag.analyzers.nccl.nccl_tests import parse_file

    text = (real_nccl / "nccltests_NVIDIA-nccl-tests_pr318.txt").read_text()
    clean = parse_file(real_nccl / "nccltests_NVIDIA-nccl-tests_pr318.txt")["tests"]
    counts = re.findall(r'"count": ?(\d+)', text)
    assert len(counts) >= 2
    odd = text.replace(f'"count": {counts[0]}', f'"count": "{counts[0]}"', 1)
    odd = odd.replace(f'"count": {counts[1]}', '"count": 1e309', 1)
    (tmp_path / "odd.txt").write_text(odd)
    got = parse_file(tmp_path / "odd.txt")["tests"]
    rows = [r for t in got for r in t["rows"]]
    assert len(rows) == sum(len(t["rows"]) for t in clean)
    assert [r["count"] for r in rows][:2] == [int(counts[0]), None]
