"""`diag top [RUN_DIR | --targets HOST:PORT,... | --hosts ... | --slurm-nodelist ...]`: a running
job, live, rank by rank."""

from __future__ import annotations

HELP = "a live view of a running job: every rank's step, data wait, verdict and device, refreshed every second"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                        help="the job's run directory, where the ranks share a file system")
    src = parser.add_argument_group("metrics endpoints (ranks that share no file system)")
    src.add_argument("--targets", metavar="HOST:PORT,...", help="the ranks' metrics endpoints")
    src.add_argument("--hosts", help="comma-separated hosts whose ranks serve on port base + local rank")
    src.add_argument("--slurm-nodelist", metavar="SPEC",
                     help="a Slurm nodelist such as 'gpu[01-04]' (default: $SLURM_JOB_NODELIST when no RUN_DIR, "
                          "--targets or --hosts is given)")
    src.add_argument("--ranks-per-node", type=int, default=None,
                     help="ranks per host (default: $SLURM_NTASKS_PER_NODE, else 1)")
    src.add_argument("--port-base", type=int, default=None,
                     help="the agents' port base (default: $DIAG_EXPORTER_PORT, else 9870)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes (default 1, at least 0.2)")
    parser.add_argument("--iterations", type=int, default=None, metavar="N",
                        help="stop after N refreshes (default: until q, Ctrl-C or the job's end)")
    parser.add_argument("--once", action="store_true", help="draw the screen once, as text, and exit")
    parser.add_argument("--width", type=int, default=None, help="columns for --once (default: the terminal's)")
    parser.add_argument("--config", metavar="FILE", help="TOML/YAML file with a [thresholds] table")
    parser.add_argument("--threshold", action="append", metavar="NAME=VALUE",
                        help="override one decision-tree threshold (repeatable)")


def _source(args):
    import os

    from diag.errors import DiagInputError
    from diag.rundir import is_run_dir
    from diag.top.sources import EndpointSource, RunDirSource

    if args.run_dir and (args.targets or args.hosts or args.slurm_nodelist):
        raise DiagInputError("give a RUN_DIR or endpoints (--targets, --hosts, --slurm-nodelist), not both")
    if args.run_dir:
        # A live view may start before the job: an empty folder is watched until its ranks appear.
        if not os.path.isdir(args.run_dir) or (args.once and not is_run_dir(args.run_dir)):
            raise DiagInputError(f"{args.run_dir}: not a diag run directory (no manifest.json or rank-* folder)")
        return RunDirSource(args.run_dir)
    if args.targets:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        bad = [t for t in targets if not _is_target(t)]
        if bad or not targets:
            raise DiagInputError(f"--targets: not HOST:PORT: {bad[0] if bad else args.targets!r}")
        return EndpointSource(targets)
    if args.hosts or args.slurm_nodelist or os.environ.get("SLURM_JOB_NODELIST"):
        from diag.commands.prometheus_config import host_ports

        hosts, rpn, base = host_ports(args)
        return EndpointSource([f"{h}:{base + i}" for h in hosts for i in range(rpn)])
    raise DiagInputError("give a RUN_DIR, --targets, --hosts or --slurm-nodelist")


def _is_target(t: str) -> bool:
    host, _, port = t.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and all(c not in host for c in "/?#@ ")


def run(args) -> int:
    import sys

    from rich.console import Console

    from diag.commands.report import load_tree_from_args
    from diag.errors import DiagInputError, raw_stream
    from diag.top.app import run_lines, run_screen, snapshot
    from diag.top.screen import ViewState, render_text, screen

    if args.interval < 0.2:
        raise DiagInputError(f"--interval {args.interval:g}: at least 0.2 seconds")
    if args.iterations is not None and args.iterations < 1:
        raise DiagInputError("--iterations must be at least 1")
    source = _source(args)
    tree = load_tree_from_args(args, args.run_dir)
    out = raw_stream(sys.stdout)
    try:
        if args.once:
            ranks, job, now = snapshot(source, tree)
            width = args.width or Console(file=out).width
            sys.stdout.write(render_text(screen(source.describe(), ranks, job, ViewState(), now, args.interval,
                                                keys=False), width))
            return 0
        if not out.isatty():
            return run_lines(source, tree, sys.stdout, args.interval, args.iterations)
        return run_screen(source, tree, Console(file=out), args.interval, args.iterations)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
