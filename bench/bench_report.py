"""Render time and size of the report of a big run: 64 ranks x 2,000 steps.

    python bench/bench_report.py [--ranks 64] [--steps 2000] [--keep DIR] [--no-browser]

Builds a run directory with diag.rundir the way the agent writes one (synthetic step
records, 1 Hz device/host samples, one analysed profiler window per rank with matched
collectives and a late rank), then times each stage of `diag report`:

  analysis   diag.analyzers.job.run_analysis.analyze_run plus reading samples (load_run)
  model      diag.analyzers.views.report_model.build_model (aggregation and downsampling)
  render     report.html + report.md + summary.json written
  browser    headless Chromium: from navigation until every chart is drawn (if available)

and prints the size of report.html. Targets (issue 5): under 5 s, under 10 MB.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLASSES = ("data", "host", "comm", "memory", "compute")


def build_run(root: Path, ranks: int, steps: int, step_s: float = 0.1, late_rank: int = 7) -> None:
    from diag import atomic_io, rundir, segments

    rng = random.Random(0)
    t0 = 1_700_000_000.0
    atomic_io.atomic_write_json(root / rundir.MANIFEST, {
        "schema": rundir.RUN_SCHEMA, "run": root.name, "world_size": ranks, "backend": "nccl",
        "started_unix": t0, "ended_unix": t0 + steps * step_s, "status": "completed",
    })
    for r in range(ranks):
        rp = root / rundir.rank_dir_name(r)
        host = f"node-{r // 8:03d}"
        atomic_io.atomic_write_json(rp / rundir.RANK_FILE, {
            "schema": rundir.RANK_SCHEMA, "rank": r, "world_size": ranks, "host": host, "status": "completed",
            "device": {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 << 30},
        })
        w = segments.SegmentWriter(rp / "steps", "steps", flush_records=1000, flush_seconds=1e9)
        for s in range(steps):
            comm = 0.30 + 0.05 * rng.random() if r != late_rank else 0.08
            sh = {"data": 0.05, "host": 0.05, "comm": comm, "memory": 0.2, "compute": 0.7 - comm}
            d = step_s * (1 + 0.05 * rng.random())
            w.write({"step": s, "start_unix": t0 + s * step_s, "duration_s": d, "data_wait_s": 0.05 * d,
                     "samples": 32, "tokens": 32 * 2048, "peak_mem_bytes": 50 << 30,
                     "profiled": 100 <= s < 103, "bound": "comm", "evidence": "sampled", "shares": sh})
        w.flush()
        sw = segments.SegmentWriter(rp / "samples", "samples", flush_records=10_000, flush_seconds=1e9)
        for i in range(int(steps * step_s)):
            sw.write({"t": t0 + i, "gpu": {
                "index": r % 8, "name": "NVIDIA H100 80GB HBM3", "utilization_ratio": 0.6 + 0.3 * rng.random(),
                "memory_used_bytes": 52 << 30, "memory_total_bytes": 80 << 30, "sm_clock_hz": 1.98e9,
                "power_watts": 500 + 100 * rng.random(), "temperature_celsius": 65.0,
                "clock_events": ["sw_thermal"] if (r == late_rank and i % 10 == 0) else []},
                "host": {"cpu_ratio": 0.4, "memory_used_bytes": 200 << 30, "memory_total_bytes": 1 << 40,
                         "process_rss_bytes": 20 << 30}})
        sw.flush()
        colls = []
        for i in range(300):  # 100 per traced step
            step = 100 + i // 100
            # The late rank enters each all-reduce 500 us after the others and so waits less in it.
            late = 500.0 if r == late_rank else 0.0
            colls.append({"name": "all_reduce", "pg": "0", "seq": i, "ts_us": step * 1e5 + (i % 100) * 900.0 + late,
                          "dur_us": 400.0 if r == late_rank else 900.0 + 50 * rng.random(),
                          "bytes": 25 << 20, "on": "device", "step": step})
        sh = {"data": 0.05, "host": 0.05, "comm": 0.33, "memory": 0.2, "compute": 0.37}
        analysis = {
            "rank": r, "source": f"rank{r}.pt.trace.json.gz", "device": "NVIDIA H100 80GB HBM3", "world_size": ranks,
            "bound": "comm",
            "steps": [{"step": s, "duration_ms": step_s * 1000, "bound": "comm", "shares": sh, "path": [],
                       "evidence": "trace"} for s in range(100, 103)],
            "gpu_time": {"idle_pct": 12.0, "compute_pct": 60.0, "non_compute_pct": 28.0,
                         "comm_compute_overlap_pct": 35.0},
            "findings": [], "collectives": colls, "mfu": 0.31, "fixes": [], "path": [],
            "top_kernels": [{"name": f"sm90_xmma_gemm_bf16_{k}", "class": "compute", "time_ms": 30.0 - k,
                             "count": 100, "pct": 10.0 - k / 3, "intensity": 300.0} for k in range(20)],
            "top_ops": [{"name": f"aten::op{k}", "class": "compute", "time_ms": 20.0 - k / 2, "count": 50,
                         "pct": 5.0} for k in range(20)],
        }
        atomic_io.atomic_write_json(rp / rundir.WINDOWS / "window-000100.json",
                                 {"first_step": 100, "last_step": 102, "trace": "x", "analysis": analysis})


def browser_time(page: Path) -> float | None:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import websocket  # noqa: F401
        from report_helpers import CHARTS_DRAWN_JS, Browser
    except ImportError as exc:
        print(f"browser: skipped ({exc}; pip install websocket-client)")
        return None
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(chromium, os.X_OK):
        print("browser: skipped (chromium not installed)")
        return None
    with tempfile.TemporaryDirectory() as profile:
        b = Browser(chromium, Path(profile), timeout=120)
        try:
            b.open("about:blank", "true")
            took = b.open(page.as_uri(), CHARTS_DRAWN_JS, timeout=120)
            errors = b.errors()
            charts = b.eval("document.querySelectorAll('.js-plotly-plot').length")
        finally:
            b.close()
    print(f"browser: {charts} charts drawn, {len(errors)} console error(s)")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--keep", metavar="DIR", help="build the run here and keep it")
    ap.add_argument("--no-browser", action="store_true")
    args = ap.parse_args()

    from diag.analyzers.views.report_model import build_model
    from diag.report import write_model
    from diag.report.load import load_run

    tmp = None
    if args.keep:
        root = Path(args.keep)
        shutil.rmtree(root, ignore_errors=True)
    else:
        tmp = tempfile.TemporaryDirectory()
        root = Path(tmp.name) / "run"
    try:
        t = time.perf_counter()
        build_run(root, args.ranks, args.steps)
        print(f"run directory: {args.ranks} ranks x {args.steps} steps built in {time.perf_counter() - t:.1f} s")
        clock = [(time.perf_counter(), time.process_time())]
        doc, run = load_run(root)
        clock.append((time.perf_counter(), time.process_time()))
        model = build_model(doc, run)
        clock.append((time.perf_counter(), time.process_time()))
        paths = write_model(model, root)
        clock.append((time.perf_counter(), time.process_time()))
        size = os.path.getsize(paths["html"])

        def span(a, b):
            return f"{clock[b][0] - clock[a][0]:6.2f} s wall, {clock[b][1] - clock[a][1]:6.2f} s CPU"

        print(f"analysis (run analysis + reading samples): {span(0, 1)}")
        print(f"model (aggregate, downsample):             {span(1, 2)}")
        print(f"render (html + md + json written):         {span(2, 3)}")
        print(f"report rendering, model + render:          {span(1, 3)}   (target < 5 s)")
        print(f"diag report end to end:                    {span(0, 3)}")
        print(f"report.html: {size / 1e6:.2f} MB (target < 10 MB); "
              f"report.md {os.path.getsize(paths['markdown']) / 1e3:.1f} kB; "
              f"summary.json {os.path.getsize(paths['summary']) / 1e3:.1f} kB")
        print("page notes: " + " | ".join(model["notes"]))
        print("headline: " + model["headline"]["text"])
        if not args.no_browser:
            took = browser_time(Path(paths["html"]))
            if took is not None:
                print(f"browser: all charts drawn {took:.2f} s after navigation (target < 5 s)")
        if os.getloadavg()[0] > (os.cpu_count() or 1):
            print(f"note: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; times are inflated")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
