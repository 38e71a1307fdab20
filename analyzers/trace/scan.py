"""The compiled fast path of the trace decoder: one pass over a chunk's bytes into columns
(`_kineto_scan.c`), with no Python object per event.

It reads what the tagged msgspec union of `schema` reads (or, where the union refuses a chunk,
what `Event` reads), with the same types and defaults, and declines anything it does not
fully understand; the chunk then takes the Python path, which reports or repairs it. So the columns are the same either way, and the
Python path stays the reference: the tests compare the two on real traces and fuzzed input.

The extension is optional: where it was not built (no compiler at install time), or with
DIAG_TRACE_DECODER=python in the environment, every chunk takes the Python path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from diag.analyzers.trace.schema import (
    _C_ANN,
    _C_GPU_ANN,
    _C_INSTANT,
    _C_KERNEL,
    _C_MEMCPY,
    _C_MEMSET,
    _C_OP,
    _C_PY,
    _C_RUNTIME,
    _C_SYNC,
    _CAT_CODE,
    _SKIP_CATS,
    _CpuArgs,
    _DevArgs,
)

if TYPE_CHECKING:
    from diag.analyzers.trace.column_builder import ColumnBuilder

try:
    from diag.analyzers.trace import _kineto_scan  # type: ignore[attr-defined]
except ImportError:  # not built here: the Python path decodes every chunk
    _kineto_scan = None


def compiled() -> bool:
    """Whether chunks are decoded by the compiled scanner."""
    return _kineto_scan is not None and os.environ.get("DIAG_TRACE_DECODER", "") != "python"


# The scanner's groups (its G_* constants), by category code: which struct the union gives.
_SKIP, _DEV, _RT, _CPU, _GPU_ANN, _INSTANT = range(6)
_GROUP_OF: dict[int, int] = {
    0: _SKIP, _C_KERNEL: _DEV, _C_MEMCPY: _DEV, _C_MEMSET: _DEV, _C_SYNC: _DEV, _C_RUNTIME: _RT,
    _C_OP: _CPU, _C_ANN: _CPU, _C_PY: _CPU, _C_GPU_ANN: _GPU_ANN, _C_INSTANT: _INSTANT,
}
_GROUP_OF_CODE = bytes(_GROUP_OF[code] for code in range(max(_GROUP_OF) + 1))
_CATS = {**{cat.encode(): code for cat, code in _CAT_CODE.items()}, **{cat.encode(): 0 for cat in _SKIP_CATS}}
_DTYPES = {
    "code": np.int8, "name": np.int32, "ts": np.float64, "dur": np.float64, "tid": np.int64, "stream": np.int64,
    "corr": np.int64, "ext": np.int64, "ext_old": np.int64, "flops": np.float64, "bytes": np.float64,
    "ev_idx": np.int64, "dims_at": np.int32, "dims_len": np.int32, "type_at": np.int32, "type_len": np.int32,
    "conc_at": np.int32, "conc_len": np.int32, "args_at": np.int32, "args_len": np.int32, "coll": np.int8,
    "total_alloc": np.float64, "dev_type": np.int64, "dev_id": np.int64,
}
_ABSENT = np.iinfo(np.int64).min  # the scanner's "absent or null" of an optional integer
_DEV_ARGS: Callable[[bytes], Any] = msgspec.json.Decoder(_DevArgs).decode
_CPU_ARGS: Callable[[bytes], Any] = msgspec.json.Decoder(_CpuArgs).decode


def take(b: ColumnBuilder, data) -> bool:
    """Decode `data` (a JSON array of events) into b's columns on the compiled path; False where
    the path is off or declines the chunk (the caller then takes the Python path).

    The Python decoder tries the tagged union first, and on a chunk the union refuses, `Event`
    (after three such chunks in a row, `Event` alone). The scanner reads either way, and is
    stricter than both: where it takes a chunk as `Event` but not as the union, the union
    refused it (a missing or unknown category), so the Python path would have read it as
    `Event` too.
    """
    scanner = _kineto_scan
    if scanner is None or not compiled():
        return False
    dec = b.decode
    out = scanner.scan(data, _CATS, _GROUP_OF_CODE, False) if dec.misses < 3 else 0
    if isinstance(out, tuple):  # read as the union reads it (or found whole, with text after it)
        dec.misses = 0
    else:
        tagged_refused = dec.misses < 3
        out = scanner.scan(data, _CATS, _GROUP_OF_CODE, True)
        if not isinstance(out, tuple):  # the offset where the scanner declined
            return False
        if tagged_refused:
            dec.misses += 1
    if out[0] == "trailing":
        # What msgspec raises for it; the loader's search for the array's end expects this.
        raise msgspec.DecodeError(f"JSON is malformed: trailing characters (byte {out[1]})")
    n, names, raw = out
    dec.seen += n
    b.n += n
    if n:
        _Chunk(b, data, names, {k: np.frombuffer(v, dtype=_DTYPES[k]) for k, v in raw.items()}).add()
    return True


class _Chunk:
    """One scanned chunk's columns, appended group by group in the order `ColumnBuilder.add`
    takes them (so names are numbered, and odd events noted, in the same order)."""

    def __init__(self, b: ColumnBuilder, data, names: list[str], cols: dict[str, np.ndarray]):
        self.b, self.data, self.names, self.c = b, data, names, cols

    def add(self) -> None:
        from diag.analyzers.trace.column_builder import CpuRows

        b, c = self.b, self.c
        code = c["code"]
        rows = self._timed(np.flatnonzero((code >= _C_KERNEL) & (code <= _C_SYNC)))
        if len(rows):
            b.put_device(self._ids(rows), code[rows], c["ts"][rows], c["dur"][rows], c["stream"][rows],
                         c["corr"][rows], c["bytes"][rows], self._ext(rows), np.flatnonzero(c["coll"][rows]).tolist(),
                         lambda js: self._args(_DEV_ARGS, _DevArgs, rows[js]))
        rows = self._timed(np.flatnonzero(code == _C_RUNTIME))
        if len(rows):
            b.put_runtime(self._ids(rows), c["ts"][rows], c["dur"][rows], c["corr"][rows], c["stream"][rows])
        rows = self._timed(np.flatnonzero((code >= _C_OP) & (code <= _C_PY)))
        if len(rows):
            b.put_cpu(CpuRows(self._ids(rows), code[rows], c["ts"][rows], c["dur"][rows], c["tid"][rows],
                              c["flops"][rows], self._ext(rows), c["ev_idx"][rows],
                              np.flatnonzero(c["coll"][rows]).tolist(),
                              lambda js: self._args(_CPU_ARGS, _CpuArgs, rows[js]), lambda js: self._shapes(rows[js])))
        self._gpu_steps(np.flatnonzero(code == _C_GPU_ANN))
        self._peaks(np.flatnonzero(code == _C_INSTANT))

    def _timed(self, rows: np.ndarray) -> np.ndarray:
        from diag.analyzers.trace.column_builder import timed_rows

        if not len(rows):
            return rows
        name = self.c["name"]
        keep = timed_rows(self.c["dur"][rows], self.c["ts"][rows], lambda i: self.names[name[rows[i]]],
                          self.b.decode.log)
        return rows if keep is None else rows[keep]

    def _ids(self, rows: np.ndarray) -> np.ndarray:
        """The builder's name ids of the rows, new names numbered in order of first appearance."""
        local = self.c["name"][rows]
        table = self.b.names
        known = np.array([table.get(name, -1) for name in self.names], dtype=np.int32)
        ids = known[local]
        if not len(ids) or ids.min() >= 0:  # after the first chunks, every name is known
            return ids
        seen, first = np.unique(local, return_index=True)
        remap = np.zeros(len(self.names), dtype=np.int32)
        for k in seen[np.argsort(first, kind="stable")].tolist():
            remap[k] = table.setdefault(self.names[k], len(table))
        return remap[local]

    def _ext(self, rows: np.ndarray) -> np.ndarray:
        """External id (current schema), else "external id" (2021 schema), else -1."""
        ext = self.c["ext"][rows]
        return np.where(ext < 0, self.c["ext_old"][rows], ext)

    def _spans(self, key: str, rows: np.ndarray) -> list[bytes | None]:
        """The raw text of a recorded value in each row (None where the event has none)."""
        data = self.data
        return [data[a:a + n] if n else None
                for a, n in zip(self.c[f"{key}_at"][rows].tolist(), self.c[f"{key}_len"][rows].tolist())]

    def _args(self, decode, default_type, rows: np.ndarray) -> list:
        return [default_type() if raw is None else decode(raw) for raw in self._spans("args", rows)]

    def _shapes(self, rows: np.ndarray) -> list[tuple[bytes, bytes | None] | None]:
        return [None if dims is None else (bytes(dims), None if kind is None else bytes(kind))
                for dims, kind in zip(self._spans("dims", rows), self._spans("type", rows))]

    def _gpu_steps(self, rows: np.ndarray) -> None:
        from diag.analyzers.trace.column_builder import is_gpu_step

        c = self.c
        for r in rows.tolist():
            ts = float(c["ts"][r])
            if is_gpu_step(float(c["dur"][r]), ts, self.names[c["name"][r]]):
                self.b.gpu_steps.append(ts)

    def _peaks(self, rows: np.ndarray) -> None:
        from diag.analyzers.trace.column_builder import note_peak

        c = self.c
        for r in rows.tolist():
            total, kind, device = float(c["total_alloc"][r]), int(c["dev_type"][r]), int(c["dev_id"][r])
            note_peak(self.b.peak, float(c["dur"][r]), None if np.isnan(total) else total,
                      None if kind == _ABSENT else kind, None if device == _ABSENT else device)
