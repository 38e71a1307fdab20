"""`diag nccl`: measure collective bus bandwidth like nccl-tests, run nccl-tests, or read its output.

Three modes:

  diag nccl [sweep options]              measure with torch.distributed (every rank runs this)
  diag nccl --binary PATH [-- ARGS]      run a real nccl-tests binary and parse what it prints
  diag nccl parse FILE... [--json]       parse saved nccl-tests / rccl-tests output

Measuring: inside a launch (torchrun, srun, mpirun: detected from the environment) every
process is one rank and uses one GPU, with the nccl backend on CUDA (RCCL on ROCm) and
gloo on CPU. Outside a launch, `--nproc-per-node N` (with `--nnodes`, `--node-rank`,
`--rdzv-endpoint` across nodes) starts the ranks through torch.distributed's elastic
launcher. Rank 0 prints the table in nccl-tests' layout, then how the large-message
busbw compares with what the topology should reach.

Bus bandwidth: algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n
for all_gather, reduce_scatter and alltoall, x 1 for broadcast, reduce and sendrecv.
(A widely copied example that says busbw = 2 x algbw on 8 ranks is wrong: the all_reduce
factor on 8 ranks is 2 x 7/8 = 1.75.) Times are per call, combined across ranks with
nccl-tests' `-a` rule: the mean by default (nccl-tests' default since 2.11), or rank 0,
the minimum or the maximum.

torch 2.13's gloo backend supports all seven collectives on CPU, but not every data type
(no uint32/uint64 reductions, for example): such a test is reported as skipped with the
backend's message, and the run goes on.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from diag.errors import DiagInputError

HELP = "measure collective bus bandwidth like nccl-tests, or parse its output"
EPILOG = """\
examples:
  diag nccl --nproc-per-node 4 -b 8 -e 1M -f 2                       gloo on CPU, 4 ranks
  torchrun --nproc-per-node 8 -m diag nccl -b 8 -e 8G -f 2 --collective all
  diag nccl --binary ./build/all_reduce_perf --mpirun "mpirun -np 16 -N 8" -- -b 8 -e 8G -f 2 -g 1
  diag nccl parse all_reduce.log --json

