"""A decoded trace as numpy columns per event class (`Trace`); column_builder.py builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diag.analyzers import intervals as iv


@dataclass
class Trace:
    """Columns per event class of one rank's trace. Times in microseconds."""

    source: str
    meta: dict
    names: list[str]
    # Device activity (kernels, copies, sets, device-side syncs).
    dev_name: np.ndarray
    dev_kind: np.ndarray
    dev_ts: np.ndarray
    dev_dur: np.ndarray
    dev_stream: np.ndarray  # -1 when not an integer (HTA's rule)
    dev_corr: np.ndarray
    dev_bytes: np.ndarray  # NaN when unknown
    # Host runtime calls (cudaLaunchKernel, cudaStreamSynchronize, hipMemcpy...).
    rt_name: np.ndarray
    rt_ts: np.ndarray
    rt_dur: np.ndarray
    rt_corr: np.ndarray
    rt_stream: np.ndarray
    # CPU ops, annotations and python functions.
    cpu_name: np.ndarray
    cpu_kind: np.ndarray
    cpu_ts: np.ndarray
    cpu_dur: np.ndarray
    cpu_tid: np.ndarray
    cpu_flops: np.ndarray  # NaN when not recorded
    cpu_ext: np.ndarray
    # ProfilerStep windows (host side), sorted by start: (step number, ts, dur).
    steps: list[tuple[int, float, float]]
    dev_ext: np.ndarray  # External id: links a kernel to the CPU op that launched it
    gpu_step_ts: np.ndarray  # starts of ProfilerStep annotations on the device timeline
    # Sparse extras: per CPU row index, raw (Input Dims, Input type, Concrete Inputs) of ops
    # with a FLOPs arg or whose FLOPs diag derives from shapes (roofline.FLOP_OPS).
    shapes: dict[int, tuple[bytes, bytes | None, bytes | None]] = field(default_factory=dict)
    # Per CPU row index, raw (Input Dims, Input type) of the common elementwise, copy and
    # reduction ops (roofline.BANDWIDTH_OPS): the bytes their kernels move.
    bw_shapes: dict[int, tuple[bytes, bytes | None]] = field(default_factory=dict)
    # Collective parameters, per row of cpu (key ("cpu", i)) or device (("dev", i)).
    coll_args: dict[tuple[str, int], dict] = field(default_factory=dict)
    peak_allocated: dict[int, float] = field(default_factory=dict)  # device id -> bytes
    n_events: int = 0
    # Share of the profiler's host events present ("Ev Idx" numbers them consecutively);
    # far below 1 in traces that were sampled or filtered after recording.
    op_coverage: float | None = None
    # Fields of an unexpected type that were converted or ignored, events dropped, and a few
    # examples (diag.analyzers.trace.tolerant); None when the trace decoded as it is.
    repairs: dict | None = None

    def step_of(self, column: str, win: np.ndarray) -> np.ndarray:
        """Each event's row in the step windows `win` (-1 outside them all) for the column
        "cpu", "dev" or "rt": found once per column and windows, as each per-step fact asks
        for it. Read-only.

        Where `win` holds ProfilerSteps stretched over their device work (load.step_windows),
        host events belong to the step whose host span holds them, and device work to the
        step that launched it: a loop that runs ahead of the device launches step k+1 while
        step k's kernels still run."""
        cache = self.__dict__.setdefault("_derived", {})
        key = (column, win.shape, win.tobytes())
        if key not in cache:
            spans = self.host_spans(win)
            if column == "dev" and spans is not win:
                found = iv.window_of(self.dev_ts, win)
                launched, call = self.step_of("rt", win), self.launch_calls()
                hit = np.flatnonzero(call >= 0)
                hit = hit[launched[call[hit]] >= 0]
                found[hit] = launched[call[hit]]
            else:
                found = iv.window_of(getattr(self, f"{column}_ts"), spans)
            found = found.astype(np.int32)
            found.flags.writeable = False
            cache[key] = found
        return cache[key]

    def keep_steps(self, first: int, last: int) -> None:
        """Keep the ProfilerSteps numbered first..last (all of them where none is), before
        any fact is derived from them."""
        inside = [s for s in self.steps if first <= s[0] <= last]
        if inside and "_derived" not in self.__dict__:
            self.steps = inside

    def host_spans(self, win: np.ndarray) -> np.ndarray:
        """The host spans of the steps in `win`: the ProfilerStep spans where `win` stretches
        them over their device work (keep_host_spans), else `win` itself."""
        return self.__dict__.get("_derived", {}).get(("host_spans", win.shape, win.tobytes()), win)

    def host_span(self, lo: float, hi: float) -> tuple[float, float]:
        """The host span of the step window [lo, hi), as host_spans gives it for one window."""
        return self.__dict__.get("_derived", {}).get(("host_span", lo, hi), (lo, hi))

    def keep_host_spans(self, win: np.ndarray, spans: np.ndarray) -> None:
        if np.array_equal(win, spans):
            return
        cache = self.__dict__.setdefault("_derived", {})
        cache[("host_spans", win.shape, win.tobytes())] = spans
        for (lo, hi), (h_lo, h_hi) in zip(win.tolist(), spans.tolist()):
            cache[("host_span", lo, hi)] = (h_lo, h_hi)

    def launch_calls(self) -> np.ndarray:
        """Per device row, the runtime row that launched it (the first with its correlation id;
        -1: none, or no id), found once. Read-only."""
        cache = self.__dict__.setdefault("_derived", {})
        if "launch_calls" not in cache:
            found = np.full(len(self.dev_corr), -1, dtype=np.int64)
            by_corr = np.argsort(self.rt_corr, kind="stable")
            corr = self.rt_corr[by_corr]
            if len(corr):
                k = np.clip(np.searchsorted(corr, self.dev_corr), 0, len(corr) - 1)
                hit = (corr[k] == self.dev_corr) & (self.dev_corr > 0)
                found[hit] = by_corr[k[hit]]
            found.flags.writeable = False
            cache["launch_calls"] = found
        return cache["launch_calls"]

    def launcher_rows(self) -> np.ndarray:
        """Per device row, the CPU row whose External id it carries (the op that launched it;
        -1: none), found once. Read-only."""
        cache = self.__dict__.setdefault("_derived", {})
        if "launchers" not in cache:
            found = index_of(self.cpu_ext, self.dev_ext).astype(np.int32 if len(self.cpu_ext) < 2**31 else np.int64,
                                                                copy=False)
            found.flags.writeable = False
            cache["launchers"] = found
        return cache["launchers"]

    def name_of(self, ids) -> list[str]:
        return [self.names[i] for i in np.asarray(ids).tolist()]

    @property
    def has_device(self) -> bool:
        return len(self.dev_ts) > 0


def index_of(keys: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where each wanted id sits in `keys` (ids such as External ids; negative ones mean none),
    -1 where absent: through one table indexed by id where the ids are dense, else by binary
    search."""
    small = len(keys) < 2**31  # row numbers in 32 bits: a large trace's temporaries halve
    pos = np.flatnonzero(keys >= 0)
    if not len(pos) or not len(want):
        return np.full(len(want), -1, dtype=np.int64)
    if small:
        pos = pos.astype(np.int32)
    keys = keys[pos]
    top = int(keys.max())
    if top < 8 * len(keys) + (1 << 20):
        if top < 2**31:
            keys = keys.astype(np.int32)
        table = np.full(top + 1, -1, dtype=np.int32 if small else np.int64)
        table[keys] = pos
        del keys, pos  # a large trace's columns: the table is all that is needed now
        found = table[np.clip(want, 0, top)]
        found[(want < 0) | (want > top)] = -1
        return found
    ids, first = np.unique(keys, return_index=True)
    at = np.clip(np.searchsorted(ids, want), 0, len(ids) - 1)
    return np.where((ids[at] == want) & (want >= 0), pos[first[at]], -1)

