"""`diag analyze PATH...`: classify every step of torch.profiler traces or run directories."""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING

import msgspec

from diag.analyzers.diagnosis.decision_tree import metric_text
from diag.analyzers.numbers import percent
from diag.errors import DiagInputError

if TYPE_CHECKING:
    from diag.analyzers.analysis_types import Analysis

HELP = "classify every step of torch.profiler traces or a run directory"

_BAR = {"data": "data", "host": "host", "comm": "comm", "wait": "wait", "memory": "mem", "compute": "comp"}


def add_arguments(parser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="Kineto trace files (.json, .json.gz), directories of per-rank traces, or run directories")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema diag.analysis/1)")
    parser.add_argument("--config", metavar="FILE", help="TOML/YAML file with a [thresholds] table")
    parser.add_argument("--threshold", action="append", metavar="NAME=VALUE", default=[],
                        help="override one decision-tree threshold (repeatable), e.g. data_wait=0.3")
    parser.add_argument("--calibration", metavar="FILE",
                        help="this host's CPU peaks for CPU traces, as `diag calibrate` writes them (its cache: "
                             "~/.cache/diag/cpu_peaks.json); run directories use the copy their agent recorded")
    parser.add_argument("--jobs", type=int, metavar="N", help="parallel analysis processes (default: by free memory)")
    parser.add_argument("--report", metavar="DIR", help="also write the HTML/Markdown report into DIR")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="analyse the traces as Ray tasks: on the cluster at ADDRESS (or $RAY_ADDRESS), else on "
                             "a local Ray instance (needs pip install 'diag[ray]')")


def run(args) -> int:
    from diag.analyzers.analyze import analyze_paths, json_safe
    from diag.commands.report import load_tree_from_args

    # One run directory is judged by the settings it recorded; --config and --threshold go on top.
    tree = load_tree_from_args(args, args.paths[0] if len(args.paths) == 1 else None)
    if args.jobs is not None and args.jobs < 1:
        raise DiagInputError("--jobs must be at least 1")
    host_peaks = None
    if args.calibration:
        from diag import calibrate

        host_peaks = calibrate.load(args.calibration)
        if host_peaks is None:
            raise DiagInputError(f"not a {calibrate.SCHEMA} file (write one with `diag calibrate`)",
                                 source=args.calibration)
    if args.ray is not None:
        from diag.ray_pool import RayPool

        with RayPool(args.ray or None, num_cpus=args.jobs) as pool:
            doc = analyze_paths(args.paths, tree=tree, progress=_progress(len(args.paths)), pool=pool,
                                host_peaks=host_peaks)
    else:
        doc = analyze_paths(args.paths, tree=tree, jobs=args.jobs, progress=_progress(len(args.paths)),
                            host_peaks=host_peaks)
    for e in doc.errors:
        print(f"diag: error: {e['source']}: {e['error']}" if e.get("source") else f"diag: error: {e['error']}",
              file=sys.stderr)
    for w in doc.warnings or []:
        print(f"diag: warning: {w['source']}: {w['warning']}" if w.get("source") else f"diag: warning: {w['warning']}",
              file=sys.stderr)
    if not doc.ranks:
        if not doc.errors:
            print("diag: error: nothing to analyse", file=sys.stderr)
        return 2
    written = json_safe(doc)
    if args.report:
        _write_report(doc, args.report)
    del doc  # a large trace's document: only its JSON form is printed
    sys.stdout.write(json_text(written) if args.json else format_summary(written))
    return 0


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def json_text(doc: dict) -> str:
    """The JSON-safe document as `--json` prints it: indented, ASCII only (other characters
    escaped, as the standard library's encoder escapes them), encoded by msgspec, about seven
    times faster than the standard library on a large trace's document. A value msgspec
    refuses (a lone surrogate from a damaged trace, an integer beyond 64 bits) falls back to
    the standard library."""
    try:
        text = msgspec.json.format(msgspec.json.encode(doc), indent=1).decode()
    except (msgspec.EncodeError, UnicodeError, OverflowError, TypeError):
        return json.dumps(doc, indent=1) + "\n"
    return (text if text.isascii() else _NON_ASCII.sub(_escaped, text)) + "\n"


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # outside the basic plane: a surrogate pair, as JSON writes it
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def _write_report(doc: Analysis, out_dir: str) -> None:
    """Write the report and say where it went (on stderr: stdout may be the JSON)."""
    from diag.report import write_report_from_analysis

    paths = write_report_from_analysis(doc, out_dir)
    print(f"Report: {paths['html']}", file=sys.stderr)
    if paths.get("markdown"):
        print(f"        {paths['markdown']}", file=sys.stderr)