bus bandwidth: busbw = algbw x 2(n-1)/n for all_reduce (1.75 on 8 ranks; the often-quoted
"2 x algbw on 8 ranks" is wrong), x (n-1)/n for all_gather, reduce_scatter and alltoall,
x 1 for broadcast, reduce and sendrecv.
"""

RUN_DIR_FILE = "nccl_bench.json"


# ---------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("args", nargs="*", metavar="ARG",
                        help="`parse FILE...` to read saved outputs; with --binary, arguments after `--` "
                             "go to the binary")
    sweep = parser.add_argument_group("sweep (nccl-tests flags)")
    sweep.add_argument("-b", "--minbytes", default="32M", help="smallest message size (8, 1K, 128M, 1G)")
    sweep.add_argument("-e", "--maxbytes", default="32M", help="largest message size")
    sweep.add_argument("-f", "--stepfactor", type=int, default=1, help="multiply the size by this factor")
    sweep.add_argument("-i", "--stepbytes", default="1M", help="or add this many bytes (when -f is 1)")
    sweep.add_argument("-d", "--datatype", default="float",
                       help="int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16, "
                            "a comma list, or all")
    sweep.add_argument("-o", "--op", default="sum", help="sum, prod, max, min, avg, a comma list, or all")
    sweep.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce")
    sweep.add_argument("-w", "--warmup_iters", "--warmup-iters", dest="warmup_iters", type=int, default=5)
    sweep.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size")
    sweep.add_argument("-c", "--check", type=int, default=1, help="check results this many times (0: off)")
    sweep.add_argument("-a", "--average", type=int, choices=(0, 1, 2, 3), default=1,
                       help="combine per-rank times: 0 rank 0, 1 mean (default), 2 min, 3 max")
    sweep.add_argument("--collective", default="all_reduce",
                       help="all_reduce, all_gather, reduce_scatter, broadcast, reduce, alltoall, sendrecv, "
                            "a comma list, or all")
    sweep.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with CUDA/ROCm, else gloo")
    sweep.add_argument("--timeout", type=float, default=300.0,
                       help="seconds a collective may wait for its peers (also: silence allowed from --binary)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="FILE",
                     help="write the diag.nccl_bench/1 document to FILE (no FILE or '-': standard output)")
    out.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    out.add_argument("--run-dir", metavar="DIR", help=f"also write DIR/{RUN_DIR_FILE}")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    launch = parser.add_argument_group("self-launching (outside torchrun/srun/mpirun)")
    launch.add_argument("--nproc-per-node", type=int, help="ranks to start on this node")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint (needed across nodes)")
    launch.add_argument("--rdzv-backend", default="c10d")
    launch.add_argument("--rdzv-id", default="diag-nccl")

    binary = parser.add_argument_group("real nccl-tests")
    binary.add_argument("--binary", metavar="PATH", help="run this nccl-tests binary and parse its output")
    binary.add_argument("--mpirun", metavar="CMD", help='launcher prefix, e.g. "mpirun -np 16 -N 8"')

    topo = parser.add_argument_group("expected bandwidth (topology)")
    topo.add_argument("--topo", metavar="FILE", help="saved `nvidia-smi topo -m` output")
    topo.add_argument("--nccl-log", metavar="FILE", action="append", default=[],
                      help="NCCL_DEBUG=INFO log of the same job (transports actually used)")
    topo.add_argument("--intra", help="GPU link: nvlink1..nvlink5, pcie3..pcie6")
    topo.add_argument("--inter", help="NICs: ib_edr, ib_hdr, ib_ndr, ib_xdr, roce_100/200/400, eth_10..eth_400")
    topo.add_argument("--nics-per-node", type=int)
    topo.add_argument("--gpus-per-node", type=int)
    topo.add_argument("--nodes", type=int)


def run(args) -> int:
    if args.args and args.args[0] == "parse":
        return _parse_mode(args, args.args[1:])
    if args.binary:
        return _binary_mode(args)
    if args.args:
        raise DiagInputError(f"unexpected arguments {' '.join(args.args)!r}: use `diag nccl parse FILE...`, "
                             "or pass binary arguments after `--` with --binary")
    return _bench_mode(args)


# ---------------------------------------------------------------- interpretation and output


def _topology(args, tests: list[dict] | None = None) -> dict:
    from diag.analyzers.nccl import expected as ne

    parts = []
    if args.topo:
        try:
            parts.append(ne.topology_from_nvidia_smi(Path(args.topo).read_text(errors="replace")))
        except (OSError, ValueError) as exc:
            raise DiagInputError(str(exc), source=args.topo) from None
    if args.nccl_log:
        from diag.analyzers.nccl import log as nccl_log

        parts.append(ne.topology_from_nccl_log(nccl_log.parse_files(args.nccl_log)))
    try:
        parts.append(ne.topology_from_flags(args.intra, args.inter, args.nics_per_node, args.gpus_per_node,
                                            args.nodes))
    except ValueError as exc:
        raise DiagInputError(str(exc)) from None
    return ne.merge_topology(*parts)


def interpret_doc(doc: dict, topo: dict) -> None:
    """Add expected_busbw_gbps, pct_of_expected, flags and diagnosis to every test: the
    diagnosis layer's judgement of each test's bandwidth facts."""
    from diag.analyzers.diagnosis import bandwidth
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.nccl import expected as ne

    tree = load_tree()
    doc["topology"] = topo
    for test in doc.get("tests") or []:
        if test.get("skipped"):
            continue
        view = test
        if not (test.get("hosts") or test.get("devices")) and doc.get("hosts"):
            view = {**test, "hosts": doc["hosts"]}
        result = bandwidth.judge(ne.bandwidth_facts(view, topo), tree)
        test["interpretation"] = result
        for key in ("expected_busbw_gbps", "pct_of_expected", "diagnosis", "flags"):
            test[key] = result[key]
        test["large_message_busbw_gbps"] = result["measured_busbw_gbps"]


def interpretation_lines(doc: dict) -> list[str]:
    lines = []
    for test in doc.get("tests") or []:
        name = test.get("collective") or "?"
        if test.get("skipped"):
            lines.append(f"# {name}: skipped: {'; '.join(test.get('errors') or [])}")
            continue
        it = test.get("interpretation") or {}
        measured = it.get("measured_busbw_gbps")
        head = f"# {name}: status {test.get('status')}"
        if measured is not None:
            head += f", large-message busbw {measured:.2f} GB/s"
        if it.get("expected_busbw_gbps") is not None:
            head += f", expected {it['expected_busbw_gbps']:.1f} GB/s ({it['expected_basis']})"
        lines.append(head)
        if it.get("diagnosis"):
            marks = {"below_50": "  [BELOW 50%]", "below_80": "  [below 80%]"}
            flag = next((marks[f] for f in it.get("flags") or [] if f in marks), "")
            lines.append(f"#   {it['diagnosis']}{flag}")
        for err in test.get("errors") or []:
            lines.append(f"#   error: {err}")
        for note in test.get("skipped_cases") or []:
            lines.append(f"#   {note}")
    return lines


_CSV_FIELDS = [
    "collective", "world_size", "backend", "status", "size_bytes", "count", "dtype", "redop", "root",
    "oop_time_us", "oop_algbw_gbps", "oop_busbw_gbps", "oop_wrong",
    "ip_time_us", "ip_algbw_gbps", "ip_busbw_gbps", "ip_wrong", "expected_busbw_gbps", "source",
]


def csv_text(doc: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for test in doc.get("tests") or []:
        for row in test.get("rows") or []:
            rec = {k: test.get(k) for k in ("collective", "world_size", "backend", "status",
                                           "expected_busbw_gbps", "source")}
            rec.update({k: row.get(k) for k in ("size_bytes", "count", "dtype", "redop", "root")})
            for prefix, key in (("oop", "out_of_place"), ("ip", "in_place")):
                g = row.get(key) or {}
                rec.update({f"{prefix}_time_us": g.get("time_us"), f"{prefix}_algbw_gbps": g.get("algbw_gbps"),
                            f"{prefix}_busbw_gbps": g.get("busbw_gbps"), f"{prefix}_wrong": g.get("wrong")})
            w.writerow(rec)
    return buf.getvalue()


def write_outputs(doc: dict, args) -> None:
    from diag.rundir import atomic_write_json, atomic_write_text

    if args.json and args.json != "-":
        atomic_write_json(args.json, doc)
    elif args.json == "-":
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    if args.csv:
        atomic_write_text(args.csv, csv_text(doc))
    if args.run_dir:
        atomic_write_json(Path(args.run_dir) / RUN_DIR_FILE, doc)


def _exit_code(doc: dict) -> int:
    tests = doc.get("tests") or []
    if doc.get("status") in ("failed", "partial") and not tests:
        return 1
    bad = [t for t in tests if t.get("status") != "ok" and not t.get("skipped")]
    return 1 if bad or (doc.get("status") not in (None, "ok")) else 0


# ---------------------------------------------------------------- parse mode


def _parse_mode(args, files: list[str]) -> int:
    from diag import nccl_table
    from diag.analyzers.nccl import nccl_tests

    if args.json and args.json != "-" and os.path.isfile(args.json) and not args.json.endswith(".json"):
        files = [args.json, *files]  # `parse --json FILE`: the file is an input, the JSON goes to stdout
        args.json = "-"
    if not files:
        raise DiagInputError("parse needs at least one saved nccl-tests output file")
    topo = _topology(args)
    doc = {"schema": nccl_tests.SCHEMA, "source": "diag nccl parse", "tests": [], "errors": []}
    for path in files:
        try:
            part = nccl_tests.parse_file(path)
        except DiagInputError as exc:
            doc["errors"].append({"source": path, "error": str(exc)})
            print(f"diag: error: {exc}", file=sys.stderr)
            continue
        except OSError as exc:
            doc["errors"].append({"source": path, "error": exc.strerror or str(exc)})
            print(f"diag: error: {path}: {exc.strerror or exc}", file=sys.stderr)
            continue
        doc["tests"].extend(part["tests"])
    interpret_doc(doc, topo)
    if not doc["tests"]:
        if args.json:
            write_outputs(doc, args)
        raise DiagInputError("no nccl-tests output could be parsed from " + ", ".join(files))
    to_stdout_json = args.json == "-"
    if not to_stdout_json:
        for test in doc["tests"]:
            print(f"# {test.get('source')}: {test.get('collective') or 'unknown collective'}, "
                  f"{test.get('world_size') or '?'} ranks, backend {test.get('backend')}, status {test.get('status')}")
            print(nccl_table.render_test(test, devices=test.get("devices"), framed=False), end="")
            for err in test.get("errors") or []:
                print(f"#   error: {err}")
        print("\n".join(interpretation_lines(doc)))
    write_outputs(doc, args)
    if doc["errors"]:
        return 1
    return 0


# ---------------------------------------------------------------- binary mode


def _binary_mode(args) -> int:
    from diag.analyzers.nccl import nccl_tests

    binary = args.binary
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise DiagInputError("not an executable file", source=binary)
    cmd = (shlex.split(args.mpirun) if args.mpirun else []) + [binary] + list(args.args)
    topo = _topology(args)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                                start_new_session=True)
    except OSError as exc:
        raise DiagInputError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
    chunks: list[str] = []
    last_output = [time.monotonic()]
    timed_out = threading.Event()

    def guard() -> None:
        # A hung job (a dead peer, a stuck NCCL init) prints nothing; stop it after --timeout seconds.
        while proc.poll() is None:
            if args.timeout and time.monotonic() - last_output[0] > args.timeout:
                timed_out.set()
                _kill_group(proc)
                return
            time.sleep(0.2)

    threading.Thread(target=guard, daemon=True).start()
    quiet_stdout = args.json == "-"
    out = sys.stderr if quiet_stdout else sys.stdout
    try:
        for raw in iter(proc.stdout.readline, b""):
            last_output[0] = time.monotonic()
            line = raw.decode("utf-8", errors="replace")
            chunks.append(line)
            out.write(line)
            out.flush()
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    rc = proc.wait()
    text = "".join(chunks)
    tests = nccl_tests.parse_text(text, source=binary)
    doc = {"schema": nccl_tests.SCHEMA, "source": "diag nccl --binary", "command": cmd, "exit_code": rc,
           "tests": tests, "status": "ok", "errors": []}
    if timed_out.is_set():
        doc["errors"].append(f"no output for {args.timeout:g} s: the job was stopped")
    if rc != 0:
        doc["errors"].append(f"{' '.join(cmd[:1])} exited with status {rc}")
    for test in tests:
        if doc["errors"] and test.get("status") == "ok":
            test["status"] = "partial" if test.get("rows") else "failed"
        test.setdefault("errors", [])
        test["errors"].extend(e for e in doc["errors"] if e not in test["errors"])
    if not tests:
        doc["status"] = "failed"
        doc["errors"].append("no nccl-tests results table in the output")
    elif any(t.get("status") != "ok" for t in tests):
        doc["status"] = "partial" if any(t.get("rows") for t in tests) else "failed"
    interpret_doc(doc, topo)
    print("\n".join(interpretation_lines(doc)), file=out)
    if not tests:
        print(f"diag: error: {binary}: no nccl-tests results table in the output", file=sys.stderr)
    write_outputs(doc, args)
    return rc if rc != 0 else _exit_code(doc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- measuring


def _config(args):
    from diag.collectors import nccl_bench as nb

    def split(value: str, allowed, normalise):
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        if items == ["all"]:
            return list(allowed)
        return [normalise(v) for v in items]

    try:
        cfg = nb.BenchConfig(
            collectives=split(args.collective, nb.COLLECTIVES, nb.normalize_collective),
            min_bytes=nb.parse_size(args.minbytes),
            max_bytes=nb.parse_size(args.maxbytes),
            step_factor=args.stepfactor,
            step_bytes=nb.parse_size(args.stepbytes),
            dtypes=split(args.datatype, nb.DTYPES, nb.normalize_dtype),
            redops=split(args.op, nb.REDOPS, _redop_name),
            root=args.root,
            warmup_iters=max(0, args.warmup_iters),
            iters=max(1, args.iters),
            check=max(0, args.check),
            average=args.average,
            timeout=args.timeout,
            backend=args.backend,
        )
        cfg.sizes()
    except ValueError as exc:
        raise DiagInputError(str(exc)) from None
    if args.timeout <= 0:
        raise DiagInputError("--timeout must be positive")
    return cfg


def _redop_name(name: str) -> str:
    from diag.collectors import nccl_bench as nb

    key = name.lower()
    if key not in nb.REDOPS:
        raise ValueError(f"unknown reduction op {name!r}: choose from {', '.join(nb.REDOPS)} or all")
    return key


def _bench_mode(args) -> int:
    from diag.collectors import launch_env

    cfg = _config(args)
    _topology(args)  # reject bad topology flags here, not once per rank
    info = launch_env.detect()
    if info.launcher != "none":
        if args.nproc_per_node:
            print(f"diag: running inside an existing {info.launcher} launch: --nproc-per-node ignored",
                  file=sys.stderr)
        return _measure_in_rank(args, cfg, info)
    if args.nproc_per_node or args.nnodes > 1:
        return _self_launch(args)
    # One process, one rank: a process group of size 1 on the loopback interface.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return _measure_in_rank(args, cfg, launch_env.detect())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TableReporter:
    """Rank 0's printer: nccl-tests' table as rows arrive, a progress bar on a terminal."""

    def __init__(self, cfg, show_progress: bool, stream=None):
        self.cfg = cfg
        self.out = stream or sys.stdout
        self.doc: dict = {}
        self.bar = None
        if show_progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.row_count(), unit="size", desc="diag nccl", leave=False,
                                file=sys.stderr, dynamic_ncols=True)
            except Exception:
                self.bar = None
        self._lock = threading.Lock()

    def _print(self, lines) -> None:
        text = "\n".join(lines) if isinstance(lines, list) else lines
        with self._lock:
            if self.bar is not None:
                self.bar.clear()
            self.out.write(text + "\n")
            self.out.flush()
            if self.bar is not None:
                self.bar.refresh()

    def start(self, doc: dict) -> None:
        self.doc = doc

    def test_start(self, test: dict) -> None:
        from diag import nccl_table

        lines = nccl_table.header_lines(self.doc.get("params"), _printable_devices(self.doc.get("devices")),
                                        test["collective"], backend=_library_name(test.get("backend")))
        self._print(lines + nccl_table.column_header_lines())

    def row(self, test: dict, row: dict) -> None:
        from diag import nccl_table

        self._print(nccl_table.format_row(row))
        if self.bar is not None:
            self.bar.update(1)

    def note(self, test: dict, message: str) -> None:
        self._print(f"# {message}")
        if self.bar is not None:
            sizes = len(self.cfg.sizes())
            self.bar.update(sizes)

    def test_end(self, test: dict) -> None:
        from diag import nccl_table

        if test.get("skipped"):
            self._print(f"# diag: {test['collective']} skipped: nothing this backend can measure")
        elif test["status"] == "ok":
            self._print(nccl_table.footer_lines(nccl_table.count_wrong_checks(test), test.get("avg_busbw_gbps"),
                                                test["collective"]))
        else:
            # No footer: the table ends where the run did, as a cut-short nccl-tests run would.
            self._print([f"# diag: {test['collective']} stopped ({test['status']}, {len(test['rows'])} sizes "
                         f"measured): {err}" for err in test["errors"]] or
                        [f"# diag: {test['collective']} {test['status']}"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _library_name(backend: str | None) -> str | None:
    """The communication library behind a torch.distributed backend: "nccl" is RCCL on ROCm."""
    if backend == "nccl":
        try:
            import torch

            if getattr(torch.version, "hip", None):
                return "rccl"
        except ImportError:
            pass
    return backend


def _printable_devices(devices):
    out = []
    for d in devices or []:
        if not d:
            continue
        d = dict(d)
        if d.get("device", -1) < 0:
            d["device"] = 0  # CPU ranks: torch's "cpu" device has index 0
        out.append(d)
    return out


def _measure_in_rank(args, cfg, info) -> int:
    from diag.collectors import nccl_bench as nb

    is_root = info.rank == 0
    reporter = None
    finished = threading.Event()
    topo = _topology(args) if is_root else None
    # With `--json -` the document owns standard output; the table goes to standard error.
    stream = sys.stderr if args.json == "-" else sys.stdout
    if is_root:
        show = not args.no_progress and sys.stderr.isatty()
        reporter = _TableReporter(cfg, show, stream)

    def finish(doc: dict) -> None:
        if finished.is_set():
            return
        finished.set()
        if reporter is not None:
            reporter.close()
        interpret_doc(doc, topo)
        lines = interpretation_lines(doc)
        if lines:
            print("\n".join(lines), file=stream, flush=True)
        write_outputs(doc, args)

    doc = nb.run_rank(cfg, reporter, info, on_abort=finish if is_root else None)
    if is_root:
        if doc.get("status") != "ok":
            # The launcher stops the survivors with SIGTERM once a peer failed: finish the report first.
            try:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            except (ValueError, OSError):
                pass
        finish(doc)
    elif doc.get("status") != "ok":
        for err in doc.get("errors") or []:
            print(f"diag nccl: rank {info.rank}: {err}", file=sys.stderr)
    if doc.get("status") == "failed" and not doc.get("tests"):
        for err in doc.get("errors") or []:
            print(f"diag: error: {err}", file=sys.stderr)
    return _exit_code(doc)


def _worker_argv(args) -> list[str]:
    """The command line each launched rank runs: the same measurement, without launch flags."""
    argv = ["-m", "diag", "nccl",
            "-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor),
            "-i", str(args.stepbytes), "-d", args.datatype, "-o", args.op, "-r", str(args.root),
            "-w", str(args.warmup_iters), "-n", str(args.iters), "-c", str(args.check),
            "-a", str(args.average), "--collective", args.collective, "--timeout", str(args.timeout)]
    if args.backend:
        argv += ["--backend", args.backend]
    for flag, value in (("--json", args.json), ("--csv", args.csv), ("--run-dir", args.run_dir),
                        ("--topo", args.topo), ("--intra", args.intra), ("--inter", args.inter)):
        if value:
            argv += [flag, os.path.abspath(value) if flag in ("--csv", "--run-dir", "--topo") or
                     (flag == "--json" and value != "-") else value]
    for log in args.nccl_log:
        argv += ["--nccl-log", os.path.abspath(log)]
    for flag, value in (("--nics-per-node", args.nics_per_node), ("--gpus-per-node", args.gpus_per_node),
                        ("--nodes", args.nodes)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _describe_exit(code: int) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _self_launch(args) -> int:
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = args.nproc_per_node or 1
    if nproc < 1 or args.nnodes < 1:
        raise DiagInputError("--nproc-per-node and --nnodes must be at least 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise DiagInputError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    single = args.nnodes == 1 and not args.rdzv_endpoint
    rdzv_backend, rdzv_configs = args.rdzv_backend, {}
    if args.node_rank is not None:
        rdzv_backend, rdzv_configs = "static", {"rank": args.node_rank}
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=nproc,
        run_id=f"diag-nccl-{uuid.uuid4().hex[:8]}" if single else args.rdzv_id,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint="127.0.0.1:0" if single else args.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        monitor_interval=0.2,
        local_addr="127.0.0.1" if single else None,
    )
    # The launcher's own warnings repeat what the ranks and the line below say.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, sys.executable)(*_worker_argv(args))
    except ChildFailedError as exc:
        failures = getattr(exc, "failures", {}) or {}
        desc = ", ".join(f"rank {rank} {_describe_exit(f.exitcode)}" for rank, f in sorted(failures.items()))
        try:
            first, _ = exc.get_first_failure()
            desc += f" (first: rank {first})"
        except Exception:
            pass
        print(f"diag: error: ranks failed: {desc or exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # rendezvous failures and the like: one line, not a traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"diag: error: launching the ranks failed: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0
