"""diag.Agent around a real CPU training loop: records, profiler windows, verdicts and faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pynvml
import pytest
import torch
from fake_gpu_libs import FakeNvidiaGpu, FakeNvml
from rank_documents import ranks_of

import diag
from diag import rundir
from diag.analyzers.analyze import analyze_run_dir as analyze_run
from diag.analyzers.diagnosis.decision_tree import BOUNDS
from diag.step_record import STEP_FIELDS, StepRecord


def _train(agent, steps, use_loader=True, sleep_s=0.0, width=128, on_step=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(32, width) for _ in range(steps)]
    it = agent.loader(batches) if use_loader else iter(batches)
    for i, x in enumerate(it):
        if sleep_s:
            time.sleep(sleep_s)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        agent.step(samples=32)
        if on_step is not None:
            on_step(i)
    return model


def _agent(tmp_path, **kw):
    opts = dict(run_dir=tmp_path / "run", export=False, skip_first=2, warmup=1, active=2, every=6,
                report_wait_s=5, verbose=False, report=False)
    opts.update(kw)
    return diag.Agent(**opts)


def _events(run_dir, rank=0):
    return [e["message"] for e in rundir.RunDir(run_dir).events(rank)]


def test_records_windows_and_verdicts(tmp_path):
    def wait_for_first_window(i):
        # Let the background analysis of window 3-4 finish, so later steps get live verdicts.
        deadline = time.monotonic() + 60
        while i == 6 and not agent.windows_analysed and time.monotonic() < deadline:
            time.sleep(0.1)

    with _agent(tmp_path) as agent:
        _train(agent, 14, sleep_s=0.002, on_step=wait_for_first_window)
    rd = rundir.RunDir(agent.run_dir)
    steps = rd.steps(0)
    assert [s.step for s in steps] == list(range(14))
    assert all(s.duration_s > 0 and s.data_wait_s is not None and s.samples == 32 for s in steps)
    # Every field the format documents is in the record as written.
    assert set(STEP_FIELDS) == set(StepRecord.__struct_fields__) <= set(next(rd.records(0, "steps")))
    # Windows on absolute steps: warm-up at 2, active 3-4; then 9-10 (every 6).
    windows = rd.windows(0)
    assert [(w.first_step, w.last_step) for w in windows] == [(3, 4), (9, 10)]
    assert {s.step for s in steps if s.profiled} == {3, 4, 9, 10}
    assert all(w.trace.endswith(".pt.trace.json.gz") for w in windows)
    assert [p.name for p in rd.traces(0)] == [w.trace for w in windows]
    assert rd.rank_info(0)["status"] == "completed" and rd.manifest()["status"] == "completed"

    doc = analyze_run(agent.run_dir)
    rank = ranks_of(doc)[0]
    by_step = {s["step"]: s for s in rank["steps"]}
    if windows[0].analysis is not None:  # the trace analyzer is present
        assert {n for n, s in by_step.items() if s["evidence"] == "trace"} == {3, 4, 9, 10}
        for s in rank["steps"]:
            assert s["bound"] in BOUNDS
            assert abs(sum(s["shares"].values()) - 1.0) < 1e-6
        # Step records after the first window carry the shares that window measured; the run
        # directory holds facts only, no verdict (the analysis above gives each step's).
        late = [s for s in steps if s.step > 6 and not s.profiled]
        assert any(s.shares and s.evidence == "sampled" for s in late)
        assert not any("bound" in s or "path" in s for s in rd.records(0, "steps"))
        assert not any("bound" in w.analysis or "path" in w.analysis or "findings" in w.analysis
                       for w in windows)
    assert doc.job.missing_ranks == []


def test_without_loader_steps_are_timed(tmp_path):
    with _agent(tmp_path, profile=False) as agent:
        _train(agent, 5, use_loader=False)
    steps = rundir.RunDir(agent.run_dir).steps(0)
    assert len(steps) == 5 and all(s.data_wait_s is None and s.duration_s > 0 for s in steps)


def test_data_wait_is_measured(tmp_path):
    def slow(n):
        for _ in range(n):
            time.sleep(0.03)
            yield torch.randn(8, 16)

    with _agent(tmp_path, profile=False) as agent:
        for x in agent.loader(slow(4)):
            x.sum()
            agent.step()
    steps = rundir.RunDir(agent.run_dir).steps(0)
    assert all(s.data_wait_s >= 0.025 and s.evidence == "sampled" for s in steps)
    judged = ranks_of(analyze_run(agent.run_dir))[0]["steps"]
    assert [s["bound"] for s in judged] == ["data"] * len(steps)


def test_exception_propagates_unchanged_and_run_is_closed(tmp_path):
    class Boom(RuntimeError):
        pass

    err = Boom("loss is NaN")
    agent = _agent(tmp_path)
    with pytest.raises(Boom) as info, agent:

        def fail(i):
            if i == 4:
                raise err

        _train(agent, 10, on_step=fail)
    assert info.value is err
    rd = rundir.RunDir(agent.run_dir)
    assert rd.rank_info(0)["status"] == "failed" and "loss is NaN" in rd.rank_info(0)["error"]
    assert rd.manifest()["status"] == "failed"
    assert [s.step for s in rd.steps(0)] == list(range(5))
    assert not list((agent.run_dir / "rank-00000" / "traces").glob(".*tmp"))


def test_keyboard_interrupt_leaves_a_reportable_run(tmp_path):
    agent = _agent(tmp_path)
    with pytest.raises(KeyboardInterrupt), agent:

        def interrupt(i):
            if i == 5:
                raise KeyboardInterrupt

        _train(agent, 20, on_step=interrupt)
    rd = rundir.RunDir(agent.run_dir)
    assert rd.rank_info(0)["status"] == "interrupted" and rd.manifest()["status"] == "interrupted"
    doc = analyze_run(agent.run_dir)
    assert [s["step"] for s in ranks_of(doc)[0]["steps"]] == list(range(6))
    assert doc.errors == []
    from diag.report import write_report

    paths = write_report(agent.run_dir, tmp_path / "report")
    assert os.path.getsize(paths["html"]) > 0


def test_profiler_failing_to_start_does_not_stop_training(tmp_path, monkeypatch):
    from torch.profiler import profile

    def refuse(self):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES: profiling is not permitted")

    monkeypatch.setattr(profile, "start_trace", refuse)
    with _agent(tmp_path) as agent:
        model = _train(agent, 12)
    assert model is not None
    rd = rundir.RunDir(agent.run_dir)
    assert len(rd.steps(0)) == 12 and rd.windows(0) == [] and rd.traces(0) == []
    assert any("profiling switched off" in m for m in _events(agent.run_dir))
    assert rd.rank_info(0)["collectors"]["profiler"] is False
    assert not any(s.profiled for s in rd.steps(0))


def test_nvml_raising_and_amdsmi_missing_training_goes_on(tmp_path, monkeypatch):
    # The real pynvml over a driver library whose nvmlInit fails (only the C layer is fake).
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    fake.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # not installed
    with _agent(tmp_path, device=0, profile=False, sample_interval_s=0.1) as agent:
        _train(agent, 6, sleep_s=0.05)
    rd = rundir.RunDir(agent.run_dir)
    assert len(rd.steps(0)) == 6 and rd.rank_info(0)["status"] == "completed"
    events = " ".join(_events(agent.run_dir))
    assert "nvml" in events and "Driver Not Loaded" in events
    samples = rd.samples(0)
    assert samples and all(s["gpu"] is None and s["host"] for s in samples)
    assert fake.calls["nvmlInitWithFlags"] >= 1  # the real wrapper reached the "driver"


def test_nvml_device_calls_raising_training_goes_on(tmp_path, monkeypatch):
    # One GPU that falls off the bus: every device query of the driver answers GPU_IS_LOST.
    fake = FakeNvml([FakeNvidiaGpu(uuid="GPU-lost")])
    fake.failing = {name[2:]: pynvml.NVML_ERROR_GPU_IS_LOST for name in dir(fake)
                    if name.startswith("c_nvmlDeviceGet") and name != "c_nvmlDeviceGetCount_v2"}
    fake.install(monkeypatch)
    with _agent(tmp_path, device=0, profile=False, sample_interval_s=0.1) as agent:
        _train(agent, 6, sleep_s=0.05)
    rd = rundir.RunDir(agent.run_dir)
    assert len(rd.steps(0)) == 6 and rd.rank_info(0)["status"] == "completed"
    events = " ".join(_events(agent.run_dir))
    assert "nvml" in events.lower() and "GPU is lost" in events, events
    assert sum(n for name, n in fake.calls.items() if name in fake.failing) >= 1
    assert all(s["gpu"] is None for s in rd.samples(0))


def test_on_demand_window_by_trigger_file_and_signal(tmp_path):
    with _agent(tmp_path, skip_first=1000) as agent:

        def poke(i):
            if i == 1:
                (agent.run_dir / "profile.trigger").write_text("")
            if i == 30:
                os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.06)  # the agent polls the trigger once a second

        _train(agent, 90, on_step=poke)
    windows = rundir.RunDir(agent.run_dir).windows(0)
    assert len(windows) == 2, windows
    assert all(w.last_step - w.first_step == 1 for w in windows)
    assert 1 < windows[0].first_step < 30 < windows[1].first_step < 90
    # Ranks agree on the on-demand step through the O_EXCL file named after the trigger.
    agreed = sorted(int(p.read_text()) for p in agent.run_dir.glob(".profile-trigger-*.step"))
    assert agreed == [w.first_step for w in windows]
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # handler restored


def test_trace_budget_deletes_oldest(tmp_path):
    # Analysis deferred to exit: every trace waits for it while newer ones are saved.
    with _agent(tmp_path, every=4, trace_budget_bytes=1, analyse_during_run=False) as agent:
        # Each window's export finishes before the next window starts (steps here take a
        # millisecond; a window that starts while the previous one exports is skipped).
        _train(agent, 20, on_step=lambda i: agent.windows.wait_exported(30.0))
    rd = rundir.RunDir(agent.run_dir)
    windows = rd.windows(0)
    # Every window was analysed: the budget spares traces whose analysis is still pending.
    assert [w.first_step for w in windows] == [3, 7, 11, 15, 19]
    assert all(isinstance(w.analysis, dict) for w in windows), [w.error for w in windows]
    traces = rd.traces(0)
    assert [p.name for p in traces] == [windows[-1].trace]  # only the newest is kept
    assert any("deleted" in m for m in _events(agent.run_dir))


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, torch, diag
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    with diag.Agent(run_dir=sys.argv[1], export=False, skip_first=2, every=5, active=2, report_wait_s=1) as agent:
        for x in agent.loader([torch.randn(16, 64) for _ in range(40)]):
            loss = model(x).sum(); opt.zero_grad(); loss.backward(); opt.step()
            agent.step()
            done += 1
    print("trained", done, "steps")
    """
)


