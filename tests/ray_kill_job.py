"""Run by test_ray.py in its own process: Ray workers that die while analysing a trace.

argv: DIR_OF_TRACES MARKER_DIR. The trace of rank 0 kills its worker on the first attempt
only (Ray retries it); the trace of rank 1 kills its worker on every attempt. Prints the
analysis document (schema diag.analysis/1) as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from diag.analyzers.analyze import analyze_paths, json_safe
from diag.ray_pool import RayPool

MARKERS = Path(sys.argv[2])


def dying(path, *args):
    from diag.analyzers.analyze import _analyze_one

    name = Path(path).name
    first = not (MARKERS / name).exists()
    (MARKERS / name).touch()
    if "rank1" in name or ("rank0" in name and first):
        os._exit(1)  # the worker process dies, as when the OOM killer takes it
    return _analyze_one(path, *args)


class DyingPool(RayPool):
    def analyze(self, files, fn, args, memory_of, progress=None):
        return super().analyze(files, dying, args, memory_of, progress)


if __name__ == "__main__":
    with DyingPool(num_cpus=2) as pool:
        doc = analyze_paths([sys.argv[1]], pool=pool)
    print(json.dumps(json_safe(doc)))
