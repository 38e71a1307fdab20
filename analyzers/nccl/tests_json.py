"""The JSON line of the nccl-tests --json fork (pull request 318) as result rows, even when it
is cut short.
"""

from __future__ import annotations

import json
import math
import re


def json_line(line: str) -> tuple[list[dict], bool, str | None] | None:
    """The rows of the JSON object printed by the nccl-tests --json fork, whether the line was
    whole, and the NCCL version it names; a truncated line is salvaged. None: not such a line."""
    try:
        obj = json.loads(line)
        entries = obj.get("benchmark", []) if isinstance(obj, dict) else []
        complete = True
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
        obj, entries, complete = {}, [], False
        for m in re.finditer(r'"(\d+)"\s*:\s*(\{[^{}]*\})', line):
            try:
                entries.append({m.group(1): json.loads(m.group(2))})
            except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
                complete = False
    if not entries and not line.lstrip().startswith('{"identifier"'):
        return None
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        entries = []
    rows = []
    for entry in entries:
        # A damaged entry (a size that is no number, a value that is no object) is no row.
        for size, v in (entry.items() if isinstance(entry, dict) else ()):
            n_bytes, count = _jint(size), _jint(v.get("count")) if isinstance(v, dict) else None
            if n_bytes is None or not isinstance(v, dict):
                continue

            def grp(p, v=v):
                err = v.get(p + "_error")
                return {"time_us": _jnum(v.get(p + "_time")), "algbw_gbps": _jnum(v.get(p + "_algbw")),
                        "busbw_gbps": _jnum(v.get(p + "_busbw")), "wrong": None, "error": _jnum(err)}
            root = v.get("root")
            rows.append({
                "size_bytes": n_bytes, "count": count, "dtype": v.get("type"),
                "redop": v.get("redop"), "root": int(str(root)) if str(root).lstrip("-").isdigit() else None,
                "out_of_place": grp("oop"), "in_place": grp("ip"),
            })
    version = obj.get("version") if isinstance(obj, dict) else None
    return rows, complete, str(version) if version else None


def _jint(v) -> int | None:
    """A whole, finite JSON number (or numeric string) as int, else None."""
    x = _jnum(v)
    return int(x) if x is not None and math.isfinite(x) and x.is_integer() else None


def _jnum(v):
    if v is None or v == "N/A":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
