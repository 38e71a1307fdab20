"""`diag nccl`'s measuring mode: the collectives swept with torch.distributed on every rank
(inside a launch), or the ranks started through torch's elastic launcher (outside one); rank 0
prints the table in nccl-tests' layout."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from diag.errors import DiagInputError
from diag.nccl_output import (
    exit_code,
    interpret_doc,
    interpretation_lines,
    topology_from_args,
    write_outputs,
)


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


def bench_mode(args) -> int:
    from diag.collectors import launch_env

    cfg = _config(args)
    topology_from_args(args)  # reject bad topology flags here, not once per rank
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
        for note in doc.get("notes") or []:
            self._print(["#", f"# {note}"])

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
    topo = topology_from_args(args) if is_root else None
    # With `--json -` the document owns standard output; the table goes to standard error.
    stream = sys.stderr if args.json == "-" else sys.stdout
    if is_root:
        show = not args.no_progress and sys.stderr.isatty()
        reporter = _TableReporter(cfg, show, stream)

    def finish(doc: dict) -> None:
        if finished.is_set() or topo is None:  # rank 0 alone finishes the document
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
    return exit_code(doc)


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