def _progress(n_paths: int):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = {}

    def update(done, total, source):
        if total < 2:
            return
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, unit="trace", file=sys.stderr, leave=False)
        bar["bar"].update(done - bar["bar"].n)
        if done >= total:
            bar["bar"].close()

    return update


def _pct(x) -> str:
    return "  n/a" if x is None else percent(x, 1).rjust(6)


def _fmt_value(node: dict) -> str:
    return metric_text(str(node.get("metric")), node.get("value"))


def _fmt_threshold(node: dict) -> str:
    return metric_text(str(node.get("metric")), node.get("threshold"), threshold=True)


def format_summary(doc: dict) -> str:
    """The readable terminal summary of an analysis document, as its JSON holds it."""
    out = []
    for r in doc["ranks"]:
        dev = r.get("device_info") or {"name": r.get("device")}
        steps = r.get("steps") or []
        head = f"rank {r['rank']}"
        if r.get("world_size"):
            head += f"/{r['world_size']}"
        verdict = f"{r['bound'].upper()}-BOUND" if r.get("bound") else "NO VERDICT"
        out.append(f"{head}  {verdict}  ({dev.get('name') or dev.get('type', '?')}, "
                   f"{len(steps)} step{'s' if len(steps) != 1 else ''}, {r.get('source')})")
        if r.get("summary"):
            out.append(f"  {r['summary']}")
        for node in r.get("path") or []:
            out.append(f"  - {node['question']}  {node['answer']}  "
                       f"(measured {_fmt_value(node)}, threshold {node['op']} {_fmt_threshold(node)})")
        sh = r.get("shares") or {}
        out.append("  step time: " + "  ".join(f"{_BAR[b]} {_pct(sh.get(b))}" for b in _BAR))
        if steps:
            per = ", ".join(f"{s['step']}:{s['bound']}" for s in steps[:12])
            more = f" (+{len(steps) - 12} more)" if len(steps) > 12 else ""
            ms = [s["duration_ms"] for s in steps]
            out.append(f"  steps: {per}{more}; mean {sum(ms) / len(ms):.1f} ms")
        g = r.get("gpu_time") or {}
        if g.get("idle_pct") is not None:
            ov = g.get("comm_compute_overlap_pct")
            out.append(f"  GPU time (HTA definitions): idle {g['idle_pct']:.2f}%  compute {g['compute_pct']:.2f}%  "
                       f"non-compute {g['non_compute_pct']:.2f}%  comm/compute overlap "
                       f"{'n/a' if ov is None else f'{ov:.2f}%'}")
        if r.get("mfu") is not None:
            out.append(f"  MFU: {100 * r['mfu']:.1f}% of peak")
        for k in (r.get("top_kernels") or [])[:5]:
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            out.append(f"    {k['pct']:5.1f}%  {k['time_ms']:9.2f} ms  {k['class']:<7} {name}")
        for f in r.get("findings") or []:
            out.append(f"  [{f['severity']}] {f['message']}")
        fixes = r.get("fixes") or []
        if fixes:
            out.append("  fixes:")
            out.extend(f"    * {x}" for x in fixes[:3])
        out.append("")
    job = doc.get("job") or {}
    if job.get("bound"):
        line = f"job: {job['bound'].upper()}-BOUND over {len(doc['ranks'])} rank(s)"
        if job.get("method"):
            line += f" [{job['method']}]"
        out.append(line)
        headline = ((doc.get("diagnosis") or {}).get("headline") or {}).get("text")
        if headline:
            out.append(f"  {headline}")
        for s in job.get("stragglers") or []:
            said = s.get("message") or s.get("evidence_text")
            out.append(f"  straggler: {said}" if isinstance(said, str) else f"  straggler: rank {s.get('rank')}")
        # The job's findings as the diagnosis judged them (the ranks' own are listed above).
        for f in (doc.get("diagnosis") or {}).get("findings") or []:
            if not f.get("ranks"):
                out.append(f"  [{f.get('severity', 'info')}] {f.get('message')}")
    causes = (doc.get("diagnosis") or {}).get("causes") or []
    if causes:
        out.append("causes:")
        for c in causes:
            out += [f"  * {c.get('text')}", f"    change: {c.get('action')}", f"    predicted: {c.get('gain')}"]
    return "\n".join(out) + "\n"
