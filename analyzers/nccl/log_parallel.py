"""Parse one large plain-text NCCL log in parallel: byte ranges aligned to line starts,
one `NcclLogParser` per range in worker processes, states merged in file order.

Each worker reads its range in chunks of whole lines (`line_chunks`, also used for a
single process), so memory stays bounded per worker. A line belongs
to the range holding its first byte. Multi-line constructs that straddle a boundary (a
tuning table, an error chain) are at worst split in two, which only affects examples.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from diag.analyzers.nccl.log import NcclLogParser
from diag.analyzers.nccl.log_collectives import flush_colls
from diag.analyzers.nccl.log_grammar import MAX_LINE

BLOCK = 4 << 20
MIN_PARALLEL_BYTES = 64 << 20  # below this, process start-up costs more than it saves


def default_jobs() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


def split_ranges(path: Path, parts: int) -> list[tuple[int, int]]:
    size = path.stat().st_size
    step = max(1, size // parts)
    bounds = [0] + [min(size, i * step) for i in range(1, parts)] + [size]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def line_chunks(fh, start: int, end: int | None):
    """Chunks (bytes) of the whole lines whose first byte lies in [start, end) of the binary
    stream `fh` (positioned at `start`; `end` None: to its end). Each chunk ends in a newline;
    a line longer than MAX_LINE is kept in full only up to about MAX_LINE + BLOCK bytes and
    cut exactly by the parser."""
    if start > 0:
        fh.seek(start - 1)
        if fh.read(1) != b"\n":
            fh.readline()  # that line started in the previous range
        pos = fh.tell()
    else:
        pos = 0
    rest = b""
    while end is None or pos < end:
        chunk = fh.read(BLOCK if end is None else min(BLOCK, end - pos))
        if not chunk:
            break
        pos += len(chunk)
        data = rest + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            rest = data[:MAX_LINE]  # a giant line: keep its start only
            continue
        rest = data[cut + 1:]
        yield data[:cut + 1]
    if rest:  # the last line starting in this range may end after it
        tail = rest + (fh.readline(MAX_LINE) if end is not None else b"")
        yield tail if tail.endswith(b"\n") else tail + b"\n"


def _parse_range(args) -> NcclLogParser:
    path, start, end, max_evidence = args
    p = NcclLogParser(max_evidence=max_evidence)
    with open(path, "rb") as fh:
        for chunk in line_chunks(fh, start, end):
            p.feed_bytes(chunk)
    p.close_chains()
    flush_colls(p)
    p.prefix_cache.clear()  # not needed by the merge; keeps the result small to send back
    return p


def parse_large_file(path: Path, max_evidence: int, jobs: int) -> NcclLogParser:
    """A parser holding the whole file's state, built by `jobs` worker processes."""
    ranges = split_ranges(path, jobs)
    tasks = [(str(path), a, b, max_evidence) for a, b in ranges]
    # fork: the workers need no re-import of __main__ (which may be `-c` or stdin)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    try:
        with ProcessPoolExecutor(max_workers=len(tasks), mp_context=multiprocessing.get_context(method)) as pool:
            parts = list(pool.map(_parse_range, tasks))
    except (BrokenProcessPool, OSError):
        # no processes available (limits, sandbox): the same work in this process
        parts = [_parse_range(t) for t in tasks]
    first = parts[0]
    for other in parts[1:]:
        first.merge(other)
    return first
