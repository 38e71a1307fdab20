"""Short CPU micro-benchmark: peak matmul FLOP/s (fp32, bf16) and stream-like memory bandwidth.

The roofline needs the host's peaks when the CPU itself runs the model (gloo / CPU-only
traces). Datasheets do not give them for an arbitrary VM, so `diag calibrate` measures
them with torch in a few seconds and caches the result in
$XDG_CACHE_HOME/diag/cpu_peaks.json (written atomically). The agent reads it at start and
records it in each rank's rank.json; `diag analyze --calibration FILE` takes it for traces.
"""

from __future__ import annotations

import json
import os
import platform
import time

from diag.analyzers.trace.devices import cache_path
from diag.rundir import atomic_write_bytes

SCHEMA = "diag.cpu_peaks/1"
MAX_FILE_BYTES = 1 << 20  # a calibration is a few hundred bytes; anything larger is not one


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _best_rate(fn, work: float, budget_s: float, min_reps: int = 3) -> float:
    """Best work/second over repetitions of fn within budget_s (after one warm-up call)."""
    fn()
    best = 0.0
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, work / dt)
        reps += 1
        if reps >= 200:
            break
    return best


def measure(seconds: float = 3.0, matmul_n: int = 1024, stream_elems: int = 1 << 24) -> dict:
    """Measure peaks with torch on the CPU. Returns the cache document."""
    import torch

    budget = max(0.3, seconds / 4)
    flops = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(matmul_n, matmul_n).to(dtype)
        b = torch.randn(matmul_n, matmul_n).to(dtype)
        out = torch.empty(matmul_n, matmul_n, dtype=dtype)
        try:
            flops[key] = _best_rate(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), 2.0 * matmul_n**3, budget)
        except RuntimeError:  # dtype not supported by this CPU build
            flops[key] = None
    # STREAM triad a = b + s*c: reads two arrays, writes one.
    x = torch.rand(stream_elems)
    y = torch.rand(stream_elems)
    z = torch.empty(stream_elems)
    triad = 3.0 * stream_elems * x.element_size()
    bw_triad = _best_rate(lambda: torch.add(x, y, alpha=0.5, out=z), triad, budget)
    copy = 2.0 * stream_elems * x.element_size()
    bw_copy = _best_rate(lambda: z.copy_(x), copy, budget)
    return {
        "schema": SCHEMA,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "measured_at": time.time(),
        "flops": flops,
        "mem_bw": max(bw_triad, bw_copy),
        "mem_bw_detail": {"triad": bw_triad, "copy": bw_copy},
        "method": f"torch.mm {matmul_n}x{matmul_n}, STREAM triad/copy over {stream_elems} fp32 elements; best rep",
    }


def save(doc: dict, path: str | os.PathLike | None = None) -> str:
    p = path or cache_path()
    atomic_write_bytes(p, (json.dumps(doc, indent=1) + "\n").encode())
    return str(p)


def load(path: str | os.PathLike | None = None) -> dict | None:
    p = path or cache_path()
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            return None
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


def calibrate(seconds: float = 3.0, path: str | os.PathLike | None = None) -> tuple[dict, str]:
    doc = measure(seconds)
    return doc, save(doc, path)
