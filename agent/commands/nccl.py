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
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, cast

from diag import rundir
from diag.errors import DiagInputError
from diag.nccl_measure import bench_mode
from diag.nccl_output import (
    exit_code,
    interpret_doc,
    interpretation_lines,
    topology_from_args,
    write_outputs,
)

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
    sweep.add_argument("-w", "--warmup_iters", "--warmup-iters", dest="warmup_iters", type=int, default=1,
                       help="untimed calls at every size from -b to -e by a factor of 2, before measuring")
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

    out = _add_outputs(parser)
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    launch = parser.add_argument_group("self-launching (outside torchrun/srun/mpirun)")
    launch.add_argument("--nproc-per-node", type=int, help="ranks to start on this node")
    launch.add_argument("--nnodes", type=int, default=1, help="nodes in the job, each running this command (default 1)")
    launch.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint (needed across nodes)")
    launch.add_argument("--rdzv-backend", default="c10d", help="torchrun's rendezvous backend (default c10d)")
    launch.add_argument("--rdzv-id", default="diag-nccl",
                        help="the rendezvous id every node gives (default diag-nccl)")

    binary = parser.add_argument_group("real nccl-tests")
    binary.add_argument("--binary", metavar="PATH", help="run this nccl-tests binary and parse its output")
    binary.add_argument("--mpirun", metavar="CMD", help='launcher prefix, e.g. "mpirun -np 16 -N 8"')

    _add_topology(parser)


def _add_outputs(parser: argparse.ArgumentParser):
    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="FILE",
                     help="write the diag.nccl_bench/1 document to FILE (no FILE or '-': standard output)")
    out.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    out.add_argument("--run-dir", metavar="DIR", help=f"also write DIR/{rundir.NCCL_BENCH}")
    return out


def _add_topology(parser: argparse.ArgumentParser) -> None:
    topo = parser.add_argument_group("expected bandwidth (topology)")
    topo.add_argument("--topo", metavar="FILE", help="saved `nvidia-smi topo -m` output")
    topo.add_argument("--nccl-log", metavar="FILE", action="append", default=[],
                      help="NCCL_DEBUG=INFO log of the same job (transports actually used)")
    topo.add_argument("--intra", help="GPU link: nvlink1..nvlink5, pcie3..pcie6")
    topo.add_argument("--inter", help="NICs: ib_edr, ib_hdr, ib_ndr, ib_xdr, roce_100/200/400, eth_10..eth_400")
    topo.add_argument("--nics-per-node", type=int, help="network cards per node that NCCL uses across nodes (default 1)")
    topo.add_argument("--gpus-per-node", type=int, help="GPUs per node, for the share of traffic that crosses nodes")
    topo.add_argument("--nodes", type=int, help="nodes in the job, for the expected figure across nodes")


def add_arguments_for(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The arguments of `diag nccl` as `argv` uses them: `parse FILE...` has its own usage and
    help (its files, the outputs and the topology); anything else is the sweep's. Returns the
    arguments left to parse."""
    if not argv or argv[0] != "parse":
        add_arguments(parser)
        return argv
    parser.prog += " parse"
    parser.description = "parse saved nccl-tests / rccl-tests output and judge its bus bandwidth"
    parser.add_argument("files", nargs="*", metavar="FILE", help="saved nccl-tests or rccl-tests outputs")
    _add_outputs(parser)
    _add_topology(parser)
    parser.set_defaults(args=["parse"], binary=None)
    return argv[1:]


def run(args) -> int:
    if args.args and args.args[0] == "parse":
        return _parse_mode(args, [*args.args[1:], *getattr(args, "files", [])])
    if args.binary:
        return _binary_mode(args)
    if args.args:
        raise DiagInputError(f"unexpected arguments {' '.join(args.args)!r}: use `diag nccl parse FILE...`, "
                             "or pass binary arguments after `--` with --binary")
    return bench_mode(args)


# ---------------------------------------------------------------- parse mode


def _parse_mode(args, files: list[str]) -> int:
    from diag import nccl_table
    from diag.analyzers.nccl import nccl_tests

    if args.json and args.json != "-" and os.path.isfile(args.json) and not args.json.endswith(".json"):
        files = [args.json, *files]  # `parse --json FILE`: the file is an input, the JSON goes to stdout
        args.json = "-"
    if not files:
        raise DiagInputError("parse needs at least one saved nccl-tests output file")
    topo = topology_from_args(args)
    doc: dict[str, Any] = {"schema": nccl_tests.SCHEMA, "source": "diag nccl parse", "tests": [], "errors": []}
    for path in files:
        try:
            part = nccl_tests.parse_file(path)
        except DiagInputError as exc:
            doc["errors"].append({"source": path, "error": str(exc)})
            continue
        except OSError as exc:
            doc["errors"].append({"source": path, "error": f"{path}: {exc.strerror or exc}"})
            continue
        doc["tests"].extend(part["tests"])
    interpret_doc(doc, topo)
    # One error line for the whole command, however many inputs failed.
    failed = "; ".join(e["error"] for e in doc["errors"])
    if not doc["tests"]:
        if args.json:
            write_outputs(doc, args)
        raise DiagInputError(f"no nccl-tests output could be parsed ({failed})" if len(files) > 1 else failed)
    if failed:
        print(f"diag: error: {failed}", file=sys.stderr)
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
    # A test the output marks failed is a failed measurement, as `diag nccl` running it says.
    if doc["errors"] or any(t.get("status") == "failed" for t in doc["tests"]):
        return 1
    return 0


# ---------------------------------------------------------------- binary mode


def _binary_mode(args) -> int:
    from diag.analyzers.nccl import nccl_tests

    binary = args.binary
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise DiagInputError("not an executable file", source=binary)
    cmd = (shlex.split(args.mpirun) if args.mpirun else []) + [binary] + list(args.args)
    topo = topology_from_args(args)
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
        for raw in iter(cast(IO[bytes], proc.stdout).readline, b""):  # stdout=PIPE
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
    doc: dict[str, Any] = {"schema": nccl_tests.SCHEMA, "source": "diag nccl --binary", "command": cmd, "exit_code": rc,
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
    return rc if rc != 0 else exit_code(doc)


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


