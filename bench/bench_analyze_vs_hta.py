"""diag analyze against HolisticTraceAnalysis 0.5.0 on a ~2 million event trace, side by side.

    python bench/bench_analyze_vs_hta.py [--events 2000000] [--trace FILE] [--keep]
    python bench/bench_analyze_vs_hta.py --scaling 2000000,10000000   (diag alone, per event)

1. Builds the trace by tiling the ProfilerSteps of a real trace (default
   a100_2rank_nccl.json.gz from $DIAG_REAL_DATA/traces or ../shared/data/traces): every
   copy is shifted past the end of the previous one, and its correlation, External id
   and flow ids are offset so nothing collides. Written gzipped to a temporary directory.
2. Creates (once) a virtual environment bench/.venv-hta holding HolisticTraceAnalysis
   0.5.0 and the libraries it imports, pinned (HTA_PINS). HTA does not import torch,
   jupyterlab or pytest (its metadata asks for the latter two), so they are left out.
3. Runs, each in its own process: HTA's TraceAnalysis load plus get_temporal_breakdown,
   and `diag analyze --json` (its modules byte-compiled first, as an installed copy's are). Wall time and peak RSS come from /usr/bin/time -v where
   present; the whole process tree's RSS is also polled (psutil), since either tool may
   fan out to worker processes.
4. Prints a table, the speed ratio (HTA / diag wall time) and RSS ratio (diag / HTA), and
   checks that the two tools' idle / compute / non-compute percentages agree.

Targets: diag at least 40x faster and at most a tenth of HTA's peak RSS, both tools on one core
(--cores 1, the default: on more, diag's loader inflates in a thread and may decode in worker
processes, while HTA's load and breakdown stay on one).
Results are also written to bench/out/analyze_vs_hta.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import psutil

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "bench" / ".venv-hta"
# What HTA 0.5.0 imports on the load + temporal breakdown path and their own requirements,
# the whole closure pinned and installed with --no-deps (reproducible, and HTA's metadata
# would pull jupyterlab and pytest, which it never imports). pandas stays on the 2.x line
# HTA 0.5.0 was released against.
HTA_PINS = [
    "HolisticTraceAnalysis==0.5.0",
    "numpy==2.2.6",
    "pandas==2.2.3",
    "python-dateutil==4.0.0",
    "pytz==2026.6",
    "tzdata==2026.6",
    "plotly==5.24.1",
    "tenacity==9.2.1",
    "packaging==26.3",
    "networkx==3.4.2",
    "pydot==3.0.4",
    "pyparsing==3.3.3",
    "pyyaml==6.0.2",
    "psutil==6.1.1",
]
TARGET_SPEED = 40.0
TARGET_RSS = 0.1
AGREE_PP = 1.0

HTA_SNIPPET = r"""
import json, logging, sys, time
t0 = time.perf_counter()
from hta.configs.config import logger
logger.setLevel(logging.ERROR)
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
t2 = time.perf_counter()
df = ta.get_temporal_breakdown(visualize=False)
t3 = time.perf_counter()
row = df.iloc[0]
print(json.dumps({
    "import_s": t1 - t0, "load_s": t2 - t1, "breakdown_s": t3 - t2,
    "idle_pct": float(row["idle_time_pctg"]), "compute_pct": float(row["compute_time_pctg"]),
    "non_compute_pct": float(row["non_compute_time_pctg"]),
}))
"""


def real_trace() -> Path:
    env = os.environ.get("DIAG_REAL_DATA")
    for base in ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]:
        p = base / "traces" / "a100_2rank_nccl.json.gz"
        if p.exists():
            return p
    sys.exit("bench: real trace not found; set DIAG_REAL_DATA or pass --trace FILE")


# --- building the tiled trace -----------------------------------------------------------

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_ID_KEYS = ("correlation", "External id", "Record function id", "Python id", "Python parent id", "Ev Idx")


def tile_trace(src: Path, dst: Path, target_events: int) -> dict:
    """Copies of the source's ProfilerSteps laid end to end until target_events is reached."""
    with gzip.open(src, "rb") as f:
        doc = msgspec.json.decode(f.read())
    events = doc["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and _STEP_RE.match(str(e.get("name", "")))]
    if not steps:
        sys.exit(f"bench: {src} has no ProfilerStep events to tile")
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    body = [e for e in events if "ts" in e and lo <= float(e["ts"]) < hi and e.get("ph") != "M"]
    rest = [e for e in events if not ("ts" in e and lo <= float(e["ts"]) < hi and e.get("ph") != "M")]
    # Shift by the span of everything in the body (device work runs past the last step).
    end = max(float(e["ts"]) + float(e.get("dur", 0) or 0) for e in body)
    shift_ts = (end - lo) + 1000.0
    max_id = 0
    for e in events:
        a = e.get("args") or {}
        for k in _ID_KEYS:
            v = a.get(k)
            if isinstance(v, int):
                max_id = max(max_id, v)
        if isinstance(e.get("id"), int):
            max_id = max(max_id, e["id"])
    shift_id = max_id + 1
    step_nums = [int(_STEP_RE.match(e["name"]).group(1)) for e in steps]
    shift_step = max(step_nums) - min(step_nums) + 1

    copies = max(1, -(-(target_events - len(rest)) // len(body)))
    enc = msgspec.json.Encoder()
    n = 0
    with open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as gz:
        head = {k: v for k, v in doc.items() if k != "traceEvents"}
        gz.write(enc.encode(head)[:-1] + b',"traceEvents":[')
        first = True
        for e in rest:
            gz.write((b"" if first else b",") + enc.encode(e))
            first = False
            n += 1
        for k in range(copies):
            chunk = []
            for e in body:
                c = dict(e)
                c["ts"] = float(e["ts"]) + k * shift_ts
                if isinstance(e.get("id"), int):
                    c["id"] = e["id"] + k * shift_id
                a = e.get("args")
                if a:
                    a = dict(a)
                    for key in _ID_KEYS:
                        if isinstance(a.get(key), int) and a[key] >= 0:
                            a[key] += k * shift_id
                    c["args"] = a
                m = _STEP_RE.match(str(e.get("name", "")))
                if m:
                    c["name"] = f"ProfilerStep#{int(m.group(1)) + k * shift_step}"
                chunk.append(enc.encode(c))
            gz.write((b"" if first else b",") + b",".join(chunk))
            first = False
            n += len(chunk)
        gz.write(b"]}")
    return {"events": n, "copies": copies, "steps": copies * len(steps), "bytes": dst.stat().st_size}


# --- the HTA environment ----------------------------------------------------------------


def hta_python() -> Path:
    py = VENV / "bin" / "python"
    marker = VENV / "diag-pins.txt"
    want = "\n".join(HTA_PINS) + "\n"
    if py.exists() and marker.exists() and marker.read_text() == want:
        return py
    print(f"bench: creating {VENV.relative_to(REPO)} with {', '.join(HTA_PINS)} (once)", file=sys.stderr)
    if VENV.exists():
        shutil.rmtree(VENV)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*pip, *HTA_PINS], check=True)
    subprocess.run([str(py), "-c", "import hta.trace_analysis"], check=True)
    marker.write_text(want)
    return py


# --- measuring ----------------------------------------------------------------------------


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], env: dict | None = None, cpus: set[int] | None = None) -> dict:
    """Run cmd (on `cpus` where given, its children too); wall time, peak RSS (largest process,
    /usr/bin/time) and peak tree RSS (polled)."""
    gnu_time = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
    with tempfile.NamedTemporaryFile("r", suffix=".time", delete=False) as tf:
        time_file = tf.name
    full = [gnu_time, "-v", "-o", time_file, *cmd] if gnu_time else cmd
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=pin)
    peak_tree = 0
    stop = threading.Event()

    def poll():
        nonlocal peak_tree
        ps = psutil.Process(proc.pid)
        while not stop.is_set():
            peak_tree = max(peak_tree, _tree_rss(ps))
            stop.wait(0.05)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    stop.set()
    th.join()
    res = {
        "cmd": cmd,
        "rc": proc.returncode,
        "wall_s": wall,
        # CPU seconds of the whole process tree (waited-for descendants included).
        "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "stdout": out,
        "stderr": err,
        "peak_tree_rss_mb": peak_tree / 2**20,
        "peak_rss_mb": None,
    }
    if gnu_time:
        text = Path(time_file).read_text(errors="replace")
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        if m:
            res["peak_rss_mb"] = int(m.group(1)) / 1024
        m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", text)
        if m:
            res["wall_s"] = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    os.unlink(time_file)
    if res["peak_rss_mb"] is None:
        res["peak_rss_mb"] = res["peak_tree_rss_mb"]
    return res


