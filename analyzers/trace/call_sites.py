"""Where in the job's own Python code ops are called, from a trace recorded with stacks.

A window recorded with `with_stack=True` holds a `python_function` span for each Python
frame, named `path(line): function`; the path is shortened by the profiler to the part after
its sys.path entry (`torch/nn/modules/module.py`, `train.py`), and the line is where the
function starts (for a frame already running when the window began, the line it was on then). An op's call site is the innermost frame around it, on its thread,
that is neither the interpreter's (`<built-in ...>`), the standard library's nor torch's.
Per traced step; pure.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from diag.analyzers.trace.columns import Trace

OP_KIND, PY_KIND = 0, 2  # cpu event kinds: cpu_op, user_annotation, python_function
FRAME_RE = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<function>.+)$")
NOT_THE_JOBS = frozenset(sys.stdlib_module_names) | {"torch", "torchvision", "torchaudio", "triton", "functorch"}
MAX_DEPTH = 64  # frames walked out from an op before giving up (recursion, unclosed spans)
TOP_SITES = 3


def is_jobs(name: str) -> bool:
    m = FRAME_RE.match(name)
    if m is None:
        return False
    top = re.split(r"[/\\]", m["file"].lstrip("./\\"), maxsplit=1)[0]
    return top.removesuffix(".py") not in NOT_THE_JOBS


def call_sites(trace: Trace, win: np.ndarray, op_names) -> list[dict]:
    """The job's frames that call the named ops, most calls first: {"name", "file", "line",
    "function", "calls_per_step"}; empty without stacks."""
    n = len(win)
    if not n or not np.any(trace.cpu_kind == PY_KIND):
        return []
    ids = [i for i, name in enumerate(trace.names) if name in op_names]
    ops = np.flatnonzero((trace.step_of("cpu", win) >= 0) & (trace.cpu_kind == OP_KIND)
                         & np.isin(trace.cpu_name, ids))
    if not len(ops):
        return []
    py = np.flatnonzero(trace.cpu_kind == PY_KIND)
    jobs = {nid for nid in np.unique(trace.cpu_name[py]).tolist() if is_jobs(trace.names[nid])}
    frames = py[np.isin(trace.cpu_name[py], list(jobs))]
    counts: dict[int, int] = {}
    for tid in np.unique(trace.cpu_tid[ops]).tolist():
        mine = frames[trace.cpu_tid[frames] == tid]
        mine = mine[np.argsort(trace.cpu_ts[mine], kind="stable")]
        starts, ends = trace.cpu_ts[mine], trace.cpu_ts[mine] + trace.cpu_dur[mine]
        for r in ops[trace.cpu_tid[ops] == tid].tolist():
            t0, t1 = trace.cpu_ts[r], trace.cpu_ts[r] + trace.cpu_dur[r]
            last = int(np.searchsorted(starts, t0, side="right")) - 1
            for j in range(last, max(last - MAX_DEPTH, -1), -1):
                if ends[j] >= t1:
                    nid = int(trace.cpu_name[mine[j]])
                    counts[nid] = counts.get(nid, 0) + 1
                    break
    out = []
    for nid, c in sorted(counts.items(), key=lambda kv: -kv[1])[:TOP_SITES]:
        m = FRAME_RE.match(trace.names[nid])
        if m is None:  # every frame was selected by this pattern
            continue
        out.append({"name": trace.names[nid], "file": m["file"], "line": int(m["line"]), "function": m["function"],
                    "calls_per_step": round(c / n, 2)})
    return out
