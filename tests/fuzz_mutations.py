"""Mutation fuzzing of diag's parsers: the inputs, the mutations and the runner.

Shared by the suite's one-minute fuzz test (tests/test_fuzz_parsers.py) and the long
run in bench/bench_fuzz.py. Seeds are real files: Kineto traces (small ones whole, large
ones cut to their first events in memory), nccl-tests outputs and NCCL/PyTorch logs. Each
mutant goes through the entry point `diag analyze` or `diag nccl` uses; the only accepted
failure is the project's one-line error (DiagInputError). Anything else is a traceback,
and an input that does not finish within the time bound is a hang.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import random
import re
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

TRACE_EVENTS_KEEP = 3000  # large traces are cut to this many events (whole events, valid JSON)
TIMEOUT_S = 20.0


@dataclass
class Seed:
    kind: str  # "trace", "nccl_tests", "nccl_log", "run" (a segment of a run directory), "analysis" (a
    # saved `diag analyze --json` document), or what
    # `diag top` reads: "live" (a rank's live.json) and "metrics" (a scrape of its endpoint)
    name: str
    data: bytes  # uncompressed
    template: str | None = None  # "run": the run directory the mutated segment goes into
    segment: str | None = None  # "run": the segment's path inside it


def run_seeds(root: Path) -> list[Seed]:
    """Seeds of kind "run": the step, sample and event segments of a 2-rank run directory
    (written as the agent does, tests/report_helpers.py), for `diag report` and `diag compare`."""
    from report_helpers import write_run

    run = write_run(root / "template", ranks=2, steps=60, bound="comm", gpu=True, seed=3)
    out = []
    for seg in sorted(p for p in run.rglob("*.jsonl") if p.parent.name in ("steps", "samples", "events")):
        rel = str(seg.relative_to(run))
        out.append(Seed("run", rel, seg.read_bytes(), template=str(run), segment=rel))
    return out


def analysis_seeds(root: Path, fixtures: Path) -> list[Seed]:
    """Seeds of kind "analysis": saved `diag analyze --json` documents, of two traces of a job and
    of a 2-rank run directory, for the report's reader of a saved analysis."""
    from report_helpers import write_run

    from diag.analyzers.analyze import analyze_paths, analyze_run_dir, json_safe

    traces = [str(fixtures / f"cpu_comm_rank{r}.pt.trace.json.gz") for r in (0, 1)]
    run = write_run(root / "analysed", ranks=2, steps=40, bound="data", gpu=True, seed=5)
    return [Seed("analysis", name, json.dumps(json_safe(doc)).encode())
            for name, doc in (("traces.analysis.json", analyze_paths(traces, jobs=1)),
                              ("run.analysis.json", analyze_run_dir(run)))]


def live_seeds() -> list[Seed]:
    """What `diag top` reads, as the agent writes it: a live.json of the real LiveState and a
    scrape of the real exporter, after steps and a GPU sample."""
    from diag.collectors.live_state import LiveState
    from diag.exporter.registry import render_text
    from diag.exporter.runtime import Handle
    from diag.step_record import StepRecord

    state, handle = LiveState(), Handle({"run": "r", "rank": "1", "local_rank": 1, "host": "node-1", "gpu": "0"})
    sample = {"t": 1.8e9, "gpu": {"utilization_ratio": 0.9, "memory_used_bytes": 3 << 30, "memory_total_bytes": 8 << 30,
                                  "power_watts": 300.0, "clock_events": ["sw_power_cap"], "xid_errors_total": 1}}
    for i in range(40):
        rec = StepRecord(step=i, start_unix=1.8e9 + i * 0.1, duration_s=0.1, device_s=0.09, data_wait_s=0.01,
                         samples=32, shares={"data": 0.1, "host": 0.1, "comm": 0.1, "memory": 0.1, "compute": 0.6})
        state.add_step(rec, "compute")
        handle.observe_step(rec, "compute")
    state.add_sample(sample)
    handle.observe_sample(sample)
    doc = state.document({"rank": 1, "host": "node-1"}, 40, (42, 44))
    return [Seed("live", "live.json", json.dumps(doc).encode()),
            Seed("metrics", "metrics.txt", render_text([handle.state]))]


