"""The agent's links to the exporter, the run directory's record of the process group, the
report's NCCL inputs after `diag run`, the per-step verdicts of long runs, and the text
summary of `diag analyze`."""

from __future__ import annotations

import bisect
import json
import random
import re
import shutil
import socket
import time
import urllib.request

import pytest
import torch

import diag
from diag import atomic_io, rundir, segments
from diag.analyzers.analysis_types import judged_steps, trace_facts_from_document
from diag.analyzers.diagnosis.decision_tree import load_tree, verdict_from
from diag.analyzers.diagnosis.rank import judge_run_rank
from diag.analyzers.job.run_analysis import analyze_rank
from diag.analyzers.job.sampled import step_measurements, window_composition
from diag.commands.analyze import format_summary
from diag.exporter.registry import render_text


def _train(agent, steps, on_step=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i, x in enumerate(agent.loader([torch.randn(16, 64) for _ in range(steps)])):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        agent.step(samples=16)
        if on_step is not None:
            on_step(i)


def _agent(tmp_path, **kw):
    opts = dict(run_dir=tmp_path / "run", export=False, profile=False, report_wait_s=5, verbose=False,
                report=False, nccl_log=False)
    opts.update(kw)
    return diag.Agent(**opts)


def _metric(text: str, name: str) -> list[tuple[str, float]]:
    return [(m.group(1) or "", float(m.group(2)))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


# -- an exception in the training loop ------------------------------------------------------


def test_out_of_memory_in_the_loop_is_an_event_and_counted(tmp_path):
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total)")
    agent = _agent(tmp_path, export=True, export_port_base=0, export_bind="127.0.0.1")

    def fail(i):
        if i == 3:
            assert _metric(_scrape(agent.exporter.port), "diag_oom_errors_total")[0][1] == 0.0
            raise err

    with pytest.raises(torch.OutOfMemoryError) as info, agent:
        _train(agent, 8, on_step=fail)
    assert info.value is err
    events = [e for e in rundir.RunDir(agent.run_dir).events(0) if e.get("exception")]
    assert len(events) == 1, events
    ev = events[0]
    assert ev["level"] == "error" and ev["exception"] == "OutOfMemoryError"
    assert ev["error"].startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "OutOfMemoryError: CUDA out of memory" in ev["message"]
    # The event reached the exporter before it closed: the OOM counter went up once.
    text = render_text([agent.exporter.state]).decode()
    assert [v for _, v in _metric(text, "diag_oom_errors_total")] == [1.0]


def test_an_ordinary_exception_is_an_event_but_no_oom(tmp_path):
    agent = _agent(tmp_path, export=True, export_port_base=0, export_bind="127.0.0.1")

    def fail(i):
        if i == 2:
            raise ValueError("loss is NaN")

    with pytest.raises(ValueError), agent:
        _train(agent, 5, on_step=fail)
    events = [e for e in rundir.RunDir(agent.run_dir).events(0) if e.get("exception")]
    assert [(e["exception"], e["error"]) for e in events] == [("ValueError", "loss is NaN")]
    text = render_text([agent.exporter.state]).decode()
    assert [v for _, v in _metric(text, "diag_oom_errors_total")] == [0.0]


def test_a_framework_callback_closing_with_the_error_text_is_counted_too(tmp_path):
    # Lightning's on_exception closes the agent with "TypeName: text" instead of leaving a `with`.
    agent = _agent(tmp_path, export=True, export_port_base=0, export_bind="127.0.0.1").start()
    _train(agent, 3)
    agent.close("failed", "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")
    events = [e for e in rundir.RunDir(agent.run_dir).events(0) if e.get("exception")]
    assert [(e["exception"], e["error"]) for e in events] == [
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB")]
    text = render_text([agent.exporter.state]).decode()
    assert [v for _, v in _metric(text, "diag_oom_errors_total")] == [1.0]


# -- NCCL results reach the exporter while the job runs -----------------------------------------


def test_nccl_bench_and_nccl_logs_reach_the_exporter(tmp_path, real_nccl):
    log = sorted(real_nccl.glob("nccllog_*.txt"))[0]
    agent = _agent(tmp_path, export=True, export_port_base=0, export_bind="127.0.0.1")
    bench = {"schema": "diag.nccl_bench/1", "tests": [
        {"collective": "all_reduce", "world_size": 2, "backend": "nccl", "rows": [], "avg_busbw_gbps": 12.5,
         "status": "ok", "errors": []}]}
    seen: dict = {}

    def step(i):
        if i == 1:
            atomic_io.atomic_write_json(agent.run_dir / "nccl_bench.json", bench)
            shutil.copy(log, agent.writer.rank_path / rundir.NCCL / "nccl.host.1234.log")
        if i == 2:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                text = _scrape(agent.exporter.port)
                seen["bw"] = _metric(text, "diag_nccl_bus_bandwidth_bytes_per_second")
                seen["obs"] = [v for labels, v in _metric(text, "diag_exporter_observations_total")
                               if 'kind="nccl"' in labels]
                if seen["bw"] and seen["obs"] and seen["obs"][0] >= 2:
                    break
                time.sleep(0.2)
            # A rewrite with a new figure is handed on again.
            bench["tests"][0]["avg_busbw_gbps"] = 20.0
            time.sleep(0.05)
            atomic_io.atomic_write_json(agent.run_dir / "nccl_bench.json", bench)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                seen["bw2"] = _metric(_scrape(agent.exporter.port), "diag_nccl_bus_bandwidth_bytes_per_second")
                if seen["bw2"] and seen["bw2"][0][1] == 20e9:
                    break
                time.sleep(0.2)

    with agent:
        (agent.writer.rank_path / rundir.NCCL).mkdir(parents=True, exist_ok=True)
        _train(agent, 4, on_step=step)
    assert [v for labels, v in seen["bw"] if 'collective="all_reduce"' in labels] == [12.5e9]
    assert seen["obs"] and seen["obs"][0] >= 2  # the benchmark document and the parsed log
    assert seen["bw2"][0][1] == 20e9


# -- the process group in rank.json and the manifest ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backend_and_world_size_of_the_process_group_are_recorded(tmp_path):
    import torch.distributed as dist

    agent = _agent(tmp_path)
    with agent:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        _train(agent, 3)
    dist.destroy_process_group()
    rd = rundir.RunDir(agent.run_dir)
    assert rd.rank_info(0)["backend"] == "gloo" and rd.rank_info(0)["world_size"] == 1
    assert rd.manifest()["backend"] == "gloo" and rd.manifest()["world_size"] == 1


def test_no_process_group_records_no_backend(tmp_path):
    with _agent(tmp_path) as agent:
        _train(agent, 3)
    rd = rundir.RunDir(agent.run_dir)
    assert rd.rank_info(0)["backend"] is None and rd.manifest()["backend"] is None


# -- the report reads the NCCL logs `diag run` leaves -----------------------------------------------


def _small_run(tmp_path):
    with _agent(tmp_path) as agent:
        _train(agent, 3)
    return agent.run_dir


def test_report_reads_nccl_logs_from_the_run_folder_and_the_saved_document(tmp_path, real_nccl):
    from diag.analyzers.nccl import log as nccl_log
    from diag.report.load import load_run

    log = sorted(real_nccl.glob("nccllog_*.txt"))[0]
    expected = nccl_log.parse_files([str(log)])
    assert expected.get("nccl_version") or expected.get("transports") or expected.get("findings")

    run_dir = _small_run(tmp_path)
    (run_dir / "nccl").mkdir()
    shutil.copy(log, run_dir / "nccl" / "nccl.host.1.log")
    # A stale saved document is ignored while the raw logs are there: they are re-parsed.
    atomic_io.atomic_write_json(run_dir / "nccl_log.json", {"schema": "diag.nccl_log/1", "nccl_version": "stale"})
    _, run = load_run(run_dir)
    assert run.nccl_log is not None
    assert run.nccl_log["nccl_version"] == expected["nccl_version"]
    assert run.nccl_log["transports"] == expected["transports"]

    # Only the saved document (the raw logs deleted to save space): it is used as it is.
    shutil.rmtree(run_dir / "nccl")
    atomic_io.atomic_write_json(run_dir / "nccl_log.json", json.loads(json.dumps(expected)))
    _, run = load_run(run_dir)
    assert run.nccl_log == json.loads(json.dumps(expected))

    # A foreign file in its place is named as a problem, and the report goes on.
    atomic_io.atomic_write_json(run_dir / "nccl_log.json", {"schema": "something/else"})
    _, run = load_run(run_dir)
    assert run.nccl_log is None
    assert any("nccl_log.json: not a diag.nccl_log document" in p for p in run.problems)


# -- per-step verdicts of a long run: the batched path gives the per-step answers ------------------


def _reference_steps(rd, rank, tree) -> list[tuple]:
    """Each sampled step's (bound, shares, path) as the step-by-step evaluation gives them."""
    records = sorted(rd.steps(rank), key=lambda r: r.step)
    windows = sorted(rd.windows(rank), key=lambda w: w.first_step)
    traced = {s["step"] for w in windows for s in w.analysis["steps"]}
    comps = [(w.first_step, window_composition(trace_facts_from_document(w.analysis))) for w in windows]
    comps = [(f, c) for f, c in comps if c is not None]
    starts = [f for f, _ in comps]
    samples = sorted(rd.samples(rank), key=lambda s: s["t"])
    times = [s["t"] for s in samples]
    out, last = [], None
    for rec in records:
        if rec.step in traced:
            continue
        i = bisect.bisect_right(starts, rec.step) - 1
        comp = comps[i][1] if i >= 0 else (comps[0][1] if comps else None)
        mid = (rec.start_unix or 0.0) + (rec.duration_s or 0.0) / 2
        sample = None
        if times:
            j = bisect.bisect_left(times, mid)
            best = min((k for k in (j - 1, j) if 0 <= k < len(times)), key=lambda k: abs(times[k] - mid))
            sample = samples[best] if abs(times[best] - mid) <= 5.0 else None
        shares, m = step_measurements(rec, sample, comp)
        v = verdict_from(m, tree) if m else {"bound": None, "path": []}
        sig = tuple((p["node"], p["answer"]) for p in v["path"])
        out.append((rec.step, v["bound"], shares, v["path"] if sig != last else []))
        last = sig
    return out


def _varied_run(root, seed: int):
    """One rank with every case the sampled verdict meets: with and without data wait, device
    utilisation, samples nearby, a window composition; odd records; utilisation near the tree's
    thresholds, so paths change often."""
    rng = random.Random(seed)
    t0 = 1_700_000_000.0
    atomic_io.atomic_write_json(root / rundir.MANIFEST, {"schema": rundir.RUN_SCHEMA, "world_size": 1,
                                                       "status": "completed", "started_unix": t0})
    rp = root / rundir.rank_dir_name(0)
    atomic_io.atomic_write_json(rp / rundir.RANK_FILE, {"schema": rundir.RANK_SCHEMA, "rank": 0, "world_size": 1,
                                                     "status": "completed"})
    w = segments.SegmentWriter(rp / "steps", "steps", flush_records=10_000, flush_seconds=1e9)
    t = t0
    for s in range(600):
        d = rng.choice([0.1, 0.1, 0.2, 0.05])
        rec = {"step": s, "start_unix": t, "duration_s": d, "data_wait_s": d * rng.choice([0.0, 0.05, 0.3, 0.6]),
               "samples": 8}
        if s % 17 == 0:
            rec["data_wait_s"] = None
        elif s % 5 == 0:  # the device clock measured the idle part of the wait
            rec["data_idle_s"] = rec["data_wait_s"] * rng.choice([0.0, 0.5, 1.0])
        elif s % 7 == 0:
            rec["data_idle_s"] = float("nan")
        if s == 50:
            rec["duration_s"] = 0.0
        if s == 51:
            rec["duration_s"] = None
        if s == 52:
            rec["data_wait_s"] = True
        w.write(rec)
        t += d if s % 97 else d + 30.0  # gaps with no sample within 5 s
    w.flush()
    sw = segments.SegmentWriter(rp / "samples", "samples", flush_records=10_000, flush_seconds=1e9)
    for i in range(int(t - t0)):
        gpu = {"utilization_ratio": rng.choice([0.2, 0.45, 0.5, 0.55, 0.9, 1.0])} if i % 40 < 30 else None
        if i % 40 == 35:
            gpu = {"utilization_ratio": float("nan")}
        sw.write({"t": t0 + i + 0.5 * rng.random(), "gpu": gpu, "host": {}})
    sw.flush()
    for first, mem, comm, bw in ((20, 0.5, 0.1, None), (300, 0.1, 0.4, 0.85)):
        sh = {"data": 0.05, "host": 0.05, "comm": comm, "memory": mem, "compute": 0.9 - comm - mem}
        analysis = {"rank": 0, "bound": "compute", "findings": [], "collectives": [],
                    "steps": [{"step": k, "duration_ms": 100.0, "bound": "compute", "shares": sh, "path": [],
                               "evidence": "trace"} for k in range(first, first + 3)],
                    "measurements": {"achieved_bw_frac": bw} if bw is not None else {}}
        atomic_io.atomic_write_json(rp / rundir.WINDOWS / f"window-{first:06d}.json",
                                 {"first_step": first, "last_step": first + 2, "trace": "x", "analysis": analysis})


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_sampled_verdicts_equal_the_per_step_ones(tmp_path, seed):
    _varied_run(tmp_path, seed)
    tree = load_tree()
    rd = rundir.RunDir(tmp_path)
    facts, inputs = analyze_rank(rd, 0, tree.facts)
    got = judge_run_rank(facts, inputs.windows, inputs.sampled, tree)
    sampled = [(s["step"], s["bound"], s["shares"], s["path"]) for s in judged_steps(got) if s["evidence"] == "sampled"]
    expected = _reference_steps(rd, 0, tree)
    assert len(sampled) == 594
    assert json.dumps(sampled) == json.dumps(expected)
    assert not any(v != v for s in sampled if s[2] for v in s[2].values())  # a NaN reading is no reading
    # The cases were all met: paths changed many times, some steps have no verdict or no shares.
    assert sum(1 for s in sampled if s[3]) > 20
    assert {s[1] for s in sampled} >= {None, "data", "host"}
    assert any(s[2] is None for s in sampled) and any(s[2] is not None for s in sampled)


# -- `diag analyze` prints each measurement in its own unit -------------------------------------------


def test_analyze_summary_prints_ratios_as_ratios_and_shares_as_percentages():
    path = [
        {"node": "a", "question": "Waits for data?", "metric": "data_share", "value": 0.022, "op": ">=",
         "threshold": 0.2, "answer": "no"},
        {"node": "b", "question": "Bandwidth over compute?", "metric": "memory_to_compute", "value": 0.193,
         "op": ">", "threshold": 1.0, "answer": "no"},
        {"node": "c", "question": "Only bandwidth?", "metric": "memory_to_compute", "value": float("inf"),
         "op": ">", "threshold": 1.5, "answer": "yes"},
        {"node": "d", "question": "Achieved bandwidth?", "metric": "achieved_bw_frac", "value": None,
         "op": ">=", "threshold": 0.8, "answer": "unknown"},
    ]
    doc = {"ranks": [{"rank": 0, "bound": "compute", "device": "CPU", "source": "x", "path": path,
                      "shares": {}, "steps": []}], "job": {}, "errors": []}
    text = format_summary(doc)
    assert "(measured 2.2%, threshold >= 20%)" in text
    assert "(measured 0.19x, threshold > 1x)" in text
    assert "(measured inf, threshold > 1.5x)" in text
    assert "(measured unknown, threshold >= 80%)" in text
    doc["ranks"][0]["bound"] = None
    assert "NO VERDICT" in format_summary(doc)


# -- a run that ends while a profiler window warms up ------------------------------------------------


def test_a_run_ending_during_a_window_warmup_leaves_no_torch_warning(tmp_path, capfd):
    # Windows: warm-up at step 2, steps 3-4 traced; the next warm-up at step 7, where the run ends.
    with _agent(tmp_path, profile=True, skip_first=2, warmup=1, active=2, every=5) as agent:
        def settle(_step):
            # Steps of this tiny model take a millisecond: let the first window's export finish,
            # or the profiler rightly skips the next window (a trace still being written).
            t = agent.windows._export_thread
            if t is not None:
                t.join(60)

        _train(agent, 7, on_step=settle)
        assert agent.windows._prof is not None and not agent.windows.recording  # warming up
    err = capfd.readouterr().err
    assert "disableProfiler" not in err and "no active profiling session" not in err, err
    traces = sorted(p.name for p in (agent.run_dir / "rank-00000" / "traces").iterdir())
    assert traces == ["window-000003.pt.trace.json.gz"]  # the warm-up left no trace


def test_the_text_summary_says_a_straggler_in_words_not_json():
    doc = {"ranks": [{"rank": 0, "bound": "comm", "device": "CPU", "source": "x", "path": [], "shares": {},
                      "steps": []}],
           "job": {"bound": "comm", "stragglers": [{"rank": 1, "message": "Rank 1 is late: its peers wait 9 ms.",
                                                    "evidence": {"basis": "collectives", "blame_share": 0.9}}]},
           "errors": []}
    text = format_summary(doc)
    assert "straggler: Rank 1 is late: its peers wait 9 ms." in text and '"basis"' not in text
