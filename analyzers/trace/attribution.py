"""Per-step attribution: every microsecond of a step goes to exactly one class.

The classes are the decision tree's: data, host, comm, memory, compute, plus "wait"
(waiting in collectives for the last peer), which only the job analysis can tell apart
from transfer once it has matched collectives across ranks (diag.analyzers.job.waits);
a single trace gives it 0 and says so. Overlaps are
resolved by priority with `diag.analyzers.intervals.exclusive_by_priority` (the one
interval module); whatever no layer covers is "host". So the parts always add up to the
step's wall time.

Device traces (GPU/HIP): the device timeline decides.
    compute > memory > comm > data > host
- compute first: while a GEMM/convolution/attention kernel runs, the device does the
  work the step exists for; anything running beside it is hidden behind it.
- memory next: bandwidth-bound kernels, memcpy and memset are device work too; when they
  run alone they are what the step waits for.
- comm after both: communication overlapped by any kernel is hidden; only *exposed*
  communication (comm minus compute/memory) costs step time, which is what the tree asks.
- data after the device: the DataLoader wait is a host-side annotation; while the device
  is still draining earlier work, the wait costs nothing. Only the wait while the device
  is idle is data time (the TensorBoard profiler plugin's rule: kernels before DataLoader).
- host: the device is idle and the host is not waiting for data: launching, syncing,
  Python.

CPU-only traces (gloo, no device events): the host timeline is the execution timeline.
    data > compute > memory > comm > host
- data first: everything inside a DataLoader `__next__` (including collate ops) is data
  loading, because the host itself runs it.
- compute: matmul/convolution/attention ops; memory: elementwise/reduction/norm/copy ops.
  Both at any nesting level: an op's children (bias copies, scalar wrapping, allocation)
  are part of its cost, and a matmul nested in a memory op still wins by priority.
  Where FLOPs and shapes are recorded and the CPU is calibrated, an op is compute or
  memory by its arithmetic intensity against the CPU's roofline knee instead.
- comm after compute and memory: gloo runs collectives on its own threads
  (`gloo:*` spans); where they overlap compute on the training threads they are hidden.
- Ops shorter than HOST_OVERHEAD_US are dispatcher overhead rather than work (a CPU
  op's fixed cost is a few microseconds), so they stay host time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diag.analyzers import intervals as iv
from diag.analyzers.model import BOUNDS, CLASSES

GPU_ORDER = ("compute", "memory", "comm", "data")
CPU_ORDER = ("data", "compute", "memory", "comm")
HOST_OVERHEAD_US = 5.0


def attribute(layers: dict[str, np.ndarray], order: Sequence[str], windows: np.ndarray) -> dict:
    """Exclusive time per class and window.

    layers: class -> normalized interval set; windows: (n, 2) step windows.
    Returns {"us": {class: array(n)}, "shares": list of dicts (fractions summing to 1),
    "parts": {class: the exclusive interval set}}.
    """
    windows = np.asarray(windows, dtype=np.float64).reshape(-1, 2)
    span = iv.normalize(windows)
    parts = iv.exclusive_by_priority([(name, layers.get(name, iv.EMPTY)) for name in order], span, "host")
    us = {name: iv.measure_in_windows(parts.get(name, iv.EMPTY), windows) for name in BOUNDS}
    shares = []
    length = windows[:, 1] - windows[:, 0]
    for k in range(len(windows)):
        shares.append(normalize_shares({name: us[name][k] for name in BOUNDS}, length[k]))
    return {"us": us, "shares": shares, "parts": parts}


_QUANTUM = 2**32


def normalize_shares(seconds: dict, total: float) -> dict:
    """Fractions of total that sum to exactly 1.0 in any order of addition.

    Shares are rounded to multiples of 2**-32 whose integer counts sum to 2**32 (the
    largest absorbs the rounding); sums of such dyadic numbers are exact in float64.
    """
    if total <= 0:
        return {name: 1.0 if name == "host" else 0.0 for name in CLASSES}
    counts = {name: int(round(max(0.0, float(seconds.get(name, 0.0)) / total) * _QUANTUM)) for name in CLASSES}
    top = max(CLASSES, key=lambda n: counts[n])
    counts[top] = max(0, _QUANTUM - sum(v for n, v in counts.items() if n != top))
    return {name: counts[name] / _QUANTUM for name in CLASSES}