def seeds(real_data: Path | None, fixtures: Path) -> list[Seed]:
    out = []
    trace_files = sorted(fixtures.glob("*.json.gz")) + sorted((fixtures / "real").glob("*.json.gz"))
    if real_data is not None:
        trace_files += sorted((real_data / "traces").glob("*.json.gz"))
    for p in trace_files:
        raw = gzip.decompress(p.read_bytes())
        if len(raw) > 2_000_000:
            doc = json.loads(raw)
            doc["traceEvents"] = doc["traceEvents"][:TRACE_EVENTS_KEEP]
            raw = json.dumps(doc).encode()
        out.append(Seed("trace", p.name, raw))
    if real_data is not None:
        for p in sorted((real_data / "nccl").iterdir()):
            if not p.is_file():
                continue
            kind = "nccl_tests" if p.name.startswith(("nccltests_", "rccltests_")) else "nccl_log"
            out.append(Seed(kind, p.name, p.read_bytes()))
    return out


# --- mutations -------------------------------------------------------------------------

_NUMBER = re.compile(rb"(?<=: )-?\d+(?:\.\d+)?")


def _truncate(r, d):
    return d[: r.randrange(len(d))] if d else d


def _flip(r, d):
    b = bytearray(d)
    for _ in range(r.randint(1, 3)):
        if b:
            i = r.randrange(len(b))
            b[i] ^= 1 << r.randrange(8)
    return bytes(b)


def _insert_garbage(r, d):
    i = r.randrange(len(d) + 1)
    return d[:i] + bytes(r.randrange(256) for _ in range(r.randint(1, 64))) + d[i:]


def _invalid_utf8(r, d):
    i = r.randrange(len(d) + 1)
    return d[:i] + r.choice([b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]) + d[i:]


def _repeat(r, d):
    if len(d) < 2:
        return d + d
    i = r.randrange(len(d) - 1)
    j = min(len(d), i + r.randint(1, 4096))
    return d[:j] + d[i:j] * r.randint(2, 5) + d[j:]


def _shuffle_lines(r, d):
    lines = d.split(b"\n")
    k = max(2, len(lines) // 10)
    i = r.randrange(max(1, len(lines) - k))
    part = lines[i:i + k]
    r.shuffle(part)
    return b"\n".join(lines[:i] + part + lines[i + k:])


def _replace_some(r, d, pattern, most: int, new_of, scan: int = 1_000_000) -> bytes | None:
    """d with 1 to `most` of the pattern's matches (in its first `scan` bytes) replaced by
    new_of(match); None when nothing matches."""
    found = list(pattern.finditer(d, 0, min(len(d), scan)))
    if not found:
        return None
    out = bytearray(d)
    for m in sorted(r.sample(found, min(len(found), r.randint(1, most))), key=lambda m: -m.start()):
        out[m.start():m.end()] = new_of(m)
    return bytes(out)


def _retype(r, d):
    """A number becomes a string, null, a list, an object, a bool or a huge number."""
    out = _replace_some(r, d, _NUMBER, 5, lambda m: r.choice([
        b'"' + m.group() + b'"', b"null", b"[" + m.group() + b"]", b'{"v": 1}', b"true", b"1e309", b'"x"', b"-0"]))
    return out if out is not None else _flip(r, d)


_ODD_VALUES = (None, "x", -1, 0, 1e308, -1e308, [], {}, True, [1, "a"], {"a": 1}, 2**70)


def _revalue(r, d):
    """A value anywhere in a JSON document (an object, a list, a string, a number) becomes one
    of another type or range: the damage a reader that settles only the top level misses."""
    if len(d) > (4 << 20):
        return _retype(r, d)
    try:
        doc = json.loads(d)
    except (ValueError, RecursionError):
        return _retype(r, d)
    slots = []  # (container, key) of the first values met, breadth first
    queue = [doc]
    while queue and len(slots) < 20_000:
        node = queue.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            slots.append((node, k))
            queue.append(v)
    if not slots:
        return _retype(r, d)
    for _ in range(r.randint(1, 3)):
        node, k = r.choice(slots)
        node[k] = r.choice(_ODD_VALUES)
    return json.dumps(doc).encode()


def _delete_span(r, d):
    if not d:
        return d
    i = r.randrange(len(d))
    return d[:i] + d[i + r.randint(1, 512):]


def _empty(r, d):
    return r.choice([b"", b"{}", b"[]", b"null", b'{"traceEvents": 5}', b'{"traceEvents": [1, "a", null]}',
                     b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "a", "dur": []}]}'])


