"""`diag compare RUN_A RUN_B [--out DIR]`: did the change between two runs help?"""

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
                             "RUN_A is put beside RUN_B's measured step (default: inferred from the phase that fell most)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


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
    if not args.quiet:
        print(result["headline"])
        if result.get("prediction"):
            print(result["prediction"]["text"])
        print(f"Comparison: {paths['html']}")
        print(f"            {paths['markdown']}")
    return 0
