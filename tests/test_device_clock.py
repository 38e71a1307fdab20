"""Device step time and the device's idle time within data waits, from timing events
(collectors/device_clock.py), on simulated device timelines and a recorded GPU trace; and
the sampled verdicts that count a data wait as data only where the device was idle."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fake_device import FakeDevice, VirtualClock
from rank_documents import trace_rank

from diag import Agent, rundir, segments
from diag.analyzers import intervals as iv
from diag.analyzers.job.sampled import sampled_shares, step_measurements
from diag.analyzers.trace.event_classes import is_data_annotation
from diag.analyzers.trace.load import load_trace, step_windows
from diag.collectors.device_clock import HOLD_S, DeviceClock, DeviceStep, HeldSteps
from diag.step_record import from_json_record

STEPS = 14
STEADY = slice(4, None)  # the first steps fill the device's queue


def _clock(device: FakeDevice, **kw) -> DeviceClock:
    return DeviceClock(lambda: device.event(enable_timing=True), **kw)


def _run(clock: DeviceClock, device: FakeDevice, wait_s: float, work_s: float, sync: bool) -> list[DeviceStep]:
    for step in range(STEPS):
        clock.data_begin()
        device.sleep(wait_s)  # the host waits for the next batch
        clock.data_end()
        device.launch(work_s)  # the step's kernels, queued
        if sync:
            device.synchronize()  # loss.item()
        clock.step_end(step)
    device.synchronize()
    done = clock.completed()
    assert [d.step for d in done] == list(range(STEPS))
    return done[STEADY]


def test_a_data_wait_behind_queued_device_work_is_no_idle_time():
    """The host waits 10 ms for data while the device still runs the 30 ms the host queued:
    the device never idles, and the step's device time is its work."""
    device = FakeDevice(queue_limit_s=0.04, clock=VirtualClock())
    for d in _run(_clock(device), device, wait_s=0.010, work_s=0.030, sync=False):
        assert d.data_idle_s == 0.0
        assert d.device_s == pytest.approx(0.030, abs=1e-9)


def test_a_data_wait_after_the_device_drained_is_all_idle_time():
    device = FakeDevice(clock=VirtualClock())
    for d in _run(_clock(device), device, wait_s=0.020, work_s=0.005, sync=True):
        assert d.data_idle_s == pytest.approx(0.020, abs=1e-9)


def test_a_data_wait_longer_than_the_queued_work_is_idle_for_the_difference():
    device = FakeDevice(clock=VirtualClock())
    for d in _run(_clock(device), device, wait_s=0.030, work_s=0.020, sync=False):
        assert d.data_idle_s == pytest.approx(0.010, abs=1e-9)


def _step_after_a_window(rebase: bool) -> float:
    """Device time of the step after a window's stop, which drains the queue and keeps the host
    busy 80 ms with the device idle."""
    device = FakeDevice(clock=VirtualClock())
    clock = _clock(device)
    for step in range(4):
        device.launch(0.020)
        clock.step_end(step)
        if step == 2:
            device.synchronize()  # stop_trace synchronises
            device.sleep(0.080)  # and collects the window's events on the host
            if rebase:
                clock.rebase()
    device.synchronize()
    return {d.step: d.device_s for d in clock.completed()}[3]


def test_the_step_after_a_window_stops_starts_its_device_time_after_the_stop():
    # The host timer leaves the stop out of the next step; so does the rebased device clock.
    assert _step_after_a_window(rebase=True) == pytest.approx(0.020, abs=1e-9)
    assert _step_after_a_window(rebase=False) > 0.090  # without it, the stop reads as device time


def test_a_failing_event_switches_the_clock_off_once_and_training_goes_on():
    logged = []
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("CUDA error: invalid device context")

    clock = DeviceClock(broken, log=logged.append)
    for step in range(5):
        clock.data_begin()
        clock.data_end()
        clock.step_end(step)
    assert clock.off and len(logged) == 1 and len(calls) == 1 and clock.completed() == []


def test_no_event_is_recorded_while_the_stream_is_captured_into_a_graph():
    device = FakeDevice()
    made = []
    clock = DeviceClock(lambda: made.append(1) or device.event(enable_timing=True), capturing=lambda: True)
    for step in range(3):
        clock.data_begin()
        clock.data_end()
        clock.step_end(step)
    assert made == [] and clock.completed() == []


