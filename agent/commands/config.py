"""`diag config --show`: the agent's effective configuration, and where each value comes from.

It resolves the configuration exactly as `diag.Agent` does on this machine, from this
environment and the config file (`--config FILE`, else $DIAG_CONFIG), so what it prints is
what an agent started here would use, short of the keyword arguments in the training code.
"""

from __future__ import annotations

import json
import sys

from diag.errors import DiagInputError

CONFIG_SCHEMA = "diag.config/1"

HELP = "show the agent's effective configuration and where each value comes from"


def add_arguments(parser) -> None:
    parser.add_argument("--show", action="store_true", help="print the configuration (the default action)")
    parser.add_argument("--config", metavar="FILE", help="config file with [agent.<section>] tables "
                        "(default $DIAG_CONFIG)")
    parser.add_argument("--json", action="store_true", help="print it as JSON")


def run(args) -> int:
    from diag.analyzers.diagnosis.decision_tree import TreeError, load_tree
    from diag.config import AgentConfig

    cfg = AgentConfig.resolve(config_file=args.config)
    try:
        thresholds = load_tree(cfg.config_file).thresholds
    except TreeError as exc:
        raise DiagInputError(str(exc)) from None
    rows = cfg.rows()
    if args.json:
        json.dump({"schema": CONFIG_SCHEMA, "config_file": cfg.config_file, "settings": rows,
                   "thresholds": thresholds}, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return 0
    print(f"config file: {cfg.config_file or 'none (pass --config FILE or set DIAG_CONFIG)'}")
    width = max(len(f"{r['section']}.{r['name']}") for r in rows)
    section = None
    for r in rows:
        if r["section"] != section:
            section = r["section"]
            print(f"\n[agent.{section}]")
        key = f"{r['section']}.{r['name']}"
        print(f"  {key:<{width}}  {_show(r['value']):<14} {r['source']:<28} {r['doc']}")
        env = f"environment {r['env']}" if r["env"] else "no environment variable"
        print(f"  {'':<{width}}  argument {r['argument']}=..., {env}")
    print("\n[thresholds] (decision tree; `diag analyze --threshold NAME=VALUE` overrides)")
    for name, value in thresholds.items():
        print(f"  {name:<{width}}  {_number(value)}")
    return 0


def _number(value: float) -> str:
    """A threshold as the TOML holds it: whole numbers in full (16777216, not 1.67772e+07)."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}"


def _show(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