def test_disk_full_stops_writing_and_training_continues(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_FSIZE_SCRIPT)
    # 2 KB per file: rank.json and small segments fit at first, traces and later writes do not.
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "2048"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trained 40 steps" in proc.stdout
    assert "stops writing" in proc.stderr or "profiling switched off" in proc.stderr, proc.stderr[-2000:]


def test_unwritable_run_dir_training_continues(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with _agent(tmp_path, run_dir=blocker / "run", verbose=True) as agent:
        _train(agent, 12)
    assert agent.writer is not None and not agent.writer.enabled
    assert agent.step_number == 12


def test_window_left_unanalysed_at_exit_is_analysed_offline(tmp_path):
    # No time for the background analysis at exit: the traces stay, their summaries do not.
    with _agent(tmp_path, analysis_wait_s=0) as agent:
        _train(agent, 8)
    rd = rundir.RunDir(agent.run_dir)
    assert rd.traces(0) and rd.windows(0) == []
    doc = analyze_run(agent.run_dir)
    steps = {s["step"]: s for s in ranks_of(doc)[0]["steps"]}
    assert {n for n, s in steps.items() if s["evidence"] == "trace"} == {3, 4}
    assert steps[7]["evidence"] == "sampled" and steps[7]["bound"] in BOUNDS
    assert ranks_of(doc)[0]["evidence"]["windows"][0]["first_step"] == 3


class _Writes:
    """Stands in for a stopped torch profiler: export_chrome_trace is all the writer calls."""

    def __init__(self, action):
        self.action = action

    def export_chrome_trace(self, path):
        self.action(path)


def test_a_trace_is_written_by_a_child_that_fails_or_hangs_visibly(tmp_path):
    from pathlib import Path

    from diag.collectors.trace_export import ExportFailed, write_in_child

    out = tmp_path / "t.json"
    fork_s, write_s = write_in_child(_Writes(lambda p: (time.sleep(0.2), Path(p).write_text("{}"))), out)
    assert out.read_text() == "{}"
    assert 0 < fork_s < 20 and 0.2 <= write_s < 20  # the child timed its own write

    def refuse(path):
        raise OSError(28, "No space left on device")

    with pytest.raises(ExportFailed, match="exited with 1"):
        write_in_child(_Writes(refuse), tmp_path / "full.json")
    t0 = time.monotonic()
    with pytest.raises(ExportFailed, match="did not finish in 1 s"):
        write_in_child(_Writes(lambda p: time.sleep(60)), tmp_path / "stuck.json", timeout_s=1.0)
    assert time.monotonic() - t0 < 10  # killed, not waited for


@pytest.mark.parametrize("in_child", [True, False])
def test_windows_are_written_by_a_child_or_a_thread(tmp_path, in_child):
    with _agent(tmp_path, export_in_child=in_child) as agent:
        # Steps of 50 ms: the first trace is usually written before the second window starts.
        _train(agent, 12, sleep_s=0.05)
    rd = rundir.RunDir(agent.run_dir)
    windows = [(w.first_step, w.last_step) for w in rd.windows(0)]
    # On a loaded machine the second window may come while the first is still being written:
    # it is then skipped, and says so.
    assert windows == [(3, 4), (9, 10)] or (
        windows == [(3, 4)] and any("still exporting; window skipped" in m for m in _events(agent.run_dir)))
    import gzip
    import json

    for trace, (first, _) in zip(rd.traces(0), windows):
        with gzip.open(trace, "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert f"ProfilerStep#{first}" in names
    assert not any("failed" in m for m in _events(agent.run_dir))


def test_the_trace_goes_where_it_stalls_training_least():
    from diag.collectors.trace_export import ExportRoute

    route = ExportRoute(child_allowed=True)
    assert route.use_child()  # the first window: a child, which measures both costs
    route.wrote(1.4, fork_s=0.03)  # a large trace: the child's write stands for a thread's stall
    assert route.use_child()
    route.wrote(0.01, fork_s=0.03)  # small traces: a thread's write is shorter than a fork
    assert not route.use_child()
    route.wrote(0.2)  # written by a thread, and it grew
    assert route.use_child()
    assert not ExportRoute(child_allowed=False).use_child()


def test_a_failing_child_hands_the_trace_to_a_thread_and_logs_once(tmp_path, monkeypatch):
    from diag.collectors import profiler_windows as pw

    def refuse(prof, path, timeout_s=0):
        path.write_text("partial")  # what a child killed mid-write leaves
        raise pw.ExportFailed("the process writing the trace exited with 1")

    monkeypatch.setattr(pw, "write_in_child", refuse)
    with _agent(tmp_path) as agent:
        _train(agent, 12, sleep_s=0.05)
    rd = rundir.RunDir(agent.run_dir)
    assert [(w.first_step, w.last_step) for w in rd.windows(0)] == [(3, 4), (9, 10)]
    assert all(p.stat().st_size > 100 for p in rd.traces(0))  # whole traces, not the child's leftovers
    events = _events(agent.run_dir)
    assert sum("from a child process failed" in m for m in events) == 1
    assert not any("profiling switched off" in m for m in events)
