"""`diag nccl-log FILE... [--json]`: read NCCL_DEBUG=INFO logs, RCCL logs, PyTorch NCCL
watchdog errors, flight-recorder analyses and NCCL Inspector output, and say what is wrong.

All files are read as one job (one file per rank is the usual layout). A directory stands
for the files inside it. Files that cannot be parsed are reported on one line each and the
others are still parsed; the exit status is non-zero only when nothing could be parsed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diag.errors import DiagInputError

HELP = "parse NCCL_DEBUG=INFO logs and PyTorch NCCL errors into findings"


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="log files (plain or .gz), directories of them, or a diag run directory "
                             "(its rank-*/nccl/ logs); all are read as one job")
    parser.add_argument("--json", action="store_true", help="print the diag.nccl_log/2 document with its findings")
    parser.add_argument("--evidence", type=int, default=5, metavar="N",
                        help="evidence lines kept per finding and warning kind (default 5)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="processes for large plain-text logs (default: one per CPU; 1 disables)")
    parser.add_argument("--fail-on", choices=("critical", "warning", "info"), metavar="SEVERITY",
                        help="exit 1 when a finding of this severity or worse is found (critical, warning or "
                             "info), for scripts; by default the exit status says only whether the logs were read")


def _expand(paths: list[str]) -> list[Path]:
    from diag.rundir import RunDir, is_run_dir

    out: list[Path] = []
    for p in map(Path, paths):
        if is_run_dir(p):  # a diag run directory: the NCCL logs of every rank
            run = RunDir(p)
            out.extend(log for r in run.ranks() for log in run.nccl_logs(r))
        elif p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")))
        else:
            out.append(p)
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def render_text(doc: dict) -> str:
    """The human-readable summary of a judged document (facts and findings), printed by default."""
    L: list[str] = []
    srcs = doc["sources"]
    L.append(f"NCCL log: {srcs[0]}" + (f" (+{len(srcs) - 1} more files)" if len(srcs) > 1 else ""))
    ver = doc["nccl_version"] or "not in the log"
    backend = (doc["backend"] or "nccl").upper()
    L.append(f"  {backend} version: {ver}" + (f"  (also: {', '.join(doc['versions'][1:])})" if len(doc["versions"]) > 1 else ""))
    if doc.get("rccl"):
        L.append("  " + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in doc["rccl"].items()))
    hosts = doc["hosts"]
    if hosts:
        shown = ", ".join(hosts[:6]) + (f" and {len(hosts) - 6} more" if len(hosts) > 6 else "")
        L.append(f"  hosts: {len(hosts)} ({shown}); processes: {doc['processes']}; nodes: {doc['nodes']}")
    if doc["world_size"]:
        L.append(f"  world size: {doc['world_size']}; ranks seen at init: {len(doc['ranks'])}; "
                 f"communicators: {len(doc['communicators'])}")
    for r in doc["ranks"][:16]:
        L.append(f"    rank {r['rank']:>4}/{r['nranks']}  host {r['host'] or '?'}  cudaDev {r['cuda_dev']}"
                 f"  busId {r['bus_id'] or '?'}" + (f"  commId {r['comm_id']}" if r["comm_id"] else ""))
    if len(doc["ranks"]) > 16:
        L.append(f"    ... {len(doc['ranks']) - 16} more ranks (see --json)")
    t = doc["transports"]
    if t["network"] or t["by_kind"]:
        L.append("  network: " + (", ".join(t["network"]) or "not logged")
                 + (f"; NICs: {', '.join(t['nics'][:8])}" if t["nics"] else ""))
    if t["by_kind"]:
        L.append("  transports (connections): " + ", ".join(f"{k} {v}" for k, v in t["by_kind"].items())
                 + (f"; PXN {t['pxn']}" if t["pxn"] else ""))
    ch = doc["channels"]
    bits = []
    if ch["rings"]:
        bits.append(f"{len(ch['rings'])} ring orders logged (of {ch['rings'][0]['channels']} channels)")
    if ch["trees"]["lines"]:
        bits.append(f"trees on {ch['trees']['channels']} channels, roots {ch['trees']['roots'][:8]}")
    for k in ("coll", "nvls", "collnet", "p2p"):
        if f"{k}_channels" in ch:
            bits.append(f"{ch[k + '_channels']} {k} channels")
    if bits:
        L.append("  channels: " + "; ".join(bits))
    nv = doc["nvls"]
    if nv["available_devices"] or nv["unavailable_devices"] or nv["heads"]:
        L.append(f"  NVLS: available on {nv['available_devices']} devices, unavailable on "
                 f"{nv['unavailable_devices']}; {nv['heads']} NVLS head lines")
    if doc["collectives"]:
        L.append("  collectives (COLL lines):")
        for c in doc["collectives"][:10]:
            L.append(f"    {c['op']:<14} {c['calls']:>8} calls  {_fmt_bytes(c['bytes']):>10}  "
                     f"dtypes {', '.join(c['dtypes'])}  nranks {c['nranks']}")
    tune = doc["tuning"]
    if tune["choices"]:
        L.append("  tuning choices: " + "; ".join(
            f"{c['op'] or '?'} {c['algo']}/{c['proto']} x{c['calls']}" for c in tune["choices"][:6]))
    if tune["table"]:
        L.append(f"  tuning model table: {', '.join(tune['table'])}")
    L += _failure_lines(doc)
    L += _findings_lines(doc)
    return "\n".join(L)


def _failure_lines(doc: dict) -> list[str]:
    """Watchdog timeouts, the flight recorder, the NCCL Inspector, WARN lines and error chains."""
    L: list[str] = []
    for tmo in doc["timeouts"][:5]:
        L.append(f"  watchdog timeout: {tmo['op']} SeqNum {tmo['seq']} timeout {tmo['timeout_ms']} ms on ranks "
                 f"{tmo['ranks'][:16]}")
    fr = doc.get("flight_recorder")
    if fr:
        L.append(f"  flight recorder: {fr['entries']} entries, states {fr['states']}, last collectives {fr['pg_status']}")
        for a in fr["analysis"][:5]:
            L.append(f"    collective {a['collective_seq']} ({a.get('collective')}): missing ranks {a['missing_ranks']}, "
                     f"state {a.get('state')}")
    insp = doc.get("inspector")
    if insp:
        L.append(f"  NCCL Inspector: {insp['records']} records, {insp['n_ranks']} ranks")
        for c in insp["collectives"][:6]:
            avg = f"{c['avg_busbw_gbps']:.1f}" if c["avg_busbw_gbps"] is not None else "?"
            L.append(f"    {c['coll']:<14} {c['count']:>6} records  busbw avg {avg} GB/s, max {c['max_busbw_gbps']} GB/s")
    if doc["warnings"]:
        L.append(f"  WARN lines: {doc['warning_lines']} in {len(doc['warnings'])} kinds")
        for w in doc["warnings"][:8]:
            L.append(f"    {w['count']:>6} x {w['location'] or '-'}: {w['message'][:120]}")
    for c in doc["error_chains"][:3]:
        L.append(f"  error chain: {c['code_name']} ({c['code']}) " + " -> ".join(c["frames"][:8])
                 + (" ..." if len(c["frames"]) > 8 else ""))
        if c.get("started_by_message"):
            L.append(f"    after: {c['started_by_message'][:160]}")
    return L


def _findings_lines(doc: dict) -> list[str]:
    """The diagnosis's findings, with their advice and evidence lines."""
    L: list[str] = []
    L.append("")
    if not doc["findings"]:
        L.append("No problems found.")
    else:
        L.append(f"Findings ({len(doc['findings'])}):")
        for f in doc["findings"]:
            L.append(f"  [{f['severity']}] {f['id']}: {f['message']}")
            L.append(f"      advice: {f['advice']}")
            for e in f["evidence"]:
                L.append(f"      > {e[:200]}")
    return L


def run(args) -> int:
    from diag.analyzers.diagnosis.nccl_log import judged
    from diag.analyzers.nccl.log import parse_files

    files = _expand(args.files)
    if not files:
        raise DiagInputError("no files found", source=" ".join(args.files))
    doc = judged(parse_files(files, max_evidence=max(1, args.evidence), jobs=args.jobs))
    for e in doc["errors"]:
        print(f"diag: error: {e['error']}", file=sys.stderr)
    if not doc["sources"]:
        return 2
    if args.json:
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(render_text(doc))
    return 1 if args.fail_on and _worst_at_least(doc["findings"], args.fail_on) else 0


def _worst_at_least(findings: list[dict], severity: str) -> bool:
    from diag.analyzers.diagnosis.nccl_log import SEVERITY_ORDER, severity_rank

    limit = SEVERITY_ORDER[severity]
    return any(severity_rank(f) <= limit for f in findings)