_DEPTHS = (1_000, 100_000, 1_000_000)
_EVENT_START = re.compile(rb'\{\s*"(?:ph|name|cat|ts|pid)"')


def _nest(r, d):
    """Brackets nested 1e3 to 1e6 deep: at the top level, as an event of traceEvents, or in
    an event's args (a line of a text input)."""
    depth = r.choice(_DEPTHS)
    deep = b"[" * depth + b"]" * depth
    where = r.choice(["top", "event", "args"])
    if where == "top":
        return deep + d if r.random() < 0.5 else deep
    starts = list(_EVENT_START.finditer(d, 0, min(len(d), 1_000_000)))
    if not starts:
        i = r.randrange(len(d) + 1)
        return d[:i] + b'{"args": ' + deep + b"}\n" + d[i:]
    i = r.choice(starts).start()
    if where == "event":
        return d[:i] + deep + b", " + d[i:]
    return d[:i] + b'{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": {"a": ' + deep + b"}}, " + d[i:]


_BIG_INTS = (b"9223372036854775808", b"18446744073709551616", b"1000000000000000000000000000000",
             b"-9223372036854775809")


def _bigint(r, d):
    """Integers at 2^63, 2^64 and 10^30 (and below -2^63) in numeric fields."""
    out = _replace_some(r, d, _NUMBER, 20, lambda m: r.choice(_BIG_INTS))
    return out if out is not None else d + b" " + r.choice(_BIG_INTS)


_TIME_FIELD = re.compile(rb'"(ts|dur)":\s*-?[\d.eE+-]+')


def _timing(r, d):
    """Timestamps and durations that are huge, negative, beyond float range or missing."""
    def new_of(m):
        key = m.group(1)
        if r.random() < 0.2:
            return b'"x' + key + b'": 0'  # the field is missing
        return b'"' + key + b'": ' + r.choice([b"1e18", b"-1e18", b"1e299", b"1e400", b"-1e400",
                                               b"31536000000000000000", b"0"])

    out = _replace_some(r, d, _TIME_FIELD, 12, new_of, scan=2_000_000)
    return out if out is not None else _bigint(r, d)


_NAME_FIELD = re.compile(rb'"(name|Process Group Name|hostname|host)":\s*"[^"\\]{0,200}"')
_HOSTILE = [b"<a href=\\\"javascript:alert(1)\\\">k</a>", b"<b>bold</b><br><sup>2</sup>", b"\\u001b]0;title\\u0007",
            b"\\u001b[2J\\u001b[31mred", b"\\u202eexe.txt", b"</script><script>alert(1)</script>",
            b"{{7*7}}${7*7}%{x}", b"\\u0000nul"]


def _markup(r, d):
    """Names that carry markup, terminal escapes, bidi overrides and template syntax."""
    out = _replace_some(r, d, _NAME_FIELD, 10, lambda m: b'"' + m.group(1) + b'": "' + r.choice(_HOSTILE) + b'"')
    if out is not None:
        return out
    i = r.randrange(len(d) + 1)  # a text input: the raw characters
    return d[:i] + r.choice(_HOSTILE).replace(b"\\u001b", b"\x1b").replace(b"\\", b"") + d[i:]


