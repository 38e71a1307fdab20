"""Shared test helpers: where the real data lives, and how missing tools are handled."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    """No test sees the caches of the machine it runs on (a CPU calibration there once changed
    verdicts): every test, and every process it starts, gets an empty cache of its own."""
    import tempfile

    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="diag-test-cache-")


def real_data_dir() -> Path | None:
    """$DIAG_REAL_DATA, else ../shared/data beside the repository, else None."""
    env = os.environ.get("DIAG_REAL_DATA")
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "data")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def made_once(tmp_path_factory, name: str, make):
    """make(folder) once for the whole test run, its result shared by every test process.

    Under pytest-xdist each worker has its own session, so a session fixture would run once per
    worker: the first to take the lock makes the result in a folder the workers share, and the
    others read the path it recorded (the lock file is a claim, and `done` is written last)."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        done = shared / "done"
        if not done.exists():
            result = make(shared / "made")
            done.write_text(str(result))
        return Path(done.read_text())


def _demo_run(folder: Path) -> Path:
    import sys

    run = folder / "run"
    proc = subprocess.run([sys.executable, "-m", "diag", "demo", "--steps", "24", "--run-dir", str(run), "--no-export"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def demo_run_dir(tmp_path_factory) -> Path:
    """A real 2-rank demo run (24 steps, profiler windows, samples), made once per test run; its
    readers leave it as it is."""
    return made_once(tmp_path_factory, "demo", _demo_run)


# What the build reads (setup.py's ROOTS and the metadata): copied to a clean folder first, as
# a fresh clone would have them, so a build/ folder left in this tree cannot add stale modules.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "agent", "analyzers", "collectors", "dashboards")


def build_wheel(out: Path) -> Path:
    """The wheel of this tree, as `pip wheel` builds it for a user: without build isolation
    where this environment has the build requirements (no download), else isolated."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    src = out / "src"
    src.mkdir(parents=True)
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    try:
        local = int(version("setuptools").split(".")[0]) >= 68 and bool(version("wheel"))
    except PackageNotFoundError:
        local = False
    isolation = ["--no-build-isolation"] if local else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(src)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("diag-*.whl")
    return wheel


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built once per test run (build_wheel)."""
    return made_once(tmp_path_factory, "wheel", build_wheel)


@pytest.fixture(scope="session")
def real_data() -> Path:
    d = real_data_dir()
    if d is None:
        pytest.skip("real data not found: set DIAG_REAL_DATA or place shared/data beside the repository")
    return d


@pytest.fixture(scope="session")
def real_traces(real_data) -> Path:
    return real_data / "traces"


@pytest.fixture(scope="session")
def real_nccl(real_data) -> Path:
    return real_data / "nccl"


def require_executable(name: str, hint: str) -> str:
    """Path of a system tool. Missing: skip locally, fail in CI (where .ci/run installs it)."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)), None
    )
    if path:
        return path
    if IN_CI:
        pytest.fail(f"{name} is required in CI ({hint}) but was not found")
    pytest.skip(f"{name} not installed ({hint})")


@pytest.fixture
def artifacts_dir() -> Path:
    d = REPO / "tests" / "artifacts"
    d.mkdir(parents=True, exist_ok=True)
    return d


def free_port_pair() -> int:
    """A port p on loopback with p + 1 free too: the endpoints of a 2-rank job (9870 + local rank)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
        return p
    raise RuntimeError("no two adjacent free ports")


def wait_for_line(lines: list, text: str, proc, timeout_s: float = 200.0) -> None:
    """Until a line a reader thread appends to `lines` holds `text`; fails if `proc` ends first."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in lines):
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)


def run_job(cmd: list[str], timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run a job in its own session; on a timeout kill its whole process group (a launcher's
    ranks too), so that no process outlives the test."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout} s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the pytest options): one test process per CPU this process may run on, and one
    more, since many tests wait (on their jobs, servers and browsers) more than they compute; at
    most 4, since most slow tests start a 2-rank job of their own; none on one CPU. On 2 CPUs with
    a CPU-bound job beside the suite, 3 processes took 628 s where 2 took 829 and 897."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus + 1, 4) if cpus > 1 else 0


def pytest_collection_modifyitems(config, items) -> None:
    """The modules with the most slow tests first (keeping each module's own order), so that the
    test processes start on the long ones and end on short ones. xdist keeps this order because
    the suite runs with --no-loadscope-reorder; by default it would order modules by their number
    of tests, which puts the one-test slow modules last."""
    slow_tests = collections.Counter(
        item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[item.module.__name__])
