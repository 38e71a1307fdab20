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
from diag.atomic_io import atomic_write_bytes

SCHEMA = "diag.cpu_peaks/1"
MAX_FILE_BYTES = 1 << 20  # a calibration is a few hundred bytes; anything larger is not one
BUSY_PERCENT = 25.0  # other work on this share of the CPUs or more: the peaks come out low


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _best_rate(fn, work: float, budget_s: float) -> float:
    """Best work/second over calls of fn within budget_s: one warm-up call, then repetitions
    until the budget is spent (at least one, and the warm-up's own rate where that one call
    spent it all)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    best = work / first if first > 0 else 0.0
    start = time.perf_counter()
    for _ in range(200):
        if time.perf_counter() - start >= budget_s - first:
            break
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, work / dt)
    return best


def _matmul_size(mm, max_n: int, budget_s: float) -> int:
    """The largest power-of-two size up to max_n whose product fits an eighth of budget_s, from
    128 up: a dtype the CPU has no units for (bf16 on most x86) runs 50x slower than fp32, and
    a 1024 product alone would then take seconds."""
    n = min(128, max_n)
    while n * 2 <= max_n:
        t0 = time.perf_counter()
        mm(n)
        if (time.perf_counter() - t0) * 8 * 8 > budget_s:  # the next size costs 8x this one
            break
        n *= 2
    return n


def busy_percent(sample_s: float = 0.3) -> float | None:
    """How busy the machine's CPUs are before measuring (percent of all of them), None where
    psutil cannot tell: peaks measured beside other work come out low."""
    try:
        import psutil

        return float(psutil.cpu_percent(interval=sample_s))
    except Exception:
        return None


def measure(seconds: float = 3.0, matmul_n: int = 1024, stream_elems: int = 1 << 24, progress=None) -> dict:
    """Measure peaks with torch on the CPU within about `seconds`; returns the cache document.
    progress: optional callable(str), told each stage as it starts."""
    import torch

    say = progress or (lambda _msg: None)
    sample = min(0.3, seconds / 10)
    busy = busy_percent(sample)
    stage = max(0.05, (seconds - sample) / 4)  # fp32, bf16, triad, copy
    flops: dict[str, float | None] = {}
    sizes: dict[str, int] = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        say(f"{key} matrix multiply")

        def mm(n, dtype=dtype):
            a, b, out = (torch.ones(n, n, dtype=dtype) for _ in range(3))
            return lambda: torch.mm(a, b, out=out)

        try:
            n = _matmul_size(lambda k: mm(k)(), matmul_n, stage)
            sizes[key] = n
            flops[key] = _best_rate(mm(n), 2.0 * n**3, stage)
        except RuntimeError:  # dtype not supported by this CPU build
            flops[key] = None
    say("memory bandwidth")
    # STREAM triad a = b + s*c: reads two arrays, writes one.
    x = torch.rand(stream_elems)
    y = torch.rand(stream_elems)
    z = torch.empty(stream_elems)
    triad = 3.0 * stream_elems * x.element_size()
    bw_triad = _best_rate(lambda: torch.add(x, y, alpha=0.5, out=z), triad, stage)
    copy = 2.0 * stream_elems * x.element_size()
    bw_copy = _best_rate(lambda: z.copy_(x), copy, stage)
    return {
        "schema": SCHEMA,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "measured_at": time.time(),
        "flops": flops,
        "mem_bw": max(bw_triad, bw_copy),
        "mem_bw_detail": {"triad": bw_triad, "copy": bw_copy},
        "busy_cpu_percent": busy,
        "method": f"torch.mm of {', '.join(f'{k} {n}x{n}' for k, n in sizes.items())}, STREAM triad/copy over "
                  f"{stream_elems} fp32 elements; best rep",
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


def calibrate(seconds: float = 3.0, path: str | os.PathLike | None = None, progress=None) -> tuple[dict, str]:
    doc = measure(seconds, progress=progress)
    return doc, save(doc, path)
