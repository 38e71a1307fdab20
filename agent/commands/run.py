"""`diag run [--run-dir DIR] -- <launcher command ...>`: NCCL logging for jobs whose code cannot change.

The command (torchrun, srun, mpirun, python ...) runs with NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE pointing into RUN_DIR/nccl/ (variables already
set by the user are kept), and with DIAG_RUN_DIR/DIAG_RUN_ID so that a `diag.Agent`
inside the job writes into the same run directory. Its exit code is returned. Then the
NCCL logs are parsed into RUN_DIR/nccl_log.json when the NCCL log parser is present.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from diag.errors import DiagInputError

HELP = "run a launcher command with NCCL logging routed into a run directory"


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", default=None,
                        help="run directory (default runs/run-<timestamp>; an earlier run is never overwritten)")
    parser.add_argument("--nccl-coll", action="store_true", help="also log every collective (NCCL_DEBUG_SUBSYS=...,COLL)")
    parser.add_argument("cmd", nargs="*", metavar="-- COMMAND", help="the launcher command and its arguments")


def _parse_logs(run_dir: Path, logs: list[Path]) -> dict | None:
    from diag import atomic_io, rundir
    from diag.analyzers.nccl.log import parse_files

    doc = parse_files([str(p) for p in logs])
    try:
        atomic_io.atomic_write_json(run_dir / rundir.NCCL_LOG_DOC, doc)
    except OSError as exc:
        print(f"diag run: {run_dir / rundir.NCCL_LOG_DOC}: cannot write ({exc.strerror or exc})", file=sys.stderr)
    return doc


def _write_manifest(run_dir: Path, run_id: str, cmd: list[str], started: float, code: int) -> None:
    """Record the launch in the manifest; an agent inside the job may have written one already."""
    from diag import atomic_io, rundir

    doc = atomic_io.read_json(run_dir / rundir.MANIFEST) or {
        "schema": rundir.RUN_SCHEMA, "run_id": run_id, "started_unix": started,
        "status": "completed" if code == 0 else "failed", "ended_unix": time.time(),
    }
    doc["launch"] = {"command": cmd, "exit_code": code, "started_unix": started, "ended_unix": time.time(),
                     "nccl_logs": "nccl/"}
    try:
        atomic_io.atomic_write_json(run_dir / rundir.MANIFEST, doc)
    except OSError as exc:
        print(f"diag run: {run_dir}: cannot write the manifest ({exc.strerror or exc})", file=sys.stderr)


def run(args) -> int:
    from diag.collectors import nccl_env
    from diag.collectors.run_writer import resolve_run_dir

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise DiagInputError("no command given: diag run [--run-dir DIR] -- <launcher command ...>")
    run_id = uuid.uuid4().hex[:12]
    base = Path(args.run_dir) if args.run_dir else Path("runs") / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        run_dir = resolve_run_dir(base, f"diag:{run_id}", True, rank=0)
    except OSError as exc:
        raise DiagInputError(f"cannot create the run directory ({exc.strerror or exc})", source=str(base)) from None
    env = dict(os.environ)
    nccl_dir = run_dir / "nccl"
    applied = nccl_env.configure(nccl_dir, coll=args.nccl_coll, env=env, check_process_group=False,
                                 log=lambda m: print(f"diag run: {m}", file=sys.stderr))
    env.setdefault("DIAG_RUN_DIR", str(run_dir))
    env["DIAG_RUN_ID"] = run_id
    if applied:
        print(f"diag run: NCCL logs go to {nccl_dir}/", file=sys.stderr)
    started = time.time()
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        raise DiagInputError(f"cannot start the command ({exc.strerror or exc})", source=cmd[0]) from None

    # Forward Ctrl-C/SIGTERM to the job and keep waiting for it, as launchers do.
    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    _write_manifest(run_dir, f"diag:{run_id}", cmd, started, code)
    logs = sorted(p for p in nccl_dir.glob("*") if p.is_file()) if nccl_dir.is_dir() else []
    if logs:
        doc = _parse_logs(run_dir, logs)
        if doc is not None:
            from diag.analyzers.diagnosis.nccl_log import findings as log_findings

            findings = log_findings(doc)
            print(f"diag run: parsed {len(logs)} NCCL log file(s) into {run_dir / 'nccl_log.json'}"
                  f" ({len(findings)} finding(s))", file=sys.stderr)
            for f in findings[:5]:
                print(f"  {f.get('severity')}: {f.get('message')}", file=sys.stderr)
    else:
        print("diag run: no NCCL log was written (the job did not use NCCL, or set NCCL_DEBUG_FILE itself)",
              file=sys.stderr)
    print(f"diag run: run directory {run_dir}; exit code {code}", file=sys.stderr)
    # A signal-killed child reports -N; shells use 128 + N.
    return code if code >= 0 else 128 - code
