"""The nccl-tests results table, character for character.

Users read bus-bandwidth tables in the layout of NVIDIA's nccl-tests and feed them to
their own scripts, so `diag nccl` prints exactly that layout: the generation with the
`redop`, `root` and `#wrong` columns (nccl-tests 2.13 and later, also rccl-tests),
framed by the `# Collective test starting/concluded` lines that newer versions print,
and closed by the `Out of bounds values` / `Avg bus bandwidth` footer. The printf
formats below are those of nccl-tests' src/common.cu; Python's %-formatting follows C's.

Every function takes the plain dicts of the `diag.nccl_bench/1` document, so a table
measured by diag and a table parsed from a saved nccl-tests output render the same way.
A table parsed from an older generation is printed in its own layout (`table_layout`):
without the `redop`/`root` columns it lacked, with the 6-wide type column of the oldest
versions, and with the `error` column (the largest difference, `%5.0le`) instead of `#wrong`.
"""

# The printf formats are kept verbatim from nccl-tests so that they can be compared line by line.
# ruff: noqa: UP031

from __future__ import annotations

import math
from typing import TypedDict

# Column headers: three lines after a lone "#". Each takes the parameter columns' format
# (size, count, type and the optional redop/root columns), then the two result blocks.
_GROUP_TAIL = "           out-of-place                       in-place          "
_GROUP_TAIL_OLD = " " + _GROUP_TAIL  # the generations with the `error` column had one more space
_NAMES_TAIL = "  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
_UNITS_TAIL = "  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
_ROW_RESULT = "  %7s  %6.2f  %6.2f  %5s"


class Layout(TypedDict):
    """How a generation of nccl-tests printed its rows."""
    columns: tuple[str, ...]  # parameter columns after size, count and type
    type_width: int
    error_column: str  # "#wrong" (a count) or "error" (older: a max delta)


# The layout of the current generation (nccl-tests 2.13+, rccl-tests, diag's own runs).
MODERN_LAYOUT: Layout = {"columns": ("redop", "root"), "type_width": 8, "error_column": "#wrong"}


def table_layout(test: dict | None) -> Layout:
    """The layout the rows of `test` were printed in: parameter columns beyond size, count and
    type, the type column's width, and "#wrong" (a count) or "error" (older: a max delta).

    Taken from the parser's `layout` key when present, else from the rows: a column whose
    cells are all missing did not exist in that generation."""
    test = test or {}
    rows = test.get("rows") or []
    seen = test.get("layout") or {}
    if seen.get("columns") is not None:
        cols = tuple(c for c in ("redop", "root") if c in seen["columns"])
    elif rows:
        cols = tuple(c for c in ("redop", "root") if any(r.get(c) is not None for r in rows))
    else:
        cols = MODERN_LAYOUT["columns"]
    groups = [g for r in rows for g in (r.get("out_of_place"), r.get("in_place")) if g]
    error_column = seen.get("error_column")
    if error_column not in ("#wrong", "error"):
        old = groups and all(g.get("wrong") is None for g in groups) and any("error" in g for g in groups)
        error_column = "error" if old else "#wrong"
    return {"columns": cols, "type_width": seen.get("type_width") or 8, "error_column": error_column}


def _params_format(layout: Layout) -> str:
    return "# %10s  %12s  %" + str(layout["type_width"]) + "s" + "  %6s" * len(layout["columns"])


def binary_name(collective: str) -> str:
    """nccl-tests' program name for a collective: all_reduce -> all_reduce_perf."""
    return f"{collective}_perf"


def format_time_us(us: float | None) -> str:
    """nccl-tests prints the time with fewer decimals as it grows, always 7 wide."""
    if us is None or not math.isfinite(us):
        return "%7s" % "N/A"
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def format_wrong(wrong) -> str:
    """#wrong as nccl-tests prints it: %5g of the count (or of the old relative error), N/A unchecked."""
    if wrong is None:
        return "N/A"
    if isinstance(wrong, str):
        return wrong
    return "%g" % wrong


def format_error(error) -> str:
    """The older `error` column: the largest difference from the expected values, `%5.0le`
    (C's %le is %e), N/A when the run did not check."""
    if error is None:
        return "N/A"
    if isinstance(error, str):
        return error
    return "%5.0e" % error


BACKEND_LINE = "# diag nccl: backend %s"