def _long_string(r, d):
    """One name of several megabytes (below the readers' ceilings)."""
    found = list(_NAME_FIELD.finditer(d, 0, min(len(d), 1_000_000)))
    big = b"x" * r.choice([1 << 20, 8 << 20, 40 << 20])
    if not found:
        i = r.randrange(len(d) + 1)
        return d[:i] + big + d[i:]
    m = r.choice(found)
    return d[:m.start()] + b'"' + m.group(1) + b'": "' + big + b'"' + d[m.end():]


_RUNS = (b"x", b"1", b" ", b"\t", b"a:", b"0.", b"[0]", b"a=1 ", b"<0>", b"a,", b'\\"1', b"}", b"e9", b"-")


def _long_run(r, d):
    """A long run of one short pattern inside a string value or a line: a regular
    expression that tries every start of such a run against the rest of it is quadratic."""
    run = r.choice(_RUNS) * (r.choice([1 << 16, 1 << 19, 1 << 20]) // 2)
    found = list(_NAME_FIELD.finditer(d, 0, min(len(d), 1_000_000)))
    if found and r.random() < 0.5:
        m = r.choice(found)
        opening = m.start() + m.group().index(b'"', len(m.group(1)) + 2)
        i = r.randint(opening + 1, m.end() - 1)  # somewhere in the value
        return d[:i] + run + d[i:]
    i = r.randrange(len(d) + 1)
    return d[:i] + run + d[i:]


def _steps(r, d):
    """Step numbers no loop may count to: huge, negative, or repeated."""
    return re.sub(rb"ProfilerStep#\d+", lambda m: b"ProfilerStep#" + r.choice(
        [b"99999999999999999999999", b"9223372036854775807", b"-5", b"0", b"1"]), d, count=r.randint(1, 50))


MUTATIONS = {
    "truncate": _truncate, "flip": _flip, "garbage": _insert_garbage, "invalid_utf8": _invalid_utf8,
    "repeat": _repeat, "shuffle_lines": _shuffle_lines, "retype": _retype, "delete": _delete_span,
    "empty": _empty, "nest": _nest, "bigint": _bigint, "timing": _timing, "markup": _markup,
    "long_string": _long_string, "long_run": _long_run, "steps": _steps, "revalue": _revalue,
}


def _bomb(r) -> bytes:
    """A gzip stream that expands a thousandfold: one huge string, or many events."""
    import zlib

    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    if r.random() < 0.5:
        parts = [b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "name": "', b"A" * (256 << 20),
                 b'"}]}']
    else:
        ev = b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1, "name": "k", "args": {"correlation": 1}}, '
        parts = [b'{"traceEvents": [', ev * (2 << 20), b'{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1}]}']
    return b"".join([*(co.compress(p) for p in parts), co.flush()])


def _damage_gzip(r, gz: bytes) -> tuple[str, bytes]:
    """A corrupt deflate stream, a truncated member, or trailing garbage."""
    kind = r.choice(["corrupt", "truncate", "trailing"])
    if kind == "corrupt" and len(gz) > 40:
        b = bytearray(gz)
        i = r.randrange(20, len(b) - 10)
        for k in range(i, min(len(b) - 8, i + r.randint(1, 64))):
            b[k] ^= r.randrange(1, 256)
        return kind, bytes(b)
    if kind == "truncate":
        return kind, gz[: r.randrange(max(1, len(gz)))]
    return "trailing", gz + bytes(r.randrange(256) for _ in range(r.randint(1, 64)))


