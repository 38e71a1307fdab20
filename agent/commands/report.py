"""`diag report RUN_DIR [--out DIR]`: write report.html, report.md and summary.json."""

from __future__ import annotations

import sys

HELP = "write the HTML/Markdown/JSON bottleneck report for a run directory"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by diag.Agent or diag demo")
    parser.add_argument("--out", metavar="DIR", help="where to write the report (default: RUN_DIR)")
    parser.add_argument("--config", metavar="FILE", help="TOML/YAML file with a [thresholds] table")
    parser.add_argument("--threshold", action="append", metavar="NAME=VALUE",
                        help="override one decision-tree threshold (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def load_tree_from_args(args, run_dir=None):
    """The tree of --config and --threshold; for a run directory, on top of the settings it recorded."""
    from diag import rundir
    from diag.analyzers.analyze import tree_for_run
    from diag.analyzers.diagnosis import decision_tree
    from diag.errors import DiagInputError

    try:
        overrides = decision_tree.parse_overrides(args.threshold)
        if run_dir is not None and rundir.is_run_dir(run_dir):
            return tree_for_run(run_dir, args.config, overrides)
        return decision_tree.load_tree(args.config, overrides)
    except decision_tree.TreeError as exc:
        raise DiagInputError(str(exc)) from None


def run(args) -> int:
    from diag.analyzers.views.report_model import build_model
    from diag.report import write_model
    from diag.report.load import load_run
    from diag.report.progress import Stages, progress_factory

    tree = load_tree_from_args(args, args.run_dir)
    # A bar over the stages on a terminal (the run analysis of a big job takes a while); silent otherwise.
    stages = Stages(["analysing the run", "building the report", "writing the files"])
    try:
        stages.advance("analysing the run")
        doc, data = load_run(args.run_dir, tree=tree, progress=progress_factory())
        stages.advance("building the report")
        model = build_model(doc, data)
        stages.advance("writing the files")
        paths = write_model(model, args.out or args.run_dir)
    finally:
        stages.close()
    if not args.quiet:
        print(model["headline"]["text"])
        conf = model["confidence"]
        print(f"Confidence: {conf['level']} ({conf['score']:.2f}).")
        changes = [r for r in model["recommendations"] if not r.get("minor")]
        if changes:
            r = changes[0]
            print(f"Change first: {r['title']}. {r['gain']}.")
        for m in model["missing"][:5]:
            print(f"Missing: {m['what']}")
        print(f"Report: {paths['html']}")
        print(f"        {paths['markdown']}")
        print(f"        {paths['summary']}")
    if not model["run"]["ranks_present"]:
        print("diag: error: no rank data could be read from the run directory", file=sys.stderr)
        return 1
    return 0