def test_events_are_reused_once_read():
    device = FakeDevice()
    made = []
    clock = DeviceClock(lambda: made.append(1) or device.event(enable_timing=True))
    for step in range(50):
        clock.data_begin()
        clock.data_end()
        clock.step_end(step)
        device.synchronize()
        assert len(clock.completed()) == 1
    assert len(made) <= 6


def test_held_records_wait_for_their_device_times_at_most_hold_s():
    device = FakeDevice()
    clock = _clock(device)
    held = HeldSteps()
    device.launch(0.05)
    clock.step_end(0)
    held.add(0, "record 0", now=0.0)
    assert held.ready(clock, now=0.0) == []  # the device is still on step 0
    assert held.ready(clock, now=HOLD_S + 0.1) == [("record 0", None)]  # waited long enough
    device.synchronize()
    clock.step_end(1)
    device.synchronize()
    held.add(1, "record 1", now=10.0)
    (item, dev), = held.ready(clock, now=10.0)
    assert item == "record 1" and dev.step == 1
    held.add(2, "record 2", now=11.0)  # never measured: not held
    assert held.ready(clock, now=11.0) == [("record 2", None)]
    held.add(3, "record 3", now=12.0)
    assert held.ready(None, now=12.0) == [("record 3", None)]


# -- the sampled verdicts -----------------------------------------------------------------


def test_a_data_wait_counts_as_data_only_where_the_device_was_idle():
    # host waits 30% of the step for data while the device is busy all the time
    assert sampled_shares(1.0, 0.3, 1.0, None)[1]["data_share"] == 0.0
    assert sampled_shares(1.0, 0.3, None, None, data_idle_s=0.0)[1]["data_share"] == 0.0
    # ... while the device is idle
    assert sampled_shares(1.0, 0.3, 0.7, None)[1]["data_share"] == pytest.approx(0.3)
    assert sampled_shares(1.0, 0.3, None, None, data_idle_s=0.3)[1]["data_share"] == pytest.approx(0.3)
    # mixed: busy first, the wait within the idle rest
    _, m = sampled_shares(1.0, 0.3, 0.85, None)
    assert (m["data_share"], m["busy_share"], m["host_share"]) == pytest.approx((0.15, 0.85, 0.0))
    # the events measure the idle part; the utilisation gives the busy share beside it
    _, m = sampled_shares(1.0, 0.3, 0.85, None, data_idle_s=0.1)
    assert (m["data_share"], m["busy_share"], m["host_share"]) == pytest.approx((0.1, 0.85, 0.05))
    # no device: the host is the device, and the whole wait is data
    assert sampled_shares(1.0, 0.3, None, None)[1]["data_share"] == pytest.approx(0.3)


def test_a_record_with_device_times_is_measured_by_them():
    comp = {"non_data": dict.fromkeys(("host", "comm", "wait", "memory", "compute"), 0.2),
            "busy_split": {"comm": 0.0, "wait": 0.0, "memory": 0.0, "compute": 1.0}, "wait_measured": False,
            "achieved_bw_frac": None}
    rec = {"step": 0, "duration_s": 0.03, "data_wait_s": 0.01, "data_idle_s": 0.0005, "device_s": 0.03}
    shares, m = step_measurements(from_json_record(rec), None, comp)
    assert m["data_share"] == pytest.approx(0.0005 / 0.03) and shares["data"] == m["data_share"]
    failed = from_json_record({**rec, "data_idle_s": float("nan")})  # a failed reading is no reading
    assert failed.data_idle_s is None
    shares, m = step_measurements(failed, None, comp)
    assert m["data_share"] == pytest.approx(1 / 3)


