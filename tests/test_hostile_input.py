"""Hostile input, third pass: nesting, integers beyond 64 bits, times no profiler writes,
decompression bombs, damaged gzip in every reader, damaged run-directory records, and
names that would act on a terminal. Each is a repaired value, a skipped record or one
error line; never a traceback, a hang or unbounded memory."""

from __future__ import annotations

import gzip
import io
import json
import os
import resource
import subprocess
import sys
import time
import zlib

import pytest
from conftest import FIXTURES
from rank_documents import trace_rank

from diag import atomic_io, inflate, rundir, segments

CPU_TRACE = FIXTURES / "cpu_compute_rank0.pt.trace.json.gz"


def _diag(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "diag", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _one_error_line(proc) -> str:
    assert proc.returncode != 0, proc.stdout[-500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("diag: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _trace_text() -> str:
    return json.dumps(json.loads(gzip.decompress(CPU_TRACE.read_bytes())))


def _with_event(text: str, event: str) -> str:
    """The trace with `event` inserted as an element of traceEvents, in the middle."""
    mid = text.index("}, {", len(text) // 2) + 3
    return text[:mid] + event + ", " + text[mid:]


# -- nesting --------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 100_000, 1_000_000])
def test_nesting_at_the_top_level_is_one_error_line(tmp_path, depth):
    path = tmp_path / "deep.json"
    path.write_text("[" * depth + "]" * depth)
    assert "nested too deep" in _one_error_line(_diag("analyze", path, "--jobs", "1"))


@pytest.mark.parametrize("where", ["event", "args"])
@pytest.mark.parametrize("depth", [1_000, 100_000, 1_000_000])
def test_an_event_nested_too_deep_is_skipped_and_counted(tmp_path, where, depth):
    deep = "[" * depth + "]" * depth
    event = deep if where == "event" else '{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 1, "dur": 1, ' \
                                          f'"pid": 1, "tid": 1, "args": {{"a": {deep}}}}}'
    path = tmp_path / "deep.json"
    path.write_text(_with_event(_trace_text(), event))
    clean = trace_rank(CPU_TRACE)
    t0 = time.monotonic()
    doc = trace_rank(path)
    assert time.monotonic() - t0 < 30
    assert doc["repairs"]["events"] == 1 and "nested too deep" in doc["repairs"]["examples"][0]
    assert doc["n_events"] == clean["n_events"] and doc["bound"] == clean["bound"]


# -- numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [2**63, 2**64, 10**30, -(2**63) - 1])
@pytest.mark.parametrize("field", ["External id", "correlation", "Ev Idx", "Group size"])
def test_integers_beyond_int64_are_ignored_field_by_field(tmp_path, field, value):
    doc = json.loads(_trace_text())
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"][:5]
    for e in ops:
        e.setdefault("args", {})[field] = value
    path = tmp_path / "big.json"
    path.write_text(json.dumps(doc))
    rank = trace_rank(path)
    assert rank["repairs"]["fields"] == len(ops) and rank["repairs"]["events"] == 0
    assert f"args.{field} = {value!r}"[:40] in " ".join(rank["repairs"]["examples"])


def test_numbers_beyond_float_range_are_ignored(tmp_path):
    text = _trace_text()
    doc = json.loads(text)
    ops = [i for i, e in enumerate(doc["traceEvents"]) if e.get("cat") == "cpu_op"][:4]
    for i in ops:
        doc["traceEvents"][i]["dur"] = 123456.0
    text = json.dumps(doc).replace('"dur": 123456.0', '"dur": 1e400')
    path = tmp_path / "inf.json"
    path.write_text(text)
    rank = trace_rank(path)
    assert rank["repairs"]["fields"] >= len(ops)
    assert any("beyond the float range" in x for x in rank["repairs"]["examples"])


@pytest.mark.parametrize("field,value", [("dur", 1e18), ("dur", 1e299), ("ts", 1e18), ("ts", -1e299)])
def test_times_no_profiler_writes_drop_their_event_quickly(tmp_path, field, value):
    """A kernel a million years long, or one dated far beyond the epoch, is a repaired
    event: no loop, bin or allocation takes its size from it."""
    doc = json.loads(gzip.decompress((FIXTURES / "real").joinpath(
        sorted(p.name for p in (FIXTURES / "real").glob("*.json.gz"))[0]).read_bytes()))
    timed = [e for e in doc["traceEvents"] if isinstance(e.get("dur"), (int, float)) and e.get("ph") == "X"]
    for e in timed[len(timed) // 2: len(timed) // 2 + 7]:
        e[field] = value
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(doc))
    t0 = time.monotonic()
    proc = _diag("analyze", path, "--json", "--jobs", "1", "--report", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    rank = json.loads(proc.stdout)["ranks"][0]
    assert rank["repairs"]["events"] == 7
    assert "beyond what a profiler records" in rank["repairs"]["examples"][0]


# -- gzip --------------------------------------------------------------------------------------


def _bomb(path, inflated: int = 1 << 30) -> None:
    """About 1 MB of gzip expanding to `inflated` bytes: one kernel name of that length."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"A" * (16 << 20)
    parts = [co.compress(b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "name": "')]
    parts += [co.compress(block) for _ in range(inflated // len(block))]
    parts += [co.compress(b'"}]}'), co.flush()]
    path.write_bytes(b"".join(parts))


def test_a_gzip_bomb_is_one_error_line_in_seconds_and_bounded_memory(tmp_path):
    path = tmp_path / "bomb.json.gz"
    _bomb(path)
    assert path.stat().st_size < 1.5e6
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.monotonic()
    proc = _diag("analyze", path)
    wall = time.monotonic() - t0
    line = _one_error_line(proc)
    assert "MiB" in line and wall < 10
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child so far
    assert peak < 500 << 10 or peak == before


def test_the_inflate_ceiling_is_a_ratio_of_the_file_and_can_be_raised(tmp_path):
    data = b'{"traceEvents": []}' + b" " * (20 << 20)  # 20 MB of blanks: about 1000:1
    path = tmp_path / "blank.json.gz"
    path.write_bytes(gzip.compress(data, 9))
    with pytest.raises(inflate.InflateError, match="DIAG_MAX_INFLATE_RATIO"):
        inflate.read_all(path)
    assert inflate.read_all(path, limit=len(data)) == data
    assert _diag("analyze", path, env={"DIAG_MAX_INFLATE_RATIO": "5000"}).stderr.count("expands beyond") == 0


def test_gzip_members_padding_and_trailing_garbage_read_as_gzip_does():
    data = b"line of text\n" * 50_000
    g = gzip.compress(data)

    def read(raw):
        return b"".join(inflate.gzip_blocks(io.BytesIO(raw), "x", 1 << 30))

    assert read(g + g) == data + data
    assert read(g + b"\0" * 64) == data
    assert read(g + b"trailing garbage") == data
    with pytest.raises(inflate.InflateError, match="truncated"):
        read(g[: len(g) // 2])
    damaged = bytearray(g)
    for k in range(len(g) // 2, len(g) // 2 + 32):
        damaged[k] ^= 0x5A
    with pytest.raises(inflate.InflateError, match="corrupt gzip"):
        read(bytes(damaged))


@pytest.mark.parametrize("command", ["nccl-log", "nccl parse", "analyze"])
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "bomb"])
def test_every_reader_gives_damaged_gzip_one_error_line(real_nccl, tmp_path, command, damage):
    src = {"nccl-log": real_nccl / "nccllog_NVIDIA-nccl_1193.txt",
           "nccl parse": sorted(real_nccl.glob("nccltests_*.txt"))[0], "analyze": None}[command]
    data = src.read_bytes() if src else gzip.decompress(CPU_TRACE.read_bytes())
    g = gzip.compress(data)
    if damage == "corrupt":
        b = bytearray(g)
        for k in range(20, len(b) - 8):
            b[k] ^= 0x5A
        g = bytes(b)
    elif damage == "truncated":
        g = g[: len(g) // 2]
    else:
        g = gzip.compress(data[:200] + b"A" * (200 << 20), 9)
    path = tmp_path / "input.gz"
    path.write_bytes(g)
    _one_error_line(_diag(*command.split(), path))


def test_a_log_with_trailing_garbage_after_its_gzip_is_read(real_nccl, tmp_path):
    src = real_nccl / "nccllog_NVIDIA-nccl_1193.txt"
    path = tmp_path / "log.txt.gz"
    path.write_bytes(gzip.compress(src.read_bytes()) + b"garbage after the member")
    plain = _diag("nccl-log", src, "--json")
    proc = _diag("nccl-log", path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["hosts"] == json.loads(plain.stdout)["hosts"]


# -- run directories ---------------------------------------------------------------------------


@pytest.mark.parametrize("line", [b'{"step": 5, "name": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000,
                                  b'{"step": 5, "s": "' + b"x" * (3 << 20) + b'"}', b"\xff\xfe\xfd"])
def test_a_damaged_record_line_is_skipped_and_noted(tmp_path, line):
    seg = tmp_path / "steps.jsonl"
    seg.write_bytes(b'{"step": 1}\n' + line + b'\n{"step": 2}\n')
    problems = []
    assert [r["step"] for r in segments.read_segment(seg, problems)] == [1, 2]
    assert len(problems) == 1 and ":2:" in problems[0]


def test_report_and_compare_read_a_run_with_damaged_segments(tmp_path):
    from report_helpers import write_run

    run = write_run(tmp_path / "run", ranks=2, steps=40, bound="data")
    clean = write_run(tmp_path / "clean", ranks=2, steps=40, bound="data")
    for seg in run.rglob("*.jsonl"):
        lines = seg.read_bytes().splitlines()
        lines[len(lines) // 2] = b'{"step": 7, "x": "\xff' + b"[" * 50_000
        seg.write_bytes(b"\n".join(lines) + b"\n")
    report = _diag("report", run)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr[-2000:]
    assert (run / "report.html").exists()
    compared = _diag("compare", clean, run, "--out", tmp_path / "cmp")
    assert compared.returncode == 0 and "Traceback" not in compared.stderr, compared.stderr[-2000:]


# -- what reaches the terminal ---------------------------------------------------------------------


def test_names_that_would_act_on_a_terminal_are_shown_as_escapes(tmp_path):
    doc = json.loads(_trace_text())
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    for e in ops:
        e["name"] = "evil\x1b]0;owned\x07\x1b[2J\u202eexe.txt"
    path = tmp_path / "evil\x1b[31mname.json"
    path.write_text(json.dumps(doc))
    out = _diag("analyze", path, "--jobs", "1")
    assert out.returncode == 0, out.stderr
    bad = _diag("analyze", tmp_path / "missing\x1b[2J.json")
    for text in (out.stdout, out.stderr, bad.stderr):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[31m" in out.stdout and "\\x1b[2J" in bad.stderr


def test_a_saved_analysis_too_large_or_too_deep_for_the_run_directory_is_noted(tmp_path):
    big = tmp_path / "rank.json"
    with open(big, "wb") as f:
        f.truncate(atomic_io.MAX_JSON_BYTES + 1)
    problems = []
    assert atomic_io.read_json(big, problems) is None and "larger than" in problems[0]


def test_one_error_from_nccl_parse_whatever_the_number_of_inputs(tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_bytes(b"")
    binary.write_bytes(bytes(range(256)) * 50)
    for files in ([empty], [binary], [empty, binary]):
        line = _one_error_line(_diag("nccl", "parse", *files))
        assert all(str(f) in line for f in files)


# -- values that would set the amount of work ------------------------------------------------


def _real_gpu_trace() -> dict:
    first = sorted((FIXTURES / "real").glob("*.json.gz"))[0]
    return json.loads(gzip.decompress(first.read_bytes()))


def test_a_name_of_megabytes_is_cut_once_and_noted(tmp_path):
    """Later stages read kernel names character by character (return types, template
    arguments): a name of megabytes is cut where the trace is read."""
    from diag.analyzers.trace.column_builder import MAX_NAME_CHARS

    doc = _real_gpu_trace()
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    longest = max(kernels, key=lambda e: e["dur"])["name"]
    long_name = "void " + "x" * (1 << 20) + "<float>(int)"
    for e in kernels:
        if e["name"] == longest:
            e["name"] = long_name
    path = tmp_path / "long.json"
    path.write_text(json.dumps(doc))
    rank = trace_rank(path)
    assert rank["repairs"]["fields"] == 1
    assert f"of {len(long_name):,} characters cut to {MAX_NAME_CHARS:,}" in rank["repairs"]["examples"][0]
    names = [k["name"] for k in rank["top_kernels"]]
    assert max(map(len, names)) < MAX_NAME_CHARS + 40
    assert any(n.endswith(f"...[{len(long_name):,} chars]") for n in names)


@pytest.mark.parametrize("world_size,rank", [(2**62, 2**40), (2**31, -1), ("8", 3.0)])
def test_a_rank_or_world_size_no_job_has_is_left_out(tmp_path, world_size, rank):
    """The missing ranks of a job are counted over its world size: a damaged one is not
    a loop of 2^62 steps."""
    doc = json.loads(_trace_text())
    doc["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": world_size}
    path = tmp_path / "odd_world.json"
    path.write_text(json.dumps(doc))
    proc = _diag("analyze", path, "--json", "--jobs", "1", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ranks"][0]["world_size"] is None and out["ranks"][0]["rank_from"] != "distributedInfo"
    assert out["job"]["missing_ranks"] in ([], None) or len(out["job"]["missing_ranks"]) < 2


def test_a_run_directory_with_an_implausible_world_size_lists_its_ranks(tmp_path):
    run = tmp_path / "run"
    (run / rundir.rank_dir_name(0)).mkdir(parents=True)
    (run / f"rank-{rundir.MAX_WORLD_SIZE + 5}").mkdir()
    (run / rundir.MANIFEST).write_text(json.dumps({"world_size": 2**62}))
    rd = rundir.RunDir(run)
    assert rd.ranks() == [0] and rd.expected_world_size() is None and rd.missing_ranks() == []
    (run / rundir.MANIFEST).write_text(json.dumps({"world_size": 4}))
    assert rundir.RunDir(run).missing_ranks() == [1, 2, 3]


def _compiled_patterns() -> dict:
    """Every regular expression compiled at module level in diag, by module.name."""
    import importlib
    import pkgutil
    import re

    import diag
    import diag.analyzers
    import diag.collectors

    found = {}
    # diag.analyzers and diag.collectors install from their own folders, outside diag's.
    modules = [m for pkg in (diag, diag.analyzers, diag.collectors)
               for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    for mod in modules:
        if mod.name.endswith("__main__"):  # runs the command line
            continue
        try:
            m = importlib.import_module(mod.name)
        except ImportError:  # an optional extra (ray, lightning) this machine lacks
            continue
        for name, value in vars(m).items():
            if isinstance(value, re.Pattern):
                found[f"{mod.name}.{name}"] = value
    return found


# Runs of one short pattern, after a prefix that takes an anchored pattern to its repeated
# part and before an end that makes it fail there: the shapes that make a search quadratic.
_RUNS = ["x", "1", " ", "\t", "a:", "0.", "[0]", "a=1 ", "<0>", "a,", '"1', "-"]
_BEFORE = ["", '"key": "', "host:1:2 [0] ", "# "]
_AFTER = ["", '",', "}"]


def _slow(pat, subject, limit_s: float) -> bool:
    """Whether the search takes more than limit_s of this thread's CPU time: the pattern's own
    work, which a busy machine's other processes do not stretch as they stretch the wall clock.
    Measured twice, so that a cache or page fault once is no verdict."""
    for _ in range(2):
        t0 = time.thread_time()
        pat.search(subject)
        if time.thread_time() - t0 <= limit_s:
            return False
    return True


def test_every_pattern_takes_time_linear_in_its_input():
    """A pattern searched along a long run of characters must not try every start (or every
    length of a lazy group) against the rest of the run: that is quadratic, and a line of a
    megabyte would take hours. 5,000 characters take a linear pattern a fraction of a
    millisecond and a quadratic one a tenth of a second or more."""
    patterns = _compiled_patterns()
    assert {"diag.analyzers.nccl.log_grammar._IP", "diag.analyzers.nccl.log_grammar._JSON_KV",
            "diag.analyzers.trace.tolerant._HUGE_EXPONENT", "diag.analyzers.trace.load._END_RE"} <= set(patterns)
    assert len(patterns) > 100
    subjects = [before + run * (5_000 // len(run)) + after for before in _BEFORE for run in _RUNS for after in _AFTER]
    slow = []
    for where, pat in patterns.items():
        for text in subjects:
            if _slow(pat, text.encode() if isinstance(pat.pattern, bytes) else text, 0.04):
                slow.append(f"{where} on {text[:24]!r}...{text[-4:]!r}")
                break
    assert not slow, slow


@pytest.mark.parametrize("name,after,run", [
    ("nccllog_NVIDIA-nccl-tests_166.txt", "NET/Socket : Using [0]ens4:", "x"),  # the socket's address
    ("torchfr_pytorch-tutorials_flight_recorder.txt", '"name": "test_short_p', " "),  # a JSON value
    ("inspector_NVIDIA-nccl_README.txt", '"hostname": "example-hostname', "\t"),
])
def test_a_megabyte_of_one_character_in_an_nccl_line_costs_no_time(real_nccl, tmp_path, name, after, run):
    """Where the fuzzer put a long run of one character and a search went quadratic."""
    src = real_nccl / name
    text = src.read_text()
    at = text.index(after) + len(after)
    damaged = tmp_path / "long_line.txt"
    damaged.write_text(text[:at] + run * (1 << 20) + text[at:])
    t0 = time.monotonic()
    clean = json.loads(_diag("nccl-log", src, "--json").stdout)
    doc = json.loads(_diag("nccl-log", damaged, "--json").stdout)
    assert time.monotonic() - t0 < 60
    assert doc["lines"] == clean["lines"]
    for key in ("hosts", "processes", "nccl_version", "warnings", "error_chains"):
        assert doc[key] == clean[key], key
    for key in ("flight_recorder", "inspector"):
        assert (doc[key] or {}).get("entries") == (clean[key] or {}).get("entries"), key
        assert (doc[key] or {}).get("records") == (clean[key] or {}).get("records"), key


@pytest.fixture(scope="module")
def saved_analysis() -> dict:
    """`diag analyze --json` of a 2-rank gloo job's traces, as saved."""
    from diag.analyzers.analyze import analyze_paths, json_safe

    paths = [str(FIXTURES / f"cpu_comm_rank{r}.pt.trace.json.gz") for r in (0, 1)]
    return json.loads(json.dumps(json_safe(analyze_paths(paths, jobs=1))))


def _damaged(doc: dict, how: str) -> dict:
    doc = json.loads(json.dumps(doc))
    r0 = doc["ranks"][0]
    if how == "errors":
        doc["errors"], doc["warnings"], doc["source"] = 7, {"a": 1}, ["x"]
    elif how == "ranks":
        doc["ranks"] = True
    elif how == "step_number":
        r0["steps"][0]["step"] = 10**30  # beyond the step column's int64
    elif how == "collective":
        r0["collectives"][0]["name"] = {"all_reduce": 1}  # unhashable, where ranks are matched
        r0["collectives"][1]["ts_us"] = "soon"
    return doc


@pytest.mark.parametrize("how", ["errors", "ranks", "step_number", "collective"])
def test_a_damaged_saved_analysis_is_reported_from_what_is_sound(saved_analysis, tmp_path, how):
    """The report's reader of a saved analysis document settles what it reads: damaged entries
    are left out, the rest is reported (found by fuzzing saved documents)."""
    from diag.report import analyse_and_model

    path = tmp_path / "analysis.json"
    path.write_text(json.dumps(_damaged(saved_analysis, how)))
    doc, model = analyse_and_model(path)
    assert model["diagnosis"].bound == saved_analysis["diagnosis"]["bound"]
    assert len(model["ranks"]) == (0 if how == "ranks" else 2)
    if how == "collective":
        sound = len(saved_analysis["ranks"][0]["collectives"]) - 2
        assert sound > 0 and model["charts"]["heatmap_wait"] is not None


_DAMAGED_PARTS = {
    "step_time": ("run_figures", lambda d: d["run_figures"]["step_time"].update(median_ms=0.0, steps="many")),
    "throughput": ("run_figures", lambda d: d["run_figures"]["throughput"].update(samples_per_s=[1.0])),
    "identity": ("run_figures", lambda d: d["run_figures"].update(identity=3)),
    "what_if": ("what_if", lambda d: d["what_if"].update(changes=7)),
    "episodes": ("straggler_episodes", lambda d: d.update(straggler_episodes={"chart": {"first_steps": 1}})),
}


@pytest.mark.parametrize("how", sorted(_DAMAGED_PARTS))
def test_compare_and_the_gate_read_a_damaged_saved_diagnosis_as_far_as_it_is_sound(saved_analysis, tmp_path, how):
    """A saved diagnosis whose parts compare and the gate compute with hold the wrong shapes (a
    zero median step, a list for a rate, a number for a list; found by fuzzing saved documents):
    that part reads as absent, and both commands still answer, without a traceback."""
    from diag.analyzers.analysis_types import analysis_from_json

    part, damage = _DAMAGED_PARTS[how]
    doc = json.loads(json.dumps(saved_analysis))
    damage(doc["diagnosis"])
    assert getattr(analysis_from_json(doc).diagnosis, part) in ({}, None)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(saved_analysis))
    b.write_text(json.dumps(doc))
    plain = _diag("compare", a, b, "--out", tmp_path / "plain")
    assert plain.returncode == 0 and "Traceback" not in plain.stderr, plain.stderr
    gated = _diag("compare", "--gate", a, b, "--out", tmp_path / "gate")
    assert gated.returncode in (0, 1, 2, 3) and "Traceback" not in gated.stderr, gated.stderr
    assert json.loads((tmp_path / "gate" / "gate.json").read_text())["exit_status"] == gated.returncode
