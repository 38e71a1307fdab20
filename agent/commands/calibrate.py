"""`diag calibrate`: measure this host's CPU peak FLOP/s and memory bandwidth and cache them."""

from __future__ import annotations

import json
import sys

from diag.errors import DiagInputError

HELP = "measure this host's CPU peak FLOP/s and memory bandwidth"


def add_arguments(parser) -> None:
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="time budget of the benchmark, torch's start-up aside (default 3)")
    parser.add_argument("--show", action="store_true", help="print the cached peaks without measuring")
    parser.add_argument("--json", action="store_true", help="print the peaks as JSON")
    parser.add_argument("--cache", metavar="FILE", help="cache file (default $XDG_CACHE_HOME/diag/cpu_peaks.json)")


def run(args) -> int:
    from diag import calibrate as cal
    from diag.analyzers.trace.devices import cache_path

    path = args.cache or str(cache_path())
    if args.show:
        doc = cal.load(path)
        if doc is None:
            raise DiagInputError("no calibration cached; run `diag calibrate` first", source=path)
    else:
        if args.seconds <= 0:
            raise DiagInputError("--seconds must be positive")
        doc, path = cal.calibrate(args.seconds, path,
                                  progress=lambda stage: print(f"diag calibrate: {stage}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    fl = doc.get("flops") or {}

    def g(v):
        return "n/a" if not v else f"{v / 1e9:,.1f} GFLOP/s"

    print(f"CPU: {doc.get('cpu')} ({doc.get('threads')} threads, torch {doc.get('torch')})")
    print(f"  matmul fp32   {g(fl.get('fp32'))}")
    print(f"  matmul bf16   {g(fl.get('bf16'))}")
    print(f"  memory        {doc['mem_bw'] / 1e9:,.1f} GB/s")
    if fl.get("fp32") and doc.get("mem_bw"):
        print(f"  roofline knee {fl['fp32'] / doc['mem_bw']:.1f} FLOP/byte (fp32)")
    busy = doc.get("busy_cpu_percent")
    if isinstance(busy, (int, float)) and busy >= cal.BUSY_PERCENT:
        print(f"diag calibrate: warning: {busy:.0f}% of this machine's CPUs were busy with other work when it "
              "started: these peaks are low; calibrate again when it is quiet", file=sys.stderr)
    print(f"cached in {path}", file=sys.stderr)
    return 0
