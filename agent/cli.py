"""The `diag` console script: a thin dispatcher over `diag.commands.*`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from diag import __version__
from diag.errors import DiagInputError, DiagRunError, VisibleStream

# (subcommand, module under diag.commands, one-line help). Help text lives here so that
# `diag --help` does not import every command module (and with them torch and pandas).
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "demo", "run a small CPU training job under the agent and report on it"),
    ("analyze", "analyze", "classify every step of torch.profiler traces or a run directory"),
    ("report", "report", "write the HTML/Markdown/JSON bottleneck report for a run directory"),
    ("compare", "compare", "compare two runs: step time, phase shares, verdicts, throughput"),
    ("top", "top", "a live view of a running job, rank by rank, from its run directory or endpoints"),
    ("run", "run", "run a launcher command with NCCL logging routed into a run directory"),
    ("nccl", "nccl", "measure collective bus bandwidth like nccl-tests, or parse its output"),
    ("nccl-log", "nccl_log", "parse NCCL_DEBUG=INFO logs and PyTorch NCCL errors into findings"),
    ("calibrate", "calibrate", "measure this host's CPU peak FLOP/s and memory bandwidth"),
    ("export", "export", "serve a run directory's metrics to Prometheus"),
    ("prometheus-config", "prometheus_config", "write Prometheus scrape configuration for a job"),
    ("dashboards", "dashboards", "write the Grafana dashboards, provisioning files and Prometheus alert rules"),
    ("config", "config", "show the agent's effective configuration and where each value comes from"),
    ("plan", "plan", "plan memory and parallelism: per-GPU memory, fit, communication and step time"),
]


def _available() -> list[tuple[str, str, str]]:
    here = os.path.join(os.path.dirname(__file__), "commands")
    return [c for c in COMMANDS if os.path.exists(os.path.join(here, c[1] + ".py"))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diag",
        description="Why is my training slow, and what do I change?",
    )
    parser.add_argument("--version", action="version", version=f"diag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in _available():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse only the command name first; the module adds its own arguments.
    first, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    if not getattr(first, "command", None):
        parser.print_help()
        return 0 if not argv else 2
    mod = importlib.import_module(f"diag.commands.{first._module}")
    cmd_parser = argparse.ArgumentParser(prog=f"diag {first.command}", description=mod.HELP)
    rest = argv[1:]
    if hasattr(mod, "add_arguments_for"):  # a command whose first word picks its usage (diag nccl parse)
        rest = mod.add_arguments_for(cmd_parser, rest)
    else:
        mod.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(rest)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = VisibleStream(out), VisibleStream(err)
    try:
        return int(mod.run(args) or 0)
    except DiagInputError as exc:
        print(f"diag: error: {exc}", file=sys.stderr)
        return 2
    except DiagRunError as exc:
        print(f"diag: error: {exc}", file=sys.stderr)
        return 1
    except RecursionError:  # a reader that follows nesting; each bounds its own, this is the last guard
        print("diag: error: the input is nested too deeply to read", file=sys.stderr)
        return 2
    except MemoryError:
        print("diag: error: out of memory reading the input", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diag: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file that can not be read or written: a directory in its place, a full disk
        name = exc.filename2 or exc.filename  # a rename names its target second
        where = f" {name}:" if name else ""
        print(f"diag: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout, sys.stderr = out, err


if __name__ == "__main__":
    sys.exit(main())