def _median_run(runs: list[dict]) -> dict:
    """The run of median wall time, with the largest peak RSS of all runs."""
    bad = [r for r in runs if r["rc"] != 0]
    if bad:
        return bad[0]
    mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {
        **mid,
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "peak_tree_rss_mb": max(r["peak_tree_rss_mb"] for r in runs),
        "runs": len(runs),
    }


def breakdown(path: Path, cli_wall_s: float) -> dict:
    """Where diag's time goes on this trace, in this process, one stage at a time (serial):
    inflating, decoding the JSON text and building the columns (by the compiled reader where it
    is built, and by the Python reader's two stages, msgspec and the columns), the analysis, and
    what the command adds around them (interpreter start-up, imports, the JSON output)."""
    from diag.analyzers.diagnosis import decision_tree as dt
    from diag.analyzers.diagnosis.rank import judge_trace
    from diag.analyzers.trace import load, scan
    from diag.analyzers.trace.analysis import facts_of_loaded
    from diag.analyzers.trace.column_builder import ColumnBuilder
    from diag.analyzers.trace.read_blocks import blocks

    t = time.perf_counter()
    for _ in blocks(str(path)):  # inflating alone: the loader reads the blocks in place
        pass
    inflate = time.perf_counter() - t
    text = b"".join(bytes(b) for b in blocks(str(path)))
    start = text.index(b"[", text.index(b'"traceEvents"'))
    b = ColumnBuilder()
    chunks, pos = [], start + 1
    while True:  # cut as the loader does: about CHUNK_BYTES of whole events per chunk
        m = load._SEP_RE.search(text, pos + load.CHUNK_BYTES)
        if m is None:
            chunks.append(b"".join((b"[", text[pos:text.rindex(b"]", pos)], b"]")))
            break
        chunks.append(b"".join((b"[", text[pos:m.start() + 1], b"]")))
        pos = m.end() - 1
    scanned = None
    if scan.compiled():  # the compiled reader, decoding and building the columns in one pass
        t = time.perf_counter()
        fast = ColumnBuilder()
        for c in chunks:
            fast.take(c)
        fast.build(str(path), {})
        scanned = time.perf_counter() - t
        del fast
    t = time.perf_counter()
    decoded = [b.decode(c) for c in chunks]
    decode = time.perf_counter() - t
    t = time.perf_counter()
    for events, codes in decoded:
        b.add(events, codes)
    trace = b.build(str(path), {})
    columns = time.perf_counter() - t
    del decoded
    t = time.perf_counter()
    tree = dt.load_tree()
    judge_trace(facts_of_loaded(trace, tree.facts), tree)
    analysis = time.perf_counter() - t
    t = time.perf_counter()
    load.load_trace(path, workers=None)
    loaded = time.perf_counter() - t
    return {"inflate_s": inflate, "decode_s": decode, "columns_s": columns, "scanned_s": scanned, "analysis_s": analysis,
            "load_as_run_s": loaded, "command_overhead_s": max(0.0, cli_wall_s - loaded - analysis)}


