"""`diag demo`: train a small DDP job on CPU under the agent and print its verdict and report."""

from __future__ import annotations

import json
import sys

from diag.diagnosis_document import diagnosis_json
from diag.errors import DiagInputError

HELP = "run a small CPU training job under the agent and report on it"


def add_arguments(parser) -> None:
    from diag.demo import BOTTLENECKS, DEFAULT_STEPS, STRAGGLERS

    parser.add_argument("--bottleneck", choices=BOTTLENECKS, default="none",
                        help="the bottleneck to induce (default: none, a healthy compute-bound run)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU processes in the DDP job (default 2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
    parser.add_argument("--run-dir", default=None, help="run directory (default runs/demo-<timestamp>; never overwritten)")
    parser.add_argument("--no-export", action="store_true", help="do not serve Prometheus metrics during the run")
    parser.add_argument("--port-base", type=int, default=None, help="Prometheus port base (default 9870 + local rank)")
    parser.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                        help="after training and the report, keep the ranks' Prometheus endpoints serving "
                             "this long, so Prometheus can scrape the finished run (default 0; Ctrl-C ends it)")
    parser.add_argument("--threshold", action="append", metavar="NAME=VALUE", default=[],
                        help="a decision-tree threshold for the agent (repeatable), as diag.Agent(thresholds=...) "
                             "takes it: the live verdicts, the report and later analyses of the run all use it")
    parser.add_argument("--slow-down", type=float, default=0.0, metavar="FRACTION",
                        help="an induced regression, to try `diag compare --gate` on: each step's work is followed "
                             "by an idle wait of this fraction of it (0.2: steps about 20%% slower; default 0)")
    parser.add_argument("--straggler", choices=STRAGGLERS, default=None,
                        help="an induced straggler: one rank's batches arrive 50 ms late, rank 1 in every "
                             "step (persistent), each rank in turn (rotating), or the last rank for a sixth of "
                             "the run (transient)")
    parser.add_argument("--num-workers", type=int, default=0, metavar="K",
                        help="the data workload's DataLoader num_workers (default 0, the induced bottleneck): "
                             "apply the worker count its cause names and see the step it predicted")
    parser.add_argument("--json", action="store_true",
                        help="print the diagnosis document (diag.diagnosis/1, as in summary.json) instead of the summary")
    parser.add_argument("--verbose", action="store_true", help="show the agent's messages from every rank")


def run(args) -> int:
    from diag.analyzers.diagnosis import decision_tree
    from diag.demo import DemoSettings, run_demo

    try:
        thresholds = decision_tree.parse_overrides(args.threshold)
        decision_tree.load_tree(overrides=thresholds)  # unknown names fail here, not in every rank
    except decision_tree.TreeError as exc:
        raise DiagInputError(str(exc)) from None
    if args.ranks < 1 or args.ranks > 16:
        raise DiagInputError(f"--ranks must be between 1 and 16, got {args.ranks}")
    if args.steps < 8:
        raise DiagInputError(f"--steps must be at least 8 (the profiler skips the first steps), got {args.steps}")
    if not args.json:
        print(f"diag demo: {args.ranks} rank(s) of DDP on gloo, {args.steps} steps, bottleneck: {args.bottleneck}",
              file=sys.stderr, flush=True)
    if args.linger < 0:
        raise DiagInputError(f"--linger must be 0 or more seconds, got {args.linger:g}")
    if not 0 <= args.num_workers <= 64:
        raise DiagInputError(f"--num-workers must be between 0 and 64, got {args.num_workers}")
    if args.num_workers and args.bottleneck != "data":
        raise DiagInputError("--num-workers applies to --bottleneck data, whose DataLoader it sets")
    if not 0 <= args.slow_down <= 10:
        raise DiagInputError(f"--slow-down must be between 0 and 10, got {args.slow_down:g}")
    settings = DemoSettings(args.bottleneck, ranks=args.ranks, steps=args.steps, run_dir=args.run_dir,
                            export=not args.no_export, port_base=args.port_base, verbose=args.verbose,
                            linger_s=args.linger, thresholds=thresholds, slow_down=args.slow_down,
                            straggler=args.straggler, loader_workers=args.num_workers)
    run_demo(settings, on_ready=lambda result: _show(result, args))
    return 0


def _show(result: dict, args) -> None:
    """Print the outcome as soon as the report exists (before the endpoints linger)."""
    from diag.demo import headline

    diagnosis = result["diagnosis"]
    if args.json:
        json.dump(diagnosis_json(diagnosis) if diagnosis is not None else None, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        _say_linger(result, args)
        return
    print(f"Verdict: {headline(diagnosis)}")
    findings, causes = (diagnosis.findings, diagnosis.causes) if diagnosis is not None else ([], [])
    warnings = [f for f in findings if f.get("severity") in ("warning", "error")]
    for f in warnings[:5]:
        print(f"  {f.get('severity')}: {f.get('message')}")
    for c in causes:
        print(f"Cause: {c.get('text')}")
        print(f"  Change: {c.get('action')}")
        print(f"  Predicted: {c.get('gain')}")
    print(f"Run directory: {result['run_dir']}")
    if result["report"] is not None:
        print(f"Report: {result['report']}")
    else:
        print(f"Report: not written; run `diag report {result['run_dir']}`")
    print(f"({_command_seconds(result['elapsed_s']):.0f} s)", file=sys.stderr)
    sys.stdout.flush()
    _say_linger(result, args)


def _say_linger(result: dict, args) -> None:
    if result.get("endpoints"):
        print(f"Serving Prometheus metrics on {', '.join(result['endpoints'])} for {args.linger:g} s "
              "(Ctrl-C to stop)", file=sys.stderr, flush=True)


def _command_seconds(job_s: float) -> float:
    """How long the command has run, start-up (importing torch) included, as the user timed it;
    the job's own time where the process's start is unknown."""
    import time

    try:
        import psutil

        return max(job_s, time.time() - psutil.Process().create_time())
    except Exception:
        return job_s
