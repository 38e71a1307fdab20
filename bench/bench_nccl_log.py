"""Benchmark: stream a large synthetic NCCL log through `diag.analyzers.nccl.log`.

The log is built from the real log lines in ../shared/data/nccl (NCCL INFO/WARN, COLL,
TUNING, RCCL, PyTorch watchdog lines), repeated with varied hosts, pids and ranks, and
written to a temporary file. The parser then runs in a fresh process so that its peak RSS
is its own; a bare `for line in file` loop over the same file is timed beside it as the
floor set by Python's line reading.

    python bench/bench_nccl_log.py                      # 1024 MiB, both line mixes
    python bench/bench_nccl_log.py --mb 64 --mix job    # quick run

Two mixes: "uniform" draws every real line with equal weight (the real files are excerpts
chosen for their variety, so this is the worst case: many rare, costly line kinds, and
lines that excerpts mangled: glued pairs, COLL lines without their prefix);
"job" is shaped like a real job's log (per-rank init preamble, then COLL lines as NCCL
prints them, with their host:pid:tid [dev] prefix).

The parser reads undecoded chunks and splits out the frequent line kinds with one regular
expression in C (see `NcclLogParser.feed_bytes`); the figure that matters on a shared
machine is lines per CPU second, printed beside the wall-clock rate together with a
reference timing that shows how much slower than an idle core this machine currently is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "nccl"
PREFIX = re.compile(r"^(?P<lead>.*?)(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\]")

CHILD = r"""
import json, os, resource, sys, time
from diag.analyzers.diagnosis.nccl_log import findings
from diag.analyzers.nccl.log import parse_files
mode, path, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
if mode == "parse":
    doc = parse_files([path], jobs=jobs or None)
    from diag.analyzers.nccl.log_parallel import MIN_PARALLEL_BYTES, default_jobs
    used = (jobs or default_jobs()) if os.path.getsize(path) >= MIN_PARALLEL_BYTES else 1
    extra = {"findings": [f["id"] for f in findings(doc)], "lines": doc["lines"], "jobs": used,
             "warning_kinds": len(doc["warnings"]), "peers": len(doc["transports"]["peers"])}
else:
    n = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for _ in fh:
            n += 1
    extra = {"lines": n}
dt = time.perf_counter() - t0
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": dt, "cpu_seconds": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "peak_rss_bytes": me.ru_maxrss * 1024, "worker_peak_rss_bytes": kids.ru_maxrss * 1024,
                  **extra}))
