"""`diag prometheus-config`: Prometheus scrape configuration for a job's per-rank endpoints.

Each rank serves /metrics on port base + LOCAL_RANK, so a job's targets are every host
times every local rank. The identity labels (run, rank, host, ...) are on the series
themselves; `honor_labels: true` keeps them when a target label would clash.
"""

from __future__ import annotations

import json
import os
import re
import sys

import yaml

from diag.atomic_io import atomic_write_text
from diag.collectors.launch_env import expand_slurm_nodelist
from diag.errors import DiagInputError
from diag.exporter.runtime import DEFAULT_PORT_BASE

HELP = "write Prometheus scrape configuration for a job"

# A hostname, an IPv4 address, or an IPv6 address in brackets.
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)$")
_DURATION = re.compile(r"^\d+(ms|s|m|h)$")


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hosts", help="comma-separated host names or addresses, e.g. h1,h2")
    src.add_argument("--slurm-nodelist", metavar="SPEC",
                     help="a Slurm nodelist such as 'gpu[01-04]' (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks (GPUs) per host (default: $SLURM_NTASKS_PER_NODE, else 1)")
    p.add_argument("--port-base", type=int, default=None,
                   help=f"the agents' port base (default: $DIAG_EXPORTER_PORT, else {DEFAULT_PORT_BASE})")
    p.add_argument("--format", choices=("static", "file_sd"), default="static",
                   help="static: a scrape_configs YAML block; file_sd: a JSON target file for "
                        "file_sd_configs (the scrape block that reads it goes to stderr)")
    p.add_argument("--job-name", default="diag", help="Prometheus job name (default: diag)")
    p.add_argument("--scrape-interval", default="15s", help="scrape interval (default: 15s)")
    p.add_argument("--remote-write", metavar="URL", help="a whole prometheus.yml for Prometheus in agent mode "
                   "(prometheus --enable-feature=agent): scrape these ranks and remote-write the samples to URL "
                   "(Mimir, Thanos Receive, VictoriaMetrics, or a Prometheus with --web.enable-remote-write-receiver)")
    p.add_argument("--out", metavar="FILE", help="write to FILE (atomically) instead of stdout")


def hosts_from(args) -> list[str]:
    spec_source = None
    if args.hosts is not None:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        spec_source = "--hosts"
    else:
        spec = args.slurm_nodelist or os.environ.get("SLURM_JOB_NODELIST")
        if not spec:
            raise DiagInputError("give --hosts or --slurm-nodelist (or run inside a Slurm allocation)")
        spec_source = "--slurm-nodelist"
        try:
            hosts = expand_slurm_nodelist(spec)
        except ValueError as exc:
            raise DiagInputError(f"cannot expand Slurm nodelist {spec!r} ({exc})") from None
    if not hosts:
        raise DiagInputError(f"{spec_source}: no hosts given")
    bad = [h for h in hosts if not _HOST.match(h)]
    if bad:
        raise DiagInputError(f"{spec_source}: not a host name or address: {bad[0]!r}")
    seen, out = set(), []
    for h in hosts:
        if h not in seen:
            seen.add(h)
            out.append(h)
    return out


def targets(hosts: list[str], ranks_per_node: int, port_base: int) -> list[tuple[str, list[str]]]:
    return [(h, [f"{h}:{port_base + i}" for i in range(ranks_per_node)]) for h in hosts]


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "")
    m = re.match(r"^\s*(\d+)", raw)
    return int(m.group(1)) if m else None


def host_ports(args) -> tuple[list[str], int, int]:
    """(hosts, ranks per node, port base) of --hosts or --slurm-nodelist, --ranks-per-node and
    --port-base, with Slurm's and the agent's variables as defaults; rank r of a node serves on
    port base + r, as the agents do."""
    hosts = hosts_from(args)
    rpn = args.ranks_per_node if args.ranks_per_node is not None else (_int_env("SLURM_NTASKS_PER_NODE") or 1)
    base = args.port_base if args.port_base is not None else (_int_env("DIAG_EXPORTER_PORT") or DEFAULT_PORT_BASE)
    if rpn < 1:
        raise DiagInputError(f"--ranks-per-node must be at least 1, not {rpn}")
    if base < 1 or base + rpn - 1 > 65535:
        raise DiagInputError(f"ports {base}-{base + rpn - 1} are outside 1-65535")
    return hosts, rpn, base


def build(args) -> tuple[str, str | None]:
    """(text to write, scrape block hint for stderr or None)."""
    hosts, rpn, base = host_ports(args)
    if not _DURATION.match(args.scrape_interval):
        raise DiagInputError(f"--scrape-interval {args.scrape_interval!r} is not a duration such as 15s")
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_-]*$", args.job_name):
        raise DiagInputError(f"--job-name {args.job_name!r} is not a valid job name")
    remote = _remote_write(args.remote_write)
    groups = targets(hosts, rpn, base)
    job = {"job_name": args.job_name, "scrape_interval": args.scrape_interval, "honor_labels": True}
    n = sum(len(t) for _, t in groups)
    if args.format == "file_sd":
        doc = [{"targets": t, "labels": {"node": h}} for h, t in groups]
        text = json.dumps(doc, indent=1) + "\n"
        where = args.out or "diag_targets.json"
        hint = yaml.safe_dump({**_agent_global(args, remote),
                               "scrape_configs": [{**job, "file_sd_configs": [{"files": [where]}]}], **remote},
                              sort_keys=False)
        return text, f"# {n} targets; reference the file from prometheus.yml:\n{hint}"
    job["static_configs"] = [{"targets": t, "labels": {"node": h}} for h, t in groups]
    header = f"# diag: {len(hosts)} host(s) x {rpn} rank(s) = {n} targets, ports {base}-{base + rpn - 1}.\n"
    if remote:
        header += ("# Prometheus in agent mode: prometheus --enable-feature=agent --config.file=THIS_FILE\n"
                   "# It scrapes these ranks and remote-writes every sample; it keeps no queryable store.\n")
    else:
        header += "# Paste under prometheus.yml's scrape_configs, or use this file as prometheus.yml.\n"
    doc = {**_agent_global(args, remote), "scrape_configs": [job], **remote}
    return header + yaml.safe_dump(doc, sort_keys=False, width=120), None


def _remote_write(url: str | None) -> dict:
    if url is None:
        return {}
    if not re.match(r"^https?://[^\s/]+(/\S*)?$", url):
        raise DiagInputError(f"--remote-write {url!r} is not an http(s) URL")
    return {"remote_write": [{"url": url}]}


def _agent_global(args, remote: dict) -> dict:
    # An agent's samples meet other sources' in the central store: an external label says where they came from.
    return {"global": {"scrape_interval": args.scrape_interval, "external_labels": {"diag_job": args.job_name}}} \
        if remote else {}


def run(args) -> int:
    text, hint = build(args)
    if args.out:
        try:
            atomic_write_text(args.out, text)
        except OSError as exc:
            raise DiagInputError(f"cannot write ({exc.strerror or exc})", source=args.out) from None
    else:
        sys.stdout.write(text)
    if hint:
        print(hint, file=sys.stderr, end="")
    return 0