def mutate(seed: Seed, rng: random.Random) -> tuple[str, bytes, bool]:
    """(description, mutated bytes, gzipped?) for one mutant of the seed."""
    if rng.random() < 0.01:
        return "gzip_bomb", _bomb(rng), True
    names = rng.sample(sorted(MUTATIONS), rng.choice([1, 1, 2]))
    data = seed.data
    for n in names:
        data = MUTATIONS[n](rng, data)
    gz = rng.random() < (0.5 if seed.kind == "trace" else 0.2)  # every reader takes gzip
    desc = "+".join(names)
    if gz:
        data = gzip.compress(data, compresslevel=1)
        desc += "+gzip"
        if rng.random() < 0.25:  # damage the compressed stream itself
            how, data = _damage_gzip(rng, data)
            desc += f"+gzip_{how}"
    return desc, data, gz


# --- running ---------------------------------------------------------------------------


MEMORY_CEILING = 6 << 30  # address space of a fuzz worker: beyond it is an over-memory run


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CEILING, MEMORY_CEILING))
    except (ImportError, ValueError, OSError):
        pass


def _chart_markup(doc: dict) -> str | None:
    """A string of the report's charts that plotly would draw as markup, or None."""
    from diag.analyzers.views.report_model import build_model
    from diag.report.html import safe_figures
    from diag.run_documents import RunRecords

    def walk(obj, key=""):
        if isinstance(obj, str):
            return obj if "<" in obj and not key.endswith("template") else None
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            found = walk(v, k if isinstance(k, str) else key)
            if found:
                return found
        return None

    return walk(safe_figures(build_model(doc, RunRecords(path="fuzz"))))


def _run_inputs(seed_template: str, segment: str, path: str) -> None:
    """A copy of the template run with the mutated segment, reported and compared with itself."""
    import shutil

    from diag.analyzers.views.compare_model import compare
    from diag.report import analyse_and_model, write_report
    from diag.report.compare import write_compare

    run = Path(path + ".run")
    shutil.copytree(seed_template, run)
    try:
        shutil.copyfile(path, run / segment)
        write_report(run, run / "report")
        (da, ma) = analyse_and_model(run)
        (db, mb) = analyse_and_model(seed_template)
        write_compare(compare(mb, ma, db, da), run / "compare")
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _compared(path: str) -> None:
    """A saved analysis as `diag compare` and `--gate` read it: its report model, compared with
    itself, the comparison written, and gated."""
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.diagnosis.gate import gate
    from diag.analyzers.views.compare_model import compare
    from diag.report import analyse_and_model
    from diag.report.compare import write_compare

    doc, model = analyse_and_model(path)
    with tempfile.TemporaryDirectory() as out:
        write_compare(compare(model, model, doc, doc), out)
    gate(doc, model["diagnosis"], doc, model["diagnosis"], load_tree())


def run_one(kind: str, path: str, template: str | None = None, segment: str | None = None,
            check_charts: bool = False) -> tuple[str, str]:
    """("ok" | "error" | "traceback" | "over_memory" | "escaping", detail) for one input file,
    through diag's entry points."""
    from diag.errors import DiagInputError

    try:
        if kind == "trace":
            from diag.analyzers.analyze import analyze_paths

            doc = analyze_paths([path], jobs=1)
            if doc.errors and not doc.ranks:
                return "error", doc.errors[0]["error"]
            if check_charts:
                found = _chart_markup(doc)
                if found:
                    return "escaping", f"chart text keeps markup: {found[:200]!r}"
        elif kind == "nccl_tests":
            from diag.analyzers.nccl import nccl_tests

            nccl_tests.parse_file(path)
        elif kind == "run":
            _run_inputs(template, segment, path)
        elif kind == "analysis":
            _compared(path)
        elif kind in ("live", "metrics"):
            found = _top_screen(kind, path)
            if found:
                return "escaping", f"diag top's screen keeps a control character: {found!r}"
        else:
            from diag.analyzers.nccl import log as nccl_log

            nccl_log.parse_files([path])
        return "ok", ""
    except DiagInputError as exc:
        text = str(exc)
        return ("error", text) if "\n" not in text.strip() else ("traceback", "multi-line error: " + text[:300])
    except MemoryError:
        return "over_memory", f"MemoryError within {MEMORY_CEILING >> 30} GiB"
    except Exception:
        return "traceback", traceback.format_exc(limit=8)