"""


def template_lines(data_dir: Path) -> list[str]:
    lines = []
    for f in sorted(data_dir.iterdir()):
        if not f.name.startswith(("nccllog_", "rccllog_", "torchlog_")):
            continue
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip() and not line.startswith("#"):
                lines.append(line)
    return lines


def variants(lines: list[str], nodes: int, per_node: int, count: int, seed: int = 1) -> list[str]:
    """`count` lines drawn from the templates with host, pid and device rewritten."""
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        line = lines[rnd.randrange(len(lines))]
        node = rnd.randrange(nodes)
        dev = rnd.randrange(per_node)
        m = PREFIX.match(line)
        if m:
            line = (f"{m.group('lead')}node{node:04d}:{10000 + dev}:{20000 + dev} [{dev}]" + line[m.end():])
        line = re.sub(r"\[Rank \d+\]", f"[Rank {node * per_node + dev}]", line)
        out.append(line + "\n")
    return out


def _rewrite(line: str, node: int, dev: int, per_node: int) -> str:
    m = PREFIX.match(line)
    if m:
        line = f"{m.group('lead')}node{node:04d}:{10000 + dev}:{20000 + dev} [{dev}]" + line[m.end():]
    return re.sub(r"\[Rank \d+\]", f"[Rank {node * per_node + dev}]", line)


def job_lines(lines: list[str], nodes: int, per_node: int, coll_per_rank: int, seed: int = 2) -> list[str]:
    """One job's log: every rank prints an init preamble (real INFO lines, transports among
    them) and then COLL lines (real ones, opCount counting up), as NCCL_DEBUG=INFO with
    NCCL_DEBUG_SUBSYS=INIT,COLL does over a training run."""
    rnd = random.Random(seed)
    # COLL lines as NCCL prints them: with the host:pid:tid [dev] prefix (some excerpts in the
    # data lost it, or hold two lines glued together; the uniform mix keeps those)
    colls = [ln for ln in lines if ": opCount " in ln and PREFIX.match(ln) and ln.count("NCCL INFO ") == 1]
    init = [ln for ln in lines if " NCCL INFO " in ln and ": opCount " not in ln]
    out = []
    for node in range(nodes):
        for dev in range(per_node):
            out += [_rewrite(rnd.choice(init), node, dev, per_node) + "\n" for _ in range(60)]
            for op in range(coll_per_rank):
                line = _rewrite(colls[op % len(colls)], node, dev, per_node)
                out.append(re.sub(r"opCount [0-9a-f]+", f"opCount {op:x}", line) + "\n")
    return out


def write_log(path: Path, mb: int, data_dir: Path, mix: str = "uniform") -> int:
    templ = template_lines(data_dir)
    if mix == "job":
        block = "".join(job_lines(templ, nodes=16, per_node=8, coll_per_rank=200))
    else:
        block = "".join(variants(templ, nodes=128, per_node=8, count=20000))
    target = mb * 1024 * 1024
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            fh.write(block)
            written += len(block.encode())
    return written


IDLE_REFERENCE_US = 9.0  # sum(range(1000)) on an idle modern x86 core with CPython 3.11: 8-10 us


def calibrate() -> tuple[float, float]:
    """Best-of-5 microseconds of `sum(range(1000))` in wall time (how shared this machine is:
    time slices lost to other processes) and in CPU time (how fast a core runs for us when we
    have it: SMT siblings and cache contention slow it too)."""
    import timeit

    wall = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    cpu = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5, timer=time.process_time)) / 2000 * 1e6
    return wall, cpu


def run_child(mode: str, path: Path, jobs: int = 0) -> dict:
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(jobs)], capture_output=True, text=True,
                         env=env, check=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(mix: str, args) -> None:
    tmpdir = Path(tempfile.mkdtemp(prefix="diag-nccl-bench-"))
    path = tmpdir / "nccl_synthetic.log"
    try:
        t0 = time.perf_counter()
        size = write_log(path, args.mb, args.data, mix)
        gen = time.perf_counter() - t0
        floor = run_child("read", path)
        res = run_child("parse", path, args.jobs)
        lines = res["lines"]
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        what = ("real log lines drawn uniformly from every file" if mix == "uniform" else
                "a job log: per-rank init preamble, then COLL lines (NCCL_DEBUG_SUBSYS=INIT,COLL)")
        print(f"[{mix}] {what}")
        print(f"synthetic log: {size / 2**20:.0f} MiB, {lines:,} lines (generated in {gen:.1f} s)")
        ref_wall, ref_cpu = calibrate()
        print(f"machine: {os.cpu_count()} CPUs, load average {load:.1f}; reference sum(range(1000)) "
              f"{ref_wall:.1f} us wall, {ref_cpu:.1f} us CPU (about 8-10 us on an idle modern core)")
        print(f"bare line read : {floor['seconds']:.2f} s wall  {floor['lines'] / floor['seconds']:,.0f} lines/s  "
              f"peak RSS {floor['peak_rss_bytes'] / 2**20:.0f} MiB")
        rate = lines / res["seconds"]
        print(f"diag nccl-log  : {res['seconds']:.2f} s wall, {res['cpu_seconds']:.2f} s CPU  "
              f"{rate:,.0f} lines/s wall  {lines / res['cpu_seconds']:,.0f} lines/s per CPU second  "
              f"{size / 2**20 / res['seconds']:.0f} MiB/s  peak RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB "
              f"(workers: {res['worker_peak_rss_bytes'] / 2**20:.0f} MiB each at most)")
        print(f"parser cost over bare read: {res['seconds'] / floor['seconds']:.1f}x wall; "
              f"target >= 500,000 lines/s: {'met' if rate >= 500_000 else 'NOT met'} on this machine")
        per_cpu_idle = lines / res["cpu_seconds"] * ref_cpu / IDLE_REFERENCE_US
        print(f"estimate for an idle machine: {per_cpu_idle:,.0f} lines per CPU second (this run's rate x "
              f"{ref_cpu:.1f} / {IDLE_REFERENCE_US:.0f} us CPU reference), so about "
              f"{per_cpu_idle * res['jobs']:,.0f} lines/s wall with its {res['jobs']} worker(s) on idle cores")
        print(f"findings: {', '.join(res['findings'])}; warning kinds {res['warning_kinds']}; "
              f"peers kept {res['peers']}")
    finally:
        if args.keep:
            print(f"kept {path}")
        else:
            path.unlink(missing_ok=True)
            tmpdir.rmdir()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="size of the synthetic log in MiB (default 1024)")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DIAG_REAL_DATA", DEFAULT_DATA.parent)) / "nccl")
    ap.add_argument("--keep", action="store_true", help="keep the generated log file")
    ap.add_argument("--jobs", type=int, default=0, help="parser processes (default 0: one per usable CPU)")
    ap.add_argument("--mix", choices=("uniform", "job", "both"), default="both",
                    help="line mix of the synthetic log (default: both, one after the other)")
    args = ap.parse_args()
    if not args.data.is_dir():
        print(f"bench_nccl_log: real NCCL logs not found in {args.data}", file=sys.stderr)
        return 2
    for mix in (("uniform", "job") if args.mix == "both" else (args.mix,)):
        bench(mix, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
