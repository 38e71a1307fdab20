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
    kind: str  # "trace", "nccl_tests" or "nccl_log"
    name: str
    data: bytes  # uncompressed


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


def _retype(r, d):
    """A number becomes a string, null, a list, an object, a bool or a huge number."""
    found = list(_NUMBER.finditer(d, 0, min(len(d), 1_000_000)))
    if not found:
        return _flip(r, d)
    out = bytearray(d)
    for m in sorted(r.sample(found, min(len(found), r.randint(1, 5))), key=lambda m: -m.start()):
        new = r.choice([b'"' + m.group() + b'"', b"null", b"[" + m.group() + b"]", b'{"v": 1}', b"true",
                        b"1e309", b'"x"', b"-0"])
        out[m.start():m.end()] = new
    return bytes(out)


def _delete_span(r, d):
    if not d:
        return d
    i = r.randrange(len(d))
    return d[:i] + d[i + r.randint(1, 512):]


def _empty(r, d):
    return r.choice([b"", b"{}", b"[]", b"null", b'{"traceEvents": 5}', b'{"traceEvents": [1, "a", null]}',
                     b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "a", "dur": []}]}'])


MUTATIONS = {
    "truncate": _truncate, "flip": _flip, "garbage": _insert_garbage, "invalid_utf8": _invalid_utf8,
    "repeat": _repeat, "shuffle_lines": _shuffle_lines, "retype": _retype, "delete": _delete_span,
    "empty": _empty,
}


def mutate(seed: Seed, rng: random.Random) -> tuple[str, bytes, bool]:
    """(description, mutated bytes, gzipped?) for one mutant of the seed."""
    names = rng.sample(sorted(MUTATIONS), rng.choice([1, 1, 2]))
    data = seed.data
    for n in names:
        data = MUTATIONS[n](rng, data)
    gz = seed.kind == "trace" and rng.random() < 0.5
    if gz:
        data = gzip.compress(data, compresslevel=1)
        if rng.random() < 0.2:  # damage the compressed stream itself
            data = rng.choice([_truncate, _flip])(rng, data)
    return "+".join(names) + ("+gzip" if gz else ""), data, gz


# --- running ---------------------------------------------------------------------------


def run_one(kind: str, path: str) -> tuple[str, str]:
    """("ok" | "error" | "traceback", detail) for one input file, through diag's entry points."""
    from diag.errors import DiagInputError

    try:
        if kind == "trace":
            from diag.analyzers.analyze import analyze_trace

            analyze_trace(path)
        elif kind == "nccl_tests":
            from diag.analyzers.nccl import nccl_tests

            nccl_tests.parse_file(path)
        else:
            from diag.analyzers.nccl import log as nccl_log

            nccl_log.parse_files([path])
        return "ok", ""
    except DiagInputError as exc:
        text = str(exc)
        return ("error", text) if "\n" not in text.strip() else ("traceback", "multi-line error: " + text[:300])
    except Exception:
        return "traceback", traceback.format_exc(limit=8)


def fuzz(seed_list: list[Seed], n_inputs: int, seed: int, workers: int = 2, timeout_s: float = TIMEOUT_S,
         progress=None) -> dict:
    """Run n_inputs mutants; returns counts and the failing cases (with how to reproduce them)."""
    rng = random.Random(seed)
    counts = {"inputs": 0, "ok": 0, "error": 0, "traceback": 0, "hang": 0}
    failures = []
    ctx = mp.get_context("spawn")  # no server process outliving the run (it would look like a child)
    pool = ctx.Pool(workers)
    tmp = tempfile.mkdtemp(prefix="diag-fuzz-")
    try:
        pending: list = []
        for i in range(n_inputs):
            s = rng.choice(seed_list)
            desc, data, gz = mutate(s, rng)
            path = os.path.join(tmp, f"in{i}" + (".json.gz" if gz else ".json" if s.kind == "trace" else ".txt"))
            Path(path).write_bytes(data)
            pending.append((i, s, desc, path))
            if len(pending) < 4 * workers and i < n_inputs - 1:
                continue
            jobs = [(item, pool.apply_async(run_one, (item[1].kind, item[3]))) for item in pending]
            pending = []
            k = 0
            while k < len(jobs):
                (j, s_, d_, p_), res = jobs[k]
                try:
                    status, detail = res.get(timeout=timeout_s)
                except mp.TimeoutError:
                    status, detail = "hang", f"no result within {timeout_s:.0f} s"
                    pool.terminate()  # the hung worker goes; the inputs after it run again
                    pool = ctx.Pool(workers)
                    jobs[k + 1:] = [(item, pool.apply_async(run_one, (item[1].kind, item[3])))
                                    for item, _ in jobs[k + 1:]]
                k += 1
                counts["inputs"] += 1
                counts[status] += 1
                if status in ("traceback", "hang"):
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