# The growth per event allowed from the smallest size to the largest (issue: linear time and
# memory, at most twice the smaller trace's figures per event).
SCALING_LIMIT = 2.0


def scaling(src: Path, sizes: list[int], repeat: int) -> int:
    """diag analyze --json alone on a tiled trace of each size: wall and CPU seconds per million
    events, and peak RSS beyond the interpreter's own per million events, each against the
    smallest size's. 0 when every size stays within SCALING_LIMIT of the smallest."""
    compile_diag()
    base = measure([sys.executable, "-c", "import diag.analyzers.analyze"])["peak_rss_mb"] or 0.0
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="diag-scaling-"))
    try:
        for n in sizes:
            tiled = tmp / f"rank-0-{n}.pt.trace.json.gz"
            info = tile_trace(src, tiled, n)
            run = _median_run([measure([sys.executable, "-m", "diag", "analyze", "--json", str(tiled)])
                               for _ in range(repeat)])
            if run["rc"] != 0:
                print(f"bench: diag failed at {n:,} events (exit {run['rc']}):\n{run['stderr'][-3000:]}",
                      file=sys.stderr)
                return 1
            rss = max(run["peak_rss_mb"] or 0.0, run["peak_tree_rss_mb"])
            m = info["events"] / 1e6
            rows.append({"events": info["events"], "gz_mib": info["bytes"] / 2**20, "wall_s": run["wall_s"],
                         "cpu_s": run["cpu_s"], "rss_mb": rss, "wall_per_m": run["wall_s"] / m,
                         "cpu_per_m": run["cpu_s"] / m, "rss_per_m": (rss - base) / m})
            tiled.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"diag analyze --json alone, median of {repeat}; RSS per million events is beyond the "
          f"{base:.0f} MiB of the interpreter with diag imported")
    print(f"{'events':>12}{'gz MiB':>8}{'wall s':>8}{'CPU s':>8}{'RSS MiB':>9}"
          f"{'wall s/M':>10}{'CPU s/M':>9}{'RSS MiB/M':>11}")
    for r in rows:
        print(f"{r['events']:>12,}{r['gz_mib']:>8.1f}{r['wall_s']:>8.2f}{r['cpu_s']:>8.2f}{r['rss_mb']:>9.0f}"
              f"{r['wall_per_m']:>10.2f}{r['cpu_per_m']:>9.2f}{r['rss_per_m']:>11.1f}")
    first, last = rows[0], rows[-1]
    growth = {k: last[k] / first[k] for k in ("wall_per_m", "cpu_per_m", "rss_per_m") if first[k] > 0}
    ok = all(g <= SCALING_LIMIT for g in growth.values())
    print(f"per event, {last['events']:,} against {first['events']:,}: "
          + ", ".join(f"{k.split('_')[0]} {g:.2f}x" for k, g in growth.items())
          + f"   limit {SCALING_LIMIT:.0f}x   {'MET' if ok else 'MISSED'}")
    return 0 if ok else 1


