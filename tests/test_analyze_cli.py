"""`diag analyze` end to end: a real CPU torch.profiler run, real GPU traces, and bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time

import pytest
from rank_documents import ranks_of, trace_rank

from diag.analyzers.diagnosis.decision_tree import BOUNDS

RANK_KEYS = {"rank", "source", "device", "world_size", "bound", "steps", "gpu_time", "findings", "top_kernels",
             "top_ops", "collectives", "mfu", "fixes", "path"}
STEP_KEYS = {"step", "duration_ms", "bound", "shares", "path", "evidence"}
ACTIVE = 4


def diag(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "diag", "analyze", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A real CPU profile: tiny MLP, a DataLoader whose collate sleeps, shapes and FLOPs on."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    out = tmp_path_factory.mktemp("prof") / "worker0.pt.trace.json.gz"

    def slow_collate(batch):
        time.sleep(0.15)  # a decoding-heavy input pipeline with num_workers=0
        return torch.stack(batch)

    data = torch.utils.data.DataLoader(list(torch.randn(64 * (ACTIVE + 2), 128)), batch_size=64,
                                       collate_fn=slow_collate)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=ACTIVE, repeat=1),
                 record_shapes=True, with_flops=True,
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for x in data:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert out.exists()
    return out


@pytest.fixture
def calibrated() -> dict:
    """This host's peaks, measured briefly: what `diag calibrate` writes."""
    from diag import calibrate

    return calibrate.measure(seconds=0.3, matmul_n=128, stream_elems=1 << 18)


def test_cpu_profiler_run_end_to_end(cpu_trace, calibrated):
    r = trace_rank(cpu_trace, host_peaks=calibrated)
    assert set(r) >= RANK_KEYS
    assert r["timeline"] == "cpu" and r["device_info"]["type"] == "cpu" and r["device_info"]["peaks"]
    assert len(r["steps"]) == ACTIVE
    for s in r["steps"]:
        assert set(s) >= STEP_KEYS and s["evidence"] == "trace"
        assert sum(s["shares"].values()) == 1.0
        # The 150 ms collate dwarfs a tiny MLP step (even on a busy CI machine): the
        # DataLoader bounds every step, well past the tree's 20% data_wait threshold.
        assert s["shares"]["data"] > 0.3 and s["bound"] == "data", s["shares"]
    assert r["bound"] == "data"
    assert r["fixes"] and "num_workers" in r["fixes"][0]
    # FLOPs derived from the recorded shapes (linear layers forward and backward).
    assert r["mfu"] is not None and 0 < r["mfu"] < 1
    ops = {o["name"]: o for o in r["top_ops"]}
    assert "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__" not in ops  # annotations are not ops
    assert any(o["class"] == "compute" for o in r["top_ops"])
    assert r["gpu_time"]["idle_pct"] is None and r["top_kernels"] == []


def test_cli_json_document(cpu_trace, tmp_path):
    good = tmp_path / "rank-3.json.gz"
    good.write_bytes(cpu_trace.read_bytes())
    proc = diag("--json", good)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "diag.analysis/1"
    assert set(doc) >= {"ranks", "job", "errors"}
    (rank,) = doc["ranks"]
    assert rank["rank"] == 3  # no distributedInfo in a single-process run: rank from the file name
    assert rank["bound"] in BOUNDS and {"bound", "stragglers", "findings"} <= set(doc["job"])


def test_cli_thresholds_and_config(cpu_trace, tmp_path):
    proc = diag("--json", "--threshold", "data_wait=0.99", "--threshold", "device_busy=0.0", cpu_trace)
    assert proc.returncode == 0, proc.stderr
    rank = json.loads(proc.stdout)["ranks"][0]
    assert rank["bound"] != "data"
    assert rank["path"][0]["threshold"] == 0.99
    cfg = tmp_path / "diag.toml"
    cfg.write_text("[thresholds]\ndata_wait = 0.95\n")
    rank = json.loads(diag("--json", "--config", cfg, cpu_trace).stdout)["ranks"][0]
    assert rank["path"][0]["threshold"] == 0.95
    bad = diag("--threshold", "no_such_threshold=1", cpu_trace)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("diag: error:") and "no_such_threshold" in bad.stderr


def test_cli_text_summary(cpu_trace):
    proc = diag(cpu_trace)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "DATA-BOUND" in out and "Does the step wait for data" in out and "threshold >= 20%" in out
    assert "job: DATA-BOUND" in out


