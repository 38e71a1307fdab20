"""`diag dashboards [--out DIR]`: write the Grafana dashboards, Grafana's provisioning files
and the Prometheus alert rules that come with diag, from the installed package.

The files are the repository's `dashboards/` folder (installed as `diag.dashboards`): four
dashboards (training, GPU, communication, the exporter itself), `alerts.yml` for
Prometheus's rule_files, and Grafana's file provisioning for the dashboards folder and
a Prometheus data source. Existing files are left alone unless `--force`.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from diag.atomic_io import atomic_write_bytes
from diag.errors import DiagInputError

HELP = "write the Grafana dashboards, provisioning files and Prometheus alert rules"
# The files written, relative to the package (and the output folder).
FILES = ("diag-training.json", "diag-gpu.json", "diag-communication.json", "diag-exporter.json", "alerts.yml",
         "METRICS.md", "provisioning/dashboards/diag.yml", "provisioning/datasources/diag-prometheus.yml")


def add_arguments(p) -> None:
    p.add_argument("--out", default="diag-dashboards", help="folder to write them to (default ./diag-dashboards)")
    p.add_argument("--force", action="store_true", help="replace files that exist already")


def bundled(name: str) -> bytes:
    """One of FILES, as installed."""
    return resources.files("diag.dashboards").joinpath(name).read_bytes()


def run(args) -> int:
    out = Path(args.out)
    existing = [n for n in FILES if (out / n).exists()]
    if existing and not args.force:
        raise DiagInputError(f"{len(existing)} of the files exist already (first: {existing[0]}); pass --force "
                             "to replace them", source=str(out))
    for name in FILES:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, bundled(name))
    print(f"wrote {len(FILES)} files to {out}:", file=sys.stderr)
    print(f"  Grafana: import {out}/diag-*.json (Dashboards > New > Import), or copy {out}/provisioning/*/ to "
          "/etc/grafana/provisioning/ and the dashboards to the folder its dashboards/diag.yml names",
          file=sys.stderr)
    print(f"  Prometheus: add {out}/alerts.yml to rule_files; `diag prometheus-config` writes the scrape block",
          file=sys.stderr)
    return 0
