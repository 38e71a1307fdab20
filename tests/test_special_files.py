"""Readers are bounded on any file, not only by the size a file claims: a run directory whose
rank.json links to /dev/zero, or whose step records are a FIFO, is read in bounded time and
memory, the file named as a problem (agent/rundir.py, open_regular)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diag import atomic_io, rundir, segments


@pytest.fixture
def run_dir(demo_run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(demo_run_dir, copy)
    return copy


def _analyze(path) -> subprocess.CompletedProcess:
    # A memory limit of 2 GiB: reading /dev/zero whole would pass it within seconds.
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
    return subprocess.run([sys.executable, "-c", limit + "import sys; from diag.cli import main; sys.exit(main())",
                           "analyze", str(path), "--json"], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero on this system")
def test_a_rank_json_that_links_to_a_device_is_a_problem_not_a_read(run_dir):
    rank_json = run_dir / "rank-00000" / "rank.json"
    rank_json.unlink()
    rank_json.symlink_to("/dev/zero")
    problems = []
    assert atomic_io.read_json(rank_json, problems) is None
    assert problems and "not a regular file" in problems[0]
    out = _analyze(run_dir)
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr, out.stderr[-2000:]


def test_step_records_that_are_a_fifo_do_not_hang(run_dir):
    steps = run_dir / "rank-00001" / "steps"
    for seg in steps.glob("*.jsonl"):
        seg.unlink()
    os.mkfifo(steps / "steps-000000.jsonl")  # no writer ever opens it
    problems = []
    assert list(segments.read_segment(steps / "steps-000000.jsonl", problems)) == []
    assert "not a regular file" in problems[0]
    out = _analyze(run_dir)
    assert out.returncode in (0, 1, 2) and "Traceback" not in out.stderr, out.stderr[-2000:]


def _diag(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True, timeout=120)


def test_a_step_number_past_any_count_is_left_out_not_a_traceback(run_dir):
    seg = sorted((run_dir / "rank-00001" / "steps").glob("*.jsonl"))[0]
    lines = seg.read_text().splitlines()
    lines[3] = lines[3].replace('"step": 3,', '"step": 9223372036854775808,', 1).replace('"step":3,',
                                                                                       '"step":9223372036854775808,', 1)
    assert "9223372036854775808" in lines[3]
    seg.write_text("\n".join(lines) + "\n")
    reader = rundir.RunDir(run_dir)
    steps = reader.steps(1)
    assert 3 not in {s.step for s in steps} and len(steps) == len(lines) - 1
    assert any("9223372036854775808" in p for p in reader.problems)
    for args in (("analyze", str(run_dir), "--json"), ("report", str(run_dir))):
        out = _diag(*args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_a_report_path_taken_by_a_directory_is_one_line(run_dir):
    (run_dir / "report.html").unlink()
    (run_dir / "report.html").mkdir()
    out = _diag("report", str(run_dir))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and "report.html" in out.stderr