def test_the_job_lines_show_the_diagnosis_findings():
    """One rank of a world of two: the job's lines carry the diagnosis's missing-rank warning."""
    from conftest import FIXTURES

    proc = diag(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz")
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split("\njob: ", 1)[1]
    assert "[warning] 1 of 2 ranks left no data (rank 1); the job analysis rests on the other ranks." in job


# --- bad input --------------------------------------------------------------------------


def _bad_files(tmp_path, cpu_trace):
    data = cpu_trace.read_bytes()
    raw = gzip.decompress(data)
    files = {}
    (tmp_path / "truncated.json.gz").write_bytes(data[: len(data) // 2])
    files["truncated.json.gz"] = "truncated gzip"
    corrupt = bytearray(data)
    for i in range(30, 400):
        corrupt[i] ^= 0xA5
    (tmp_path / "corrupt.json.gz").write_bytes(bytes(corrupt))
    files["corrupt.json.gz"] = "gzip"
    (tmp_path / "truncated.json").write_bytes(raw[: len(raw) // 2])
    files["truncated.json"] = "truncated"
    (tmp_path / "notatrace.json").write_text(json.dumps({"loss": [1.0, 0.5], "epoch": 3}))
    files["notatrace.json"] = "not a Kineto trace"
    (tmp_path / "noevents.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": []}))
    files["noevents.json"] = "no events"
    return files


def test_each_bad_file_is_one_line_and_exit_2(tmp_path, cpu_trace):
    for name, problem in _bad_files(tmp_path, cpu_trace).items():
        proc = diag(tmp_path / name)
        assert proc.returncode == 2, (name, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, (name, proc.stderr)
        assert lines[0].startswith(f"diag: error: {tmp_path / name}: "), lines[0]
        assert problem in lines[0], (name, lines[0])
        assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_empty_directory_and_missing_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = diag(empty)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"diag: error: {empty}: directory holds no trace files (*.json, *.json.gz)"]
    proc = diag(tmp_path / "nope.json")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such file" in proc.stderr


def test_bad_files_do_not_stop_the_good_ones(tmp_path, cpu_trace):
    bad = _bad_files(tmp_path, cpu_trace)
    d = tmp_path / "job"
    d.mkdir()
    for i, name in enumerate(bad):
        (tmp_path / name).rename(d / f"rank-{i + 1}_{name}")
    (d / "rank-0.json.gz").write_bytes(cpu_trace.read_bytes())
    proc = diag("--json", "--jobs", "2", d)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0]
    assert len(doc["errors"]) == len(bad)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("diag: error:")]
    assert len(errors) == len(bad)
    assert all(str(d) in ln for ln in errors)


def test_missing_distributed_info_is_named(tmp_path, cpu_trace):
    # Two traces of a job without distributedInfo or a rank in their names: analysed,
    # ranks assigned by order, and one warning line per file says so.
    d = tmp_path / "job"
    d.mkdir()
    for name in ("a.json.gz", "b.json.gz"):
        (d / name).write_bytes(cpu_trace.read_bytes())
    proc = diag("--json", "--jobs", "1", d)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["rank"] for r in json.loads(proc.stdout)["ranks"]) == [0, 1]
    warn = [ln for ln in proc.stderr.splitlines() if "no distributedInfo" in ln]
    assert len(warn) == 2 and all(ln.startswith("diag: warning: ") for ln in warn)