def header_lines(params: dict | None = None, devices: list[dict] | None = None,
                 collective: str | None = None, backend: str | None = None) -> list[str]:
    """The block printed before the table: test name, sweep parameters, devices.

    params keys: nthread, ngpus, min_bytes, max_bytes, step_factor | step_bytes,
    warmup_iters, iters, agg_iters, check, graph. devices: rank, group, pid, host,
    device, bus_id (int), name. `backend` (diag's own runs: gloo, nccl, rccl) adds the
    comment line `# diag nccl: backend <name>`, which tells diag's output apart from
    nccl-tests' for a reader of the saved text; nccl-tests readers skip it as a comment.
    """
    lines: list[str] = []
    if collective:
        lines.append(f"# Collective test starting: {binary_name(collective)}")
    if backend:
        lines.append(BACKEND_LINE % backend)
    if params:
        factor = params.get("step_factor") or 0
        if factor > 1:
            step, kind = factor, "factor"
        else:
            step, kind = params.get("step_bytes") or 0, "bytes"
        lines.append(
            "# nThread %d nGpus %d minBytes %d maxBytes %d step: %d(%s) warmup iters: %d iters: %d "
            "agg iters: %d validation: %d graph: %d"
            % (params.get("nthread", 1), params.get("ngpus", 1), params["min_bytes"], params["max_bytes"],
               step, kind, params.get("warmup_iters", 0), params.get("iters", 0),
               params.get("agg_iters", 1), params.get("check", 0), params.get("graph", 0))
        )
        lines.append("#")
    if devices:
        lines.append("# Using devices")
        for d in devices:
            lines.append(
                "#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s"
                % (d.get("rank", 0), d.get("group", 0), d.get("pid", 0), d.get("host", "?"),
                   d.get("device", -1), d.get("bus_id", 0) or 0, d.get("name", ""))
            )
    return lines


def column_header_lines(time_label: str = "time", layout: Layout | None = None) -> list[str]:
    lay = layout or MODERN_LAYOUT
    params = _params_format(lay)
    blank = ("",) * (3 + len(lay["columns"]))
    err = lay["error_column"]
    return [
        "#",
        (params % blank) + (_GROUP_TAIL_OLD if err == "error" else _GROUP_TAIL),
        (params + _NAMES_TAIL) % ("size", "count", "type", *lay["columns"],
                                  time_label, "algbw", "busbw", err, time_label, "algbw", "busbw", err),
        (params + _UNITS_TAIL) % ("(B)", "(elements)", *blank[2:],
                                  "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ]


def _result(res: dict | None, error_column: str = "#wrong") -> str:
    if not res:
        return "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
    algbw = res.get("algbw_gbps")
    busbw = res.get("busbw_gbps")
    wrong = res.get("wrong")
    if error_column == "error" or (wrong is None and res.get("error") is not None):
        cell = format_error(res.get("error"))  # old layouts: the largest difference, not a count
    else:
        cell = format_wrong(wrong)
    if algbw is None or busbw is None:
        return "  %7s  %6s  %6s  %5s" % (format_time_us(res.get("time_us")), "N/A", "N/A", cell)
    return _ROW_RESULT % (format_time_us(res.get("time_us")), algbw, busbw, cell)


def format_row(row: dict, layout: Layout | None = None) -> str:
    """One table line for a row of the document, in `layout` (default: the current one)."""
    lay = layout or MODERN_LAYOUT
    cells = [row.get("size_bytes") or 0, row.get("count") or 0, row.get("dtype") or "float"]
    for col in lay["columns"]:
        if col == "redop":
            cells.append(row.get("redop") or "none")
        else:
            root = row.get("root")
            cells.append("%6d" % (root if root is not None else -1))
    text = ("%12d  %12d  %" + str(lay["type_width"]) + "s" + "  %6s" * len(lay["columns"])) % tuple(cells)
    err = lay["error_column"]
    return text + _result(row.get("out_of_place"), err) + _result(row.get("in_place"), err)


def footer_lines(errors: int, avg_busbw: float | None, collective: str | None = None) -> list[str]:
    """`errors` counts the row checks that found wrong elements (nccl-tests' errors[0])."""
    lines = [
        "# Out of bounds values : %d %s" % (errors, "FAILED" if errors else "OK"),
        "# Avg bus bandwidth    : %g " % (avg_busbw if avg_busbw is not None else 0.0),
        "#",
    ]
    if collective:
        lines.append(f"# Collective test concluded: {binary_name(collective)}")
    return lines


def count_wrong_checks(test: dict) -> int:
    """How many (row, placement) checks found wrong elements."""
    n = 0
    for row in test.get("rows") or []:
        for key in ("out_of_place", "in_place"):
            wrong = (row.get(key) or {}).get("wrong")
            if isinstance(wrong, int | float) and not isinstance(wrong, bool) and wrong >= 1:
                n += 1
    return n


def avg_busbw(rows: list[dict]) -> float | None:
    """nccl-tests' footer: the mean busbw over every measured (row, placement)."""
    values = [
        (row.get(key) or {}).get("busbw_gbps")
        for row in rows
        for key in ("out_of_place", "in_place")
    ]
    values = [v for v in values if isinstance(v, int | float)]
    return sum(values) / len(values) if values else None


def render_test(test: dict, params: dict | None = None, devices: list[dict] | None = None,
                framed: bool = True) -> str:
    """The whole nccl-tests output of one test: header block, table, footer."""
    collective = test.get("collective") if framed else None
    lines = header_lines(params, devices, collective)
    layout = table_layout(test)
    lines += column_header_lines(layout=layout)
    lines += [format_row(r, layout) for r in test.get("rows") or []]
    avg = test.get("avg_busbw_gbps")
    if avg is not None:
        oob = test.get("out_of_bounds")
        errors = oob if isinstance(oob, int) and not isinstance(oob, bool) else count_wrong_checks(test)
        lines += footer_lines(errors, avg, collective)
    # Without an average the run never reached its footer (cut short or failed): print none.
    return "\n".join(lines) + "\n"