def test_on_a_recorded_gpu_trace_the_events_measure_the_trace_paths_data_share(real_data):
    """What the events around each DataLoader wait would measure (the wait minus the device
    work beside it), fed to the sampled path, gives each step the trace path's data share;
    the utilisation alone gives at least it. Steps are the trace path's own windows."""
    path = real_data / "traces" / "v100_resnet50_workers0_oldschema.json.gz"
    trace, doc = load_trace(path), trace_rank(path)
    wanted = np.array([is_data_annotation(trace.names[i]) for i in trace.cpu_name], dtype=bool)
    waits = iv.normalize(np.column_stack([trace.cpu_ts[wanted], trace.cpu_ts[wanted] + trace.cpu_dur[wanted]]))
    device = iv.normalize(np.column_stack([trace.dev_ts, trace.dev_ts + trace.dev_dur]))
    traced = {s["step"]: s["shares"]["data"] for s in doc["steps"]}
    checked = 0
    for number, start, end in step_windows(trace):  # each step until the device ran what it launched
        dur = end - start
        if number not in traced:
            continue
        wait = iv.clip(waits, start, start + dur)
        busy = iv.total(iv.clip(device, start, start + dur)) / dur
        idle = iv.total(iv.subtract(wait, device))
        events = sampled_shares(dur, iv.total(wait), busy, None, data_idle_s=idle)[1]["data_share"]
        assert events == pytest.approx(traced[number], abs=1e-3)
        assert sampled_shares(dur, iv.total(wait), busy, None)[1]["data_share"] >= traced[number] - 1e-9
        checked += 1
    assert checked >= 4 and min(traced.values()) > 0.2  # a data-bound job: the shares are not zero


# -- the agent ------------------------------------------------------------------------------


def _batches(n: int, wait_s: float, device: FakeDevice):
    """Batches that keep the host waiting `wait_s` in real time, as the device's clock sees it too."""
    for i in range(n):
        time.sleep(wait_s)
        device.sleep(wait_s)
        yield i


def test_the_agent_records_device_times_and_the_run_analysis_uses_them(tmp_path):
    # The device keeps its own time: its work lasts exactly what was launched, however busy
    # the machine running the test; the agent's host timers run in real time.
    device = FakeDevice(queue_limit_s=0.04, clock=VirtualClock())
    agent = Agent(tmp_path / "run", export=False, profile=False, report=False, verbose=False)
    agent.start()
    assert agent.clock is None  # a CPU process: torch has no device
    agent.clock = _clock(device)
    for _ in agent.loader(_batches(30, 0.010, device)):
        device.launch(0.030)
        agent.step()
    device.synchronize()  # the device's time moves on to the end of its queued work
    agent.close()
    run = rundir.RunDir(tmp_path / "run")
    recs = list(segments.read_segment(next((run.rank_path(0) / "steps").glob("*.jsonl"))))
    steady = recs[6:]
    assert all(r["device_s"] == pytest.approx(0.030, abs=1e-9) for r in steady)
    assert all(r["data_idle_s"] == 0.0 and r["data_wait_s"] >= 0.010 for r in steady)
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.job.run_analysis import analyze_rank

    facts, _ = analyze_rank(run, 0, load_tree().facts)
    steps = [s for s in facts.steps if "data_idle_ms" in s]
    assert len(steps) == 30 and sum("device_ms" in s for s in steps) == 29  # the first has no start event
    # No utilisation and no window: the rank's data share is the measured idle time's.
    assert facts.measurements["data_share"] < 0.15 < 0.25 < np.mean(
        [s["data_wait_ms"] / s["duration_ms"] for s in steps])
    from diag.report import analyse_and_model
    from diag.report.markdown import render

    _, model = analyse_and_model(tmp_path / "run")
    stats = model["step_stats"]
    assert stats["device_steps"] == 29 and stats["device_median_ms"] == pytest.approx(30.0, abs=0.05)
    assert f"device {stats['device_median_ms']:.1f} ms" in render(model)



