"""`diag nccl`'s output: the topology the run is judged against, each test's bandwidth judged
(diag.analyzers.diagnosis.bandwidth), the lines printed under the nccl-tests table, CSV and
JSON files, and the exit status."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from diag.errors import DiagInputError


def topology_from_args(args, tests: list[dict] | None = None) -> dict:
    from diag.analyzers.nccl import expected as ne

    parts = []
    if args.topo:
        try:
            parts.append(ne.topology_from_nvidia_smi(Path(args.topo).read_text(errors="replace")))
        except (OSError, ValueError) as exc:
            raise DiagInputError(str(exc), source=args.topo) from None
    if args.nccl_log:
        from diag.analyzers.nccl import log as nccl_log

        parts.append(ne.topology_from_nccl_log(nccl_log.parse_files(args.nccl_log)))
    try:
        parts.append(ne.topology_from_flags(args.intra, args.inter, args.nics_per_node, args.gpus_per_node,
                                            args.nodes))
    except ValueError as exc:
        raise DiagInputError(str(exc)) from None
    return ne.merge_topology(*parts)


def interpret_doc(doc: dict, topo: dict) -> None:
    """Add expected_busbw_gbps, pct_of_expected, flags and diagnosis to every test: the
    diagnosis layer's judgement of each test's bandwidth facts."""
    from diag.analyzers.diagnosis import bandwidth
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.nccl import expected as ne

    tree = load_tree()
    doc["topology"] = topo
    for test in doc.get("tests") or []:
        if test.get("skipped"):
            continue
        view = test
        if not (test.get("hosts") or test.get("devices")) and doc.get("hosts"):
            view = {**test, "hosts": doc["hosts"]}
        result = bandwidth.judge(ne.bandwidth_facts(view, topo), tree)
        test["interpretation"] = result
        for key in ("expected_busbw_gbps", "pct_of_expected", "diagnosis", "flags"):
            test[key] = result[key]
        test["large_message_busbw_gbps"] = result["measured_busbw_gbps"]


def interpretation_lines(doc: dict) -> list[str]:
    lines = []
    for test in doc.get("tests") or []:
        name = test.get("collective") or "?"
        if test.get("skipped"):
            lines.append(f"# {name}: skipped: {'; '.join(test.get('errors') or [])}")
            continue
        it = test.get("interpretation") or {}
        measured = it.get("measured_busbw_gbps")
        head = f"# {name}: status {test.get('status')}"
        if measured is not None:
            head += f", large-message busbw {measured:.2f} GB/s"
        if it.get("expected_busbw_gbps") is not None:
            head += f", expected {it['expected_busbw_gbps']:.1f} GB/s ({it['expected_basis']})"
        lines.append(head)
        if it.get("diagnosis"):
            marks = {"below_50": "  [BELOW 50%]", "below_80": "  [below 80%]"}
            flag = next((marks[f] for f in it.get("flags") or [] if f in marks), "")
            lines.append(f"#   {it['diagnosis']}{flag}")
        for err in test.get("errors") or []:
            lines.append(f"#   error: {err}")
        for note in test.get("skipped_cases") or []:
            lines.append(f"#   {note}")
    return lines


_CSV_FIELDS = [
    "collective", "world_size", "backend", "status", "size_bytes", "count", "dtype", "redop", "root",
    "oop_time_us", "oop_algbw_gbps", "oop_busbw_gbps", "oop_wrong",
    "ip_time_us", "ip_algbw_gbps", "ip_busbw_gbps", "ip_wrong", "expected_busbw_gbps", "source",
]


def csv_text(doc: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for test in doc.get("tests") or []:
        for row in test.get("rows") or []:
            rec = {k: test.get(k) for k in ("collective", "world_size", "backend", "status",
                                           "expected_busbw_gbps", "source")}
            rec.update({k: row.get(k) for k in ("size_bytes", "count", "dtype", "redop", "root")})
            for prefix, key in (("oop", "out_of_place"), ("ip", "in_place")):
                g = row.get(key) or {}
                rec.update({f"{prefix}_time_us": g.get("time_us"), f"{prefix}_algbw_gbps": g.get("algbw_gbps"),
                            f"{prefix}_busbw_gbps": g.get("busbw_gbps"), f"{prefix}_wrong": g.get("wrong")})
            w.writerow(rec)
    return buf.getvalue()


def write_outputs(doc: dict, args) -> None:
    from diag.atomic_io import atomic_write_json, atomic_write_text
    from diag.rundir import NCCL_BENCH

    if args.json and args.json != "-":
        atomic_write_json(args.json, doc)
    elif args.json == "-":
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    if args.csv:
        atomic_write_text(args.csv, csv_text(doc))
    if args.run_dir:
        atomic_write_json(Path(args.run_dir) / NCCL_BENCH, doc)


def exit_code(doc: dict) -> int:
    tests = doc.get("tests") or []
    if doc.get("status") in ("failed", "partial") and not tests:
        return 1
    bad = [t for t in tests if t.get("status") != "ok" and not t.get("skipped")]
    return 1 if bad or (doc.get("status") not in (None, "ok")) else 0


