"""`diag compare RUN_A RUN_B [--out DIR] [--gate]`: did the change between two runs help, and,
for CI, did the second get worse?"""

from __future__ import annotations

HELP = "compare two runs: step time, phase shares, verdicts, throughput, scaling"


def add_arguments(parser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="the run before the change (run directory or "
                                                      "diag analyze --json file)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run after the change")
    parser.add_argument("--out", metavar="DIR", help="where to write compare.html/.md/.json (default: RUN_B)")
    parser.add_argument("--config", metavar="FILE", help="TOML/YAML file with a [thresholds] table")
    parser.add_argument("--threshold", action="append", metavar="NAME=VALUE",
                        help="override one decision-tree threshold (repeatable)")
    parser.add_argument("--applied", metavar="CHANGE",
                        help="the what-if change applied between the runs (e.g. no_data_wait): its prediction on "
                             "RUN_A (a ceiling: the part removed entirely) is put beside RUN_B's measured step; without it, "
                             "only a change both runs recorded is graded (their DataLoader's num_workers)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    gate = parser.add_argument_group("regression gate (CI)")
    gate.add_argument("--gate", action="store_true",
                      help="exit 0 when no tracked figure (step time, throughput, MFU, each phase) of RUN_B got worse "
                           "than RUN_A's beyond the runs' own noise, 1 when one did, 2 when the runs cannot be "
                           "compared (world size, device, model or batch differ)")
    gate.add_argument("--max-slowdown", metavar="PCT", type=_fraction,
                      help="how much worse a figure may get, as 3%% or 0.03 (default: gate_max_slowdown, 3%%)")
    gate.add_argument("--junit", metavar="FILE", help="also write the gate as JUnit XML, one test case per figure")
    gate.add_argument("--summary", metavar="FILE",
                      help="also write the gate's Markdown table here (it is appended to $GITHUB_STEP_SUMMARY "
                           "when that is set)")


def _fraction(text: str) -> float:
    import argparse

    s = text.strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage (3%) or a fraction (0.03)") from None
    if not 0 <= value < 1 or (not s.endswith("%") and value >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give a slowdown between 0% and 100%, as 3% or 0.03")
    return value


def run(args) -> int:
    import sys
    from pathlib import Path

    from diag.analyzers.views.compare_model import compare
    from diag.commands.report import load_tree_from_args
    from diag.report import analyse_and_model
    from diag.report.compare import write_compare
    from diag.report.progress import progress_factory

    # Each run is judged by the settings it recorded, with --config and --threshold on top;
    # the comparison by the second run's.
    tree_a, tree = load_tree_from_args(args, args.run_a), load_tree_from_args(args, args.run_b)
    known = [c["id"] for c in tree.what_if]
    if args.applied is not None and args.applied not in known:
        print(f"diag compare: error: unknown change {args.applied!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    bar = progress_factory()
    doc_a, model_a = analyse_and_model(args.run_a, tree=tree_a, progress=bar)
    doc_b, model_b = analyse_and_model(args.run_b, tree=tree, progress=bar)
    result = compare(model_a, model_b, doc_a, doc_b, tree=tree, applied=args.applied)
    out = args.out or (args.run_b if Path(args.run_b).is_dir() else str(Path(args.run_b).parent))
    paths = write_compare(result, out)
    if not args.quiet and not args.gate:
        print(result["headline"])
        if result.get("prediction"):
            print(result["prediction"]["text"])
        print(f"Comparison: {paths['html']}")
        print(f"            {paths['markdown']}")
    if not args.gate:
        return 0
    return _gate(args, doc_a, model_a, doc_b, model_b, tree, out)


def _gate(args, doc_a, model_a, doc_b, model_b, tree, out) -> int:
    """Judge, print one line, write the CI outputs (and gate.json beside the comparison), and
    return the gate's exit status."""
    import os

    from diag import atomic_io
    from diag.analyzers.diagnosis.gate import gate
    from diag.report.gate import junit, markdown

    result = gate(doc_a, model_a["diagnosis"], doc_b, model_b["diagnosis"], tree, max_slowdown=args.max_slowdown)
    print(result["summary"])
    atomic_io.atomic_write_json(os.path.join(out, "gate.json"), result)
    table = markdown(result, args.run_a, args.run_b)
    if args.summary:
        atomic_io.atomic_write_text(args.summary, table)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:  # the runner's own file
            f.write(table + "\n")
    if args.junit:
        atomic_io.atomic_write_bytes(args.junit, junit(result))
    return result["exit_status"]