def compile_diag() -> None:
    """Byte-compile diag's modules once, as pip does when it installs the wheel (HTA's venv was
    compiled by its own install). Without it, a shell that sets PYTHONDONTWRITEBYTECODE makes
    every timed run of a source checkout compile diag again, about 0.25 s of each."""
    import compileall

    import diag.analyzers
    import diag.collectors

    for package in (diag, diag.analyzers, diag.collectors):
        compileall.compile_dir(str(Path(package.__file__).parent), quiet=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--events", type=int, default=2_000_000, help="events in the tiled trace (default 2000000)"
    )
    ap.add_argument(
        "--trace", type=Path, help="trace to tile (default: a100_2rank_nccl.json.gz from the real data)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the tiled trace and print its path")
    ap.add_argument("--repeat", type=int, default=3, help="diag runs; the median is reported (default 3)")
    ap.add_argument("--cores", type=int, default=1,
                    help="CPUs both tools may use (default 1, the target's measure; 0: all of this machine's)")
    ap.add_argument("--scaling", metavar="N,N,...",
                    help="diag alone on tiled traces of these event counts (e.g. 2000000,10000000): its time and "
                         "memory per event at each size against the smallest's (HTA is not run)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    allowed = sorted(os.sched_getaffinity(0))
    if not 0 <= args.cores <= len(allowed):
        ap.error(f"--cores must be 0 to {len(allowed)}, the CPUs this process may use")
    cpus = set(allowed[:args.cores]) if args.cores else None
    if args.scaling:
        try:
            sizes = sorted({int(n) for n in args.scaling.split(",")})
        except ValueError:
            ap.error("--scaling takes event counts separated by commas")
        return scaling(args.trace or real_trace(), sizes, args.repeat)

    src = args.trace or real_trace()
    py_hta = hta_python()
    tmp = Path(tempfile.mkdtemp(prefix="diag-bench-"))
    try:
        trace_dir = tmp / "trace"
        trace_dir.mkdir()
        tiled = trace_dir / "rank-0.pt.trace.json.gz"
        t0 = time.perf_counter()
        info = tile_trace(src, tiled, args.events)
        print(
            f"tiled {src.name}: {info['events']:,} events, {info['steps']} ProfilerSteps "
            f"({info['copies']} copies), {info['bytes'] / 2**20:.1f} MiB gzipped, built in "
            f"{time.perf_counter() - t0:.1f} s"
        )

        compile_diag()
        load1 = os.getloadavg()[0]
        # diag is cheap to repeat: the median of a few runs steadies it against the other
        # processes of a shared machine. HTA runs once (minutes).
        diag_runs = [
            measure([sys.executable, "-m", "diag", "analyze", "--json", str(tiled)], cpus=cpus)
            for _ in range(args.repeat)
        ]
        diag_run = _median_run(diag_runs)
        hta_run = measure([str(py_hta), "-c", HTA_SNIPPET, str(trace_dir)], cpus=cpus)
        for name, r in (("diag", diag_run), ("HTA", hta_run)):
            if r["rc"] != 0:
                print(f"bench: {name} failed (exit {r['rc']}):\n{r['stderr'][-3000:]}", file=sys.stderr)
                return 1
        hta_out = json.loads(hta_run["stdout"].strip().splitlines()[-1])
        doc = json.loads(diag_run["stdout"])
        gt = doc["ranks"][0]["gpu_time"]

        print()
        where = f"both tools on {len(cpus)} of them" if cpus else "both tools on all of them"
        print(f"load average {load1:.1f} on {os.cpu_count()} CPUs at the start of the timed runs, {where}", end="")
        print(" (wall times include contention; CPU seconds are less sensitive to it)" if load1 > 1 else "")
        print(f"{'tool':<36}{'wall s':>9}{'CPU s':>9}{'peak RSS MiB':>14}{'tree RSS MiB':>14}")
        diag_name = "diag analyze --json" + (f" (median of {args.repeat})" if args.repeat > 1 else "")
        for name, r in (("HTA 0.5.0 load+breakdown", hta_run), (diag_name, diag_run)):
            print(
                f"{name:<36}{r['wall_s']:>9.2f}{r['cpu_s']:>9.2f}"
                f"{r['peak_rss_mb']:>14.0f}{r['peak_tree_rss_mb']:>14.0f}"
            )
        print(
            f"(HTA inside: import {hta_out['import_s']:.1f} s, load {hta_out['load_s']:.1f} s, "
            f"temporal breakdown {hta_out['breakdown_s']:.1f} s)"
        )
        if cpus:  # the stages as the timed runs met them: on their CPUs
            os.sched_setaffinity(0, cpus)
        bd = breakdown(tiled, diag_run["wall_s"])
        os.sched_setaffinity(0, allowed)
        reader = (f"the compiled reader {bd['scanned_s']:.2f} s (the Python reader's decode {bd['decode_s']:.2f} s "
                  f"and columns {bd['columns_s']:.2f} s)" if bd["scanned_s"] is not None else
                  f"decode {bd['decode_s']:.2f} s, columns {bd['columns_s']:.2f} s (the compiled reader is not built)")
        print(f"(diag, stage by stage in one process: inflate {bd['inflate_s']:.2f} s, {reader}, "
              f"analysis {bd['analysis_s']:.2f} s; the loader overlaps inflating "
              f"with the rest and took {bd['load_as_run_s']:.2f} s; start-up, imports and JSON output "
              f"{bd['command_overhead_s']:.2f} s)")
        speed = hta_run["wall_s"] / diag_run["wall_s"]
        speed_cpu = hta_run["cpu_s"] / diag_run["cpu_s"] if diag_run["cpu_s"] > 0 else float("inf")
        # RSS ratio on the larger of the two measures for each tool: a tool that fans out
        # to workers is charged for all of them.
        rss_diag = max(diag_run["peak_rss_mb"], diag_run["peak_tree_rss_mb"])
        rss_hta = max(hta_run["peak_rss_mb"], hta_run["peak_tree_rss_mb"])
        rss = rss_diag / rss_hta
        print()
        print(
            f"speed ratio (HTA wall / diag wall): {speed:.1f}x   target >= {TARGET_SPEED:.0f}x   "
            f"{'MET' if speed >= TARGET_SPEED else 'MISSED'}"
        )
        print(
            f"CPU-time ratio (HTA CPU / diag CPU): {speed_cpu:.1f}x   (the same measure, free of the other "
            "processes' contention)"
        )
        print(
            f"RSS ratio (diag peak / HTA peak):   {rss:.2f}    target <= {TARGET_RSS}   "
            f"{'MET' if rss <= TARGET_RSS else 'MISSED'}"
        )

        print()
        print(f"{'':<10}{'idle %':>9}{'compute %':>11}{'non-compute %':>15}")
        keys = ("idle_pct", "compute_pct", "non_compute_pct")
        print(f"{'HTA':<10}" + "".join(f"{hta_out[k]:>{w}.2f}" for k, w in zip(keys, (9, 11, 15))))
        print(f"{'diag':<10}" + "".join(f"{float(gt[k]):>{w}.2f}" for k, w in zip(keys, (9, 11, 15))))
        diff = max(abs(hta_out[k] - float(gt[k])) for k in keys)
        agree = diff <= AGREE_PP
        print(f"largest difference {diff:.2f} pp: {'agree' if agree else 'DISAGREE'} (within {AGREE_PP} pp)")

        out_dir = REPO / "bench" / "out"
        out_dir.mkdir(exist_ok=True)
        result = {
            "trace": {"source": str(src), **info},
            "hta": {k: hta_run[k] for k in ("wall_s", "cpu_s", "peak_rss_mb", "peak_tree_rss_mb")} | hta_out,
            "diag": {k: diag_run[k] for k in ("wall_s", "cpu_s", "peak_rss_mb", "peak_tree_rss_mb")}
            | {"gpu_time": gt},
            "diag_breakdown_s": bd,
            "load_average": load1,
            "cores": len(cpus) if cpus else len(allowed),
            "speed_ratio": speed,
            "cpu_time_ratio": speed_cpu,
            "rss_ratio": rss,
            "max_diff_pp": diff,
        }
        (out_dir / "analyze_vs_hta.json").write_text(json.dumps(result, indent=1) + "\n")
        if args.keep:
            print(f"tiled trace kept at {tiled}")
        return 0 if agree else 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