def test_a_host_that_runs_ahead_of_the_device_is_timed_at_the_devices_pace(tmp_path):
    """A loop that never waits for the device launches each step in microseconds while the
    device runs it in 14 ms, until the queue fills: the step is the device's 14 ms in the
    analysis and the report (the run's wall time), the host's own time kept beside it."""
    device = FakeDevice(queue_limit_s=10.0, clock=VirtualClock())  # the queue never fills: all ahead
    agent = Agent(tmp_path / "run", export=False, profile=False, report=False, verbose=False)
    agent.start()
    agent.clock = _clock(device)
    for _ in range(40):
        device.launch(0.014)
        agent.step()
    device.synchronize()
    agent.close()
    from diag.analyzers.diagnosis.decision_tree import load_tree
    from diag.analyzers.job.run_analysis import analyze_rank

    facts, _ = analyze_rank(rundir.RunDir(tmp_path / "run"), 0, load_tree().facts)
    paced = [s for s in facts.steps if "device_ms" in s]
    assert len(paced) == 39  # the first step has no start event
    assert all(s["duration_ms"] == pytest.approx(14.0, abs=1e-6) and s["host_ms"] < 14.0 for s in paced)
    from diag.report import analyse_and_model

    _, model = analyse_and_model(tmp_path / "run")
    assert model["step_stats"]["median_ms"] == pytest.approx(14.0, abs=1e-6)


def test_the_peak_memory_is_read_rarely_and_never_reset(monkeypatch):
    """The user's own peak (max_memory_allocated, the HF Trainer's tracker, Lightning's
    DeviceStatsMonitor) is the process's: diag reads it and resets nothing."""
    import torch

    from diag.collectors.step_timer import PEAK_READ_S, PeakMemory

    reads = []

    def reset(*a, **k):
        raise AssertionError("diag reset the user's peak memory statistics")

    def peak(device=None):
        reads.append(device)
        return 0 if len(reads) == 1 else 7 << 30

    for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True),
                        ("current_device", lambda: 3), ("max_memory_allocated", peak),
                        ("reset_peak_memory_stats", reset), ("reset_max_memory_allocated", reset)):
        assert hasattr(torch.cuda, name)  # the real API's names
        monkeypatch.setattr(torch.cuda, name, value)
    reader = PeakMemory()
    assert reader.read(0.0) is None  # 0: an allocator without the count (cudaMallocAsync)
    assert reader.read(PEAK_READ_S / 2) is None and len(reads) == 1  # not read again so soon
    assert reader.read(PEAK_READ_S) == 7 << 30 and reads == [3, 3]


# -- a GPU process's trace without its device events ----------------------------------------


def _stripped(real_data, tmp_path):
    """A real A100 trace with every kernel, memcpy and memset left out, as Nsight Systems
    holding CUPTI leaves torch.profiler's traces."""
    import gzip
    import json

    doc = json.loads(gzip.decompress((real_data / "traces" / "a100_2rank_nccl.json.gz").read_bytes()))
    device_cats = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in device_cats]
    path = tmp_path / "no_device_events.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_gpu_trace_without_device_events_is_marked_and_never_confident(real_data, tmp_path):
    import json
    import subprocess
    import sys

    path = _stripped(real_data, tmp_path)
    rank = trace_rank(path)
    assert rank["device_events_missing"] and rank["timeline"] == "cpu"
    assert "device_events_missing" in {f["id"] for f in rank["findings"]}
    from diag.analyzers.analysis_types import trace_facts_from_document
    from diag.analyzers.job.sampled import window_composition

    assert window_composition(trace_facts_from_document(rank)) is None  # left out of the sampled steps' composition
    out = subprocess.run([sys.executable, "-m", "diag", "analyze", str(path), "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    # No class from the host's time alone: no verdict, and said why (tests/test_evidence_gates.py).
    assert doc["diagnosis"]["bound"] is None and doc["diagnosis"]["confidence"]["level"] == "none"
    assert any("hold no device events" in r for r in doc["diagnosis"]["confidence"]["reasons"])
    # The untouched trace, and a CPU job's, are not marked.
    assert not trace_rank(real_data / "traces" / "a100_2rank_nccl.json.gz")["device_events_missing"]
    from conftest import FIXTURES

    assert not trace_rank(FIXTURES / "cpu_compute_rank0.pt.trace.json.gz")["device_events_missing"]


def test_the_gpu_acceptance_run_is_one_line_where_there_is_no_gpu():
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_acceptance.py")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "nothing to check" in out.stdout


def test_windows_record_the_device_only_once_the_job_has_initialised_it(monkeypatch):
    """A CPU job on a GPU node (the demo) starts no CUPTI and synchronises no GPU."""
    import torch
    from torch.profiler import ProfilerActivity

    from diag.collectors.profiler_windows import default_activities

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert default_activities() == [ProfilerActivity.CPU]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert default_activities() == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