def _top_screen(kind: str, path: str) -> str | None:
    """Read one input as `diag top` would (a rank's live.json, or a scrape's body), judge and draw
    it; a control character that reached the drawn screen, or None."""
    import time

    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.diagnosis.live import judge_live
    from diag.analyzers.job.live import EndpointHistory
    from diag.top.screen import ViewState, render_text, screen
    from diag.top.sources import RunDirSource, parse_scrape

    now = time.time()
    if kind == "live":
        rank_dir = Path(path + ".d") / "rank-00001"
        rank_dir.mkdir(parents=True)
        (rank_dir / "live.json").write_bytes(Path(path).read_bytes())
        ranks = RunDirSource(rank_dir.parent).read(now)
    else:
        body = Path(path).read_bytes().decode("utf-8", "replace")
        live, _, _ = parse_scrape(body, EndpointHistory(), now, "h:1")
        ranks = [live] if live is not None else []
    opened = ranks[0].rank if ranks else None
    text = render_text(screen(path, ranks, judge_live(ranks, load_tree(), now), ViewState(opened=opened), now, 1.0))
    return next((c for c in text if ord(c) < 0x20 and c not in "\n" or c == "\x7f"), None)


def _args(item, check_every: int) -> tuple:
    i, s, _, path = item
    return s.kind, path, s.template, s.segment, check_every > 0 and i % check_every == 0


def fuzz(seed_list: list[Seed], n_inputs: int, seed: int, workers: int = 2, timeout_s: float = TIMEOUT_S,
         progress=None, check_every: int = 10) -> dict:
    """Run n_inputs mutants; returns counts and the failing cases (with how to reproduce them).
    Every `check_every`-th trace that analyses also has its report's charts checked for markup."""
    rng = random.Random(seed)
    counts = {"inputs": 0, "ok": 0, "error": 0, "traceback": 0, "hang": 0, "over_memory": 0, "escaping": 0}
    failures = []
    ctx = mp.get_context("spawn")  # no server process outliving the run (it would look like a child)
    pool = ctx.Pool(workers, initializer=_limit_memory)
    tmp = tempfile.mkdtemp(prefix="diag-fuzz-")
    try:
        pending: list = []
        for i in range(n_inputs):
            s = rng.choice(seed_list)
            desc, data, gz = mutate(s, rng)
            suffix = ".json" if s.kind in ("trace", "analysis") else ".jsonl" if s.kind == "run" else ".txt"
            path = os.path.join(tmp, f"in{i}" + suffix + (".gz" if gz else ""))
            Path(path).write_bytes(data)
            pending.append((i, s, desc, path))
            if len(pending) < 4 * workers and i < n_inputs - 1:
                continue
            jobs = [(item, pool.apply_async(run_one, _args(item, check_every))) for item in pending]
            pending = []
            k = 0
            while k < len(jobs):
                (j, s_, d_, p_), res = jobs[k]
                try:
                    status, detail = res.get(timeout=timeout_s)
                except mp.TimeoutError:
                    status, detail = "hang", f"no result within {timeout_s:.0f} s"
                    pool.terminate()  # the hung worker goes; the inputs after it run again
                    pool = ctx.Pool(workers, initializer=_limit_memory)
                    jobs[k + 1:] = [(item, pool.apply_async(run_one, _args(item, check_every)))
                                    for item, _ in jobs[k + 1:]]
                k += 1
                counts["inputs"] += 1
                counts[status] += 1
                if status in ("traceback", "hang", "over_memory", "escaping"):
                    kept = p_ + ".keep"
                    os.replace(p_, kept)
                    failures.append({"index": j, "seed": s_.name, "kind": s_.kind, "mutation": d_,
                                     "status": status, "detail": detail[-1500:], "input": kept})
                else:
                    os.unlink(p_)
                if progress:
                    progress(counts)
    finally:
        pool.terminate()
    counts["failures"] = failures
    counts["kept_inputs_dir"] = tmp
    return counts