@pytest.mark.slow
def test_real_traces_directory(real_traces):
    """The shared folder holds traces of four jobs (their distributedInfo: world sizes 1, 2 and
    128, and none): refused as one, with each job's files named; each job analysed on its own."""
    from diag.analyzers.analyze import analyze_paths

    proc = diag("--json", "--jobs", "2", real_traces, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert ("world size 1 (v100_1rank_compute.json.gz); world size 2 (a100_2rank_nccl.json.gz); world size 128 "
            "(job128_rank0_sampled.json.gz, job128_rank1_sampled.json.gz)") in proc.stderr, proc.stderr
    pair = analyze_paths([real_traces / "job128_rank0_sampled.json.gz", real_traces / "job128_rank1_sampled.json.gz"],
                         jobs=2)
    assert pair.errors == [] and [r["rank"] for r in ranks_of(pair)] == [0, 1]
    for name, bound in (("v100_1rank_compute.json.gz", "compute"), ("v100_resnet50_workers0_oldschema.json.gz", "data"),
                        ("a100_2rank_nccl.json.gz", None), ("mi250_rocm62_tiny.json.gz", None)):
        (r,) = ranks_of(analyze_paths([real_traces / name], jobs=1))
        assert set(r) >= RANK_KEYS and r["gpu_time"]["idle_pct"] is not None
        assert all(set(s) >= STEP_KEYS for s in r["steps"])
        assert bound is None or r["bound"] == bound


def test_report_hook(tmp_path, cpu_trace):
    from diag import report

    assert callable(report.write_report_from_analysis)
    out = tmp_path / "report"
    proc = diag("--report", out, cpu_trace)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) >= ["report.html", "report.md"]
    # It says where the report went, on stderr (stdout may be the analysis's JSON).
    assert f"Report: {out / 'report.html'}" in proc.stderr and str(out / "report.md") in proc.stderr
    assert "Where each step's time goes" in (out / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("name, rank", [
    ("rank-3.json.gz", 3), ("rank3.pt.trace.json", 3), ("trainer_3.pt.trace.json", 3), ("RANK_07.json", 7),
    # torch's default "<host>_<pid>.<time>.pt.trace.json": the pid is not a rank.
    ("host_12345.1700000000123.pt.trace.json", None), ("worker0.1623143566756.pt.trace.json.gz", None),
])
def test_rank_from_file_name(name, rank):
    from diag.analyzers.trace.analysis import rank_from_name

    assert rank_from_name(name) == rank


def test_worker_count_respects_memory_and_jobs(tmp_path, monkeypatch):
    import psutil

    from diag.analyzers import analyze as analysis

    files = []
    for i in range(8):
        f = tmp_path / f"rank-{i}.json.gz"
        with open(f, "wb") as fh:
            fh.truncate(50 << 20)  # sparse 50 MB "gzip": ~500 MB of JSON, ~500 MB to analyse
        files.append(str(f))
    assert analysis.worker_count(files, jobs=3) == 3
    assert analysis.worker_count(files[:2], jobs=16) == 2

    class VM:
        available = 1 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    assert analysis.worker_count(files, None) == 1  # 1 GB free: one ~500 MB analysis at a time
    VM.available = 64 << 30
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert analysis.worker_count(files, None) == 4  # plenty of memory: one per CPU


def test_traces_of_different_jobs_are_refused_by_name(tmp_path):
    """A folder mixing jobs (their traces' own distributedInfo states world sizes 2, 8 and 64)
    is no job of 11 ranks: one line naming each job's files, and exit status 2."""
    import shutil

    from conftest import FIXTURES

    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("cpu_comm_rank0.pt.trace.json.gz", "cpu_comm_rank1.pt.trace.json.gz"):
        shutil.copy(FIXTURES / name, folder / name)
    for name in ("b200_vllm_tp8_symm_mem.json.gz", "deepseek_v3_ep64_train_h800.json.gz"):
        shutil.copy(FIXTURES / "real" / name, folder / name)
    proc = diag(folder)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("diag: error: these traces come from different jobs: ")
    assert "world size 2 (cpu_comm_rank0.pt.trace.json.gz, cpu_comm_rank1.pt.trace.json.gz)" in line
    assert "world size 8 (b200_vllm_tp8_symm_mem.json.gz)" in line
    assert "world size 64 (deepseek_v3_ep64_train_h800.json.gz)" in line
    # One job's ranks together are one job, as before.
    one = diag(folder / "cpu_comm_rank0.pt.trace.json.gz", folder / "cpu_comm_rank1.pt.trace.json.gz", "--json")
    assert one.returncode == 0 and len(json.loads(one.stdout)["ranks"]) == 2


def test_two_single_process_traces_are_two_jobs(tmp_path):
    """Each trace of a world of 1 is a job of its own: two of them are refused together."""
    from conftest import FIXTURES

    a = FIXTURES / "real" / "mi300_vllm_decode_hipgraph_triton.json.gz"
    proc = diag(a, a.parent / "a100_alexnet_benchmark_allocator.json.gz")
    assert proc.returncode == 0  # the second states no world size: nothing says they differ
    import shutil

    b = tmp_path / "copy.json.gz"
    shutil.copy(a, b)
    proc = diag(a, b)
    assert proc.returncode == 2 and "world size 1 (copy.json.gz, mi300_vllm_decode_hipgraph_triton.json.gz)" in \
        proc.stderr, proc.stderr


def test_the_rank_line_shows_every_class_waiting_included():
    """Both ranks of a gloo job wait for each other: the text's step-time line has a wait share
    beside the others, summing with them to the whole step."""
    import re

    from conftest import FIXTURES

    proc = diag(FIXTURES / "cpu_comm_rank0.pt.trace.json.gz", FIXTURES / "cpu_comm_rank1.pt.trace.json.gz")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("step time:")]
    assert len(lines) == 2
    for line in lines:
        shares = dict(re.findall(r"(data|host|comm|wait|mem|comp)\s+([0-9.]+)%", line))
        assert list(shares) == ["data", "host", "comm", "wait", "mem", "comp"], line
        assert sum(map(float, shares.values())) == pytest.approx(100.0, abs=0.6)


def test_the_json_text_reads_back_as_the_standard_librarys(real_traces):
    """`--json` prints through msgspec's encoder: ASCII only, escaped as the standard library
    escapes, and the same values once read; what msgspec refuses falls back to the standard
    library."""
    from diag.analyzers.analyze import analyze_paths, json_safe
    from diag.commands.analyze import json_text

    doc = json_safe(analyze_paths([real_traces / "a100_2rank_nccl.json.gz"], jobs=1))
    text = json_text(doc)
    assert text.isascii() and text.endswith("}\n")
    assert json.loads(text) == json.loads(json.dumps(doc))
    odd = {"name": "add → mul 😀\u2028\x01\"", "tiny": 1e-7, "big": 10**30, "list": [[], {}, -0.0]}
    assert json_text(odd).isascii() and json.loads(json_text(odd)) == odd
    assert "\\u2192" in json_text(odd) and "\\ud83d\\ude00" in json_text(odd)
    lone = {"name": "\ud800"}  # a damaged trace's lone surrogate: msgspec refuses it
    assert json_text(lone) == json.dumps(lone, indent=1) + "\n"
