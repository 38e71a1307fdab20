"""A stop from outside is recorded: SIGTERM (a scheduler's time limit, torchrun, Kubernetes) to a
real training process under diag.Agent closes the rank as terminated, keeps every step it ran,
and the process still ends by the signal; a job's own SIGTERM handler is left alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

TRAIN = textwrap.dedent("""
    import signal, sys, time
    import torch
    import diag
    own = len(sys.argv) > 2
    if own:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))  # the job's own handler
    model = torch.nn.Linear(64, 64)
    with diag.Agent(run_dir=sys.argv[1], export=False, report=True, sampling=False, profile=False,
                    verbose=False, report_wait_s=5.0) as agent:
        for step in range(100000):
            model(torch.randn(32, 64)).sum().backward()
            time.sleep(0.005)
            agent.step(samples=32)
""")


def _steps(run) -> list[dict]:
    return [json.loads(line) for f in sorted((run / "rank-00000" / "steps").glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def _wait_live_steps(run, n: int, timeout: float = 60.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            done = json.loads((run / "rank-00000" / "live.json").read_text()).get("steps_done") or 0
        except (OSError, ValueError):
            done = 0
        if done >= n:
            return done
        time.sleep(0.1)
    raise AssertionError("the training did not reach its steps")


def test_sigterm_closes_the_rank_as_terminated_and_ends_the_process_by_the_signal(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(run)], stderr=subprocess.PIPE, text=True)
    before = _wait_live_steps(run, 30)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # as without the agent
    assert "Traceback" not in err, err[-2000:]
    info = json.loads((run / "rank-00000" / "rank.json").read_text())
    assert info["status"] == "terminated" and info["error"].startswith("SIGTERM: the process was told to stop")
    assert len(_steps(run)) >= before  # nothing lost of what ran before the signal
    assert json.loads((run / "manifest.json").read_text())["status"] == "terminated"


def test_a_jobs_own_sigterm_handler_is_left_alone(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(run), "own"], stderr=subprocess.PIPE, text=True)
    _wait_live_steps(run, 10)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err[-2000:]  # the job's handler ran: sys.exit(7)
    assert json.loads((run / "rank-00000" / "rank.json").read_text())["status"] == "failed"  # SystemExit(7)


def test_sigkill_loses_at_most_about_a_second_of_steps(tmp_path):
    """No handler runs on SIGKILL (the OOM killer, a scheduler's hard kill): what the rank keeps
    is what reached the run directory, appended every second (flush_s) to the open segments."""
    from diag import rundir

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(run)], stderr=subprocess.PIPE, text=True)
    _wait_live_steps(run, 50)
    time.sleep(2.5)  # past the first seconds' syncs, and mid-segment: a segment seals every 10 s
    killed = time.time()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    steps = rundir.RunDir(run).steps(0)
    last = max(s.start_unix + s.duration_s for s in steps)
    assert killed - last < 1.6, (killed - last, len(steps))
    assert [s.step for s in steps] == list(range(len(steps)))  # whole, in order, the cut-off line left out
    # The records came through the segment it was appending to; only where the kill fell just
    # after a seal (every 10 s) and before the next second's append opened the next one, the
    # last segment is a sealed one, sealed within that second (a busy machine made it happen).
    segs = run / "rank-00000" / "steps"
    if not list(segs.glob("*.jsonl.open")):
        newest = max(p.stat().st_mtime for p in segs.glob("*.jsonl"))
        assert killed - newest < 1.6, killed - newest


def test_a_segment_a_killed_writer_left_open_is_sealed_without_its_cut_off_line(tmp_path):
    from diag import segments
    d = tmp_path / "steps"
    d.mkdir()
    (d / "steps-000000.jsonl").write_text('{"step": 0}\n')
    (d / "steps-000001.jsonl.open").write_text('{"step": 1}\n{"step": 2}\n{"st')
    problems = []
    assert [r["step"] for r in segments.read_records(d, "steps", problems)] == [0, 1, 2] and not problems
    w = segments.SegmentWriter(d, "steps")  # a restarted rank writes on
    w.write({"step": 3})
    w.flush()
    assert sorted(p.name for p in d.iterdir()) == ["steps-000000.jsonl", "steps-000001.jsonl", "steps-000002.jsonl"]
    assert [r["step"] for r in segments.read_records(d, "steps", problems)] == [0, 1, 2, 3] and not problems


def test_the_window_analysis_told_to_stop_leaves_no_half_written_trace(tmp_path):
    """The agent ends a window-analysis process still busy at the job's end with SIGTERM: the
    process removes its half-written compressed copy and exits; the raw trace stays whole."""
    import os

    raw = tmp_path / "window-000003.pt.trace.json"
    raw.write_bytes(os.urandom(96 << 20))  # incompressible: the copy takes long enough to stop it midway
    tmp = tmp_path / f".{raw.name}.gz.tmp"
    job = {"trace": str(raw), "out": str(tmp_path / "window-000003.json"), "rank": 0, "first": 3, "last": 4}
    worker = subprocess.Popen([sys.executable, "-m", "diag.window_worker", "--serve"], stdin=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdin is not None
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        deadline = time.monotonic() + 60
        while not tmp.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert tmp.exists(), "the worker never began its compressed copy"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 128 + signal.SIGTERM
    finally:
        if worker.poll() is None:
            worker.kill()
    assert not tmp.exists() and raw.stat().st_size == 96 << 20
    assert not (tmp_path / f"{raw.name}.gz").exists() and not (tmp_path / "window-000003.json").exists()
