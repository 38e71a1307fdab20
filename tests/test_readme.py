"""Every code sample in README.md, docs/ and CONTRIBUTING.md runs as written, or as the table
below says and why; the README stays short, and every relative link in them resolves. The
shell samples run as a newcomer runs them: from the wheel built from this tree and installed
into a fresh virtual environment, in a working directory outside the source tree.

Each fenced block is found in those pages. Python blocks run with the names they assume
(`train_loader`, `train_step`, `model`, `dataset`) defined here on tiny real CPU objects;
TOML blocks are parsed and given to the command that documents them; every line of a shell
block is looked up in COMMANDS, which says how it runs here. A new sample that is neither
run nor listed fails `test_every_sample_is_covered`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO

README = REPO / "README.md"
# The pages whose samples are run: the README first (its blocks are found first), then docs/.
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "CONTRIBUTING.md"]
README_MAX_BYTES = 12_000
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# The torch install of the set-up commands: the CPU build from PyTorch's CPU index on a machine
# without an NVIDIA GPU, PyPI's default build on one.
TORCH = ("python3 -m pip install torch==2.13.0 $(nvidia-smi -L >/dev/null 2>&1 || "
         "echo --extra-index-url https://download.pytorch.org/whl/cpu)")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# README line -> ("run", the command as run here, why it differs if it does) or
# ("not here", why it cannot run on this machine). `{demo_dir}`, `{fixture}` and `{logs}`
# are filled in by the test. Lines run as written carry no reason.
COMMANDS: dict[str, tuple] = {
    TORCH + " && python3 -m pip install -e . && diag demo": (
        "not here", "the installs are what .ci/run does on a fresh machine; its `diag demo` runs below"),
    TORCH + " && python3 -m pip install -e '.[test]' && python3 -m pytest": (
        "not here", "the README's test command: .ci/run runs it, and with it this test"),
    TORCH + " && python3 -m pip install -e '.[dev]'": (
        "not here", "the install .ci/run performs in a fresh virtual environment"),
    "python3 -m pytest": ("not here", "the suite this test belongs to"),
    "python3 -m pytest -n0 tests/test_causes.py": ("not here", "one file of the suite this test belongs to"),
    "bash .ci/run": ("not here", "CI itself"),
    "python3 .ci/typecheck": ("not here", "CI runs it after the tests (.ci/run); about 30 s of mypy"),
    "diag demo": ("run", "diag demo", ""),
    "diag demo --bottleneck data": ("run", "diag demo --bottleneck data", ""),
    "diag analyze runs/demo-<timestamp> --json": (
        "run", "diag analyze {demo_dir} --json", "the placeholder is the run directory `diag demo` made"),
    "diag run --run-dir runs/job1 -- torchrun --nproc-per-node 8 train.py": (
        "run", "diag run --run-dir runs/job1 -- torchrun --nproc-per-node 2 train.py",
        "two processes on gloo: the machine has two cores and no GPU; train.py is a small data-parallel script"),
    "diag config --show --config diag.toml": ("run", "diag config --show --config diag.toml", ""),
    "diag analyze TRACE_OR_DIR... [--json] [--threshold data_wait=0.3] [--config diag.toml] [--jobs N] "
    "[--report DIR]": (
        "run", "diag analyze {fixture} --json --threshold data_wait=0.3 --config diag.toml --jobs 1 --report rep",
        "a synopsis: every option given, with a committed CPU trace"),
    "diag analyze traces/ --ray ray://head:10001 --json": (
        "not here", "needs a Ray cluster at ray://head:10001; tests/test_ray.py runs --ray on a local Ray cluster"),
    "diag calibrate": ("run", "diag calibrate --seconds 0.5", "a shorter benchmark, into a private cache"),
    "diag analyze cpu_trace.json.gz --calibration ~/.cache/diag/cpu_peaks.json": (
        "run", "diag analyze {fixture} --calibration cache/diag/cpu_peaks.json",
        "a committed CPU trace, and the private cache `diag calibrate` wrote just before"),
    "diag demo --bottleneck data --run-dir runs/before": (
        "run", "diag demo --bottleneck data --run-dir runs/before", ""),
    "diag demo --bottleneck data --num-workers K --run-dir runs/after": (
        "run", "diag demo --bottleneck data --num-workers {workers} --run-dir runs/after",
        "K is the worker count the first run's cause named"),
    "diag compare runs/before runs/after": ("run", "diag compare runs/before runs/after", ""),
    "diag compare runs/before runs/after --applied no_data_wait": (
        "run", "diag compare runs/before runs/after --applied no_data_wait --out cmp", ""),
    "python3 -m pip install -e .": ("not here", "the install .ci/run performs"),
    "diag run --run-dir runs/pr -- torchrun --nproc-per-node 8 train.py --max-steps 200": (
        "run", "diag demo --run-dir runs/pr",
        "the demo job stands in for the user's train.py: a short two-rank training under the agent, the same "
        "job as the baseline"),
    "diag compare perf/baseline runs/pr --gate --max-slowdown 5% --junit gate.xml": (
        "run", "diag compare {baseline} runs/pr --gate --max-slowdown 60% --junit gate.xml",
        "the baseline is the run `diag demo` made first: the same code, so the gate passes. A 60% limit, not 5%: "
        "on this shared 2-core machine four demos in a row had median steps of 100 to 138 ms, and a rerun was once "
        "55% slower throughout; a dedicated runner, as in the workflow, holds 5%. tests/test_gate.py and "
        "bench/bench_gate.py judge the gate's own limits"),
    "diag demo --straggler rotating": ("run", "diag demo --straggler rotating --steps 24 --no-export --json",
                                       "a shorter run, its diagnosis printed as JSON to check"),
    "diag top runs/demo-<timestamp>": (
        "run", "diag top {demo_dir} --once --width 160",
        "the finished demo's run directory, drawn once as text (its ranks show completed); tests/test_top.py "
        "watches a running demo"),
    "diag top --targets node1:9870,node1:9871,node2:9870,node2:9871": (
        "not here", "needs ranks serving on those hosts; tests/test_top.py runs `diag top --targets` on a running "
        "demo's two endpoints"),
    "diag top --slurm-nodelist 'gpu[01-04]' --ranks-per-node 8": (
        "run", "diag top --slurm-nodelist 'localhost' --ranks-per-node 2 --port-base 1 --once --width 160",
        "no Slurm cluster here: the nodelist names this machine and a port base nothing serves on, so both ranks "
        "show unreachable with the reason"),
    "diag nccl --nproc-per-node 4 -b 8 -e 1M -f 2": ("run", "diag nccl --nproc-per-node 4 -b 8 -e 1M -f 2", ""),
    "torchrun --nproc-per-node 8 -m diag nccl -b 8 -e 8G -f 2 --intra nvlink4 --inter ib_ndr --nics-per-node 8": (
        "run", "torchrun --nproc-per-node 2 -m diag nccl -b 8 -e 64K -f 2 --intra nvlink4 --inter ib_ndr "
        "--nics-per-node 8", "two processes on gloo and messages up to 64 KiB: no GPUs, two cores"),
    'diag nccl --binary ./all_reduce_perf --mpirun "mpirun -np 16" -- -b 8 -e 8G -f 2': (
        "not here", "needs an nccl-tests binary and mpirun; the options are checked to parse"),
    "diag nccl parse saved_all_reduce.txt": (
        "run", "diag nccl parse saved_all_reduce.txt", "the file is the output `diag nccl` printed above"),
    "diag nccl-log rank*.log": ("run", "diag nccl-log {logs}", "real NCCL logs from the shared data"),
    "diag plan --model llama3-8b --gpus 8 --device h100-sxm --zero 3 --global-batch 64 --intra nvlink4": (
        "run", "diag plan --model llama3-8b --gpus 8 --device h100-sxm --zero 3 --global-batch 64 --intra nvlink4",
        ""),
    "diag plan --model llama3-70b --gpus 64 --device h100-sxm --global-batch 512 --intra nvlink4 --inter ib_ndr "
    "--nics-per-node 8 --search": (
        "run", "diag plan --model llama3-70b --gpus 64 --device h100-sxm --global-batch 512 --intra nvlink4 "
        "--inter ib_ndr --nics-per-node 8 --search", ""),
    "diag plan --params 7.5e9 --gpus 64 --zero 2 --optimizer adam": (
        "run", "diag plan --params 7.5e9 --gpus 64 --zero 2 --optimizer adam", ""),
    "diag plan --run runs/demo-<timestamp> --gpus 8 --zero 2": (
        "run", "diag plan --run {demo_dir} --gpus 8 --zero 2", "the placeholder is the run directory `diag demo` made"),
}


def _blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for page in PAGES for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


def _workflow_lines(code: str) -> list[str]:
    """The shell lines of a GitHub Actions workflow's `run:` steps."""
    import yaml

    doc = yaml.safe_load(code)
    return [line for job in doc["jobs"].values() for step in job["steps"] if "run" in step
            for line in _lines(step["run"])]


def _lines(code: str) -> list[str]:
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_every_sample_is_covered():
    blocks = _blocks()
    assert blocks, "README.md has no code blocks"
    seen = set()
    for lang, code in blocks:
        if lang == "sh":
            for line in _lines(code):
                assert line in COMMANDS, f"README shell line not run by tests/test_readme.py: {line!r}"
                seen.add(line)
        elif lang == "python":
            assert any(marker in code for marker in PYTHON_SAMPLES), f"README Python block not run:\n{code}"
        elif lang == "toml":
            tomllib.loads(code)
        elif lang == "yaml":
            for line in _workflow_lines(code):
                assert line in COMMANDS, f"README workflow line not run by tests/test_readme.py: {line!r}"
                seen.add(line)
        else:
            pytest.fail(f"README block of unknown kind {lang!r}:\n{code}")
    assert not set(COMMANDS) - seen, f"listed but no longer in the README or docs: {set(COMMANDS) - seen}"


def test_the_readme_is_read_in_five_minutes_and_every_link_resolves():
    """The README holds the pitch, the two set-up commands, the demo, the Agent snippet and a
    tour; the rest lives in docs/. Every relative link of these pages points at a file there is."""
    assert len(README.read_bytes()) <= README_MAX_BYTES
    text = README.read_text()
    assert text.index("<!-- demo-command -->") < text.index("<!-- test-command -->") < text.index("## ")
    for page in [*PAGES, REPO / "ARCHITECTURE.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target):
                assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to a missing {target}"
    assert all(how[0] == "run" or how[1] for how in COMMANDS.values())


# ------------------------------------------------------------------------------ running them


# The interpreter the shell samples run `diag` and `torchrun` with: the installed wheel's, once
# the `installed` fixture has built it.
_python = [sys.executable]


@pytest.fixture(scope="module")
def installed(tmp_path_factory, built_wheel) -> Path:
    """diag as a newcomer has it: the wheel built from this tree, installed (not editable) into a
    fresh virtual environment that sees this environment's torch and other dependencies; the
    environment's python. The shell samples run with it, outside the source tree."""
    d = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(d / "venv")], check=True,
                   capture_output=True, timeout=300)
    python = d / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(built_wheel)], check=True,
                   capture_output=True, timeout=300)
    where = subprocess.run([str(python), "-c", "import diag; print(diag.__file__)"], cwd=d, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(d / "venv"), f"diag imported from {where}, not from the installed wheel"
    return python


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, installed):
    """One folder, as a user's working directory, shared by the samples (the demo runs once);
    `diag` there is the installed wheel's."""
    _python[0] = str(installed)
    d = tmp_path_factory.mktemp("readme")
    toml = next(code for lang, code in _blocks() if lang == "toml")
    (d / "diag.toml").write_text(toml)
    (d / "train.py").write_text(TRAIN_PY)
    return d


def _env(workdir: Path) -> dict:
    return {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "diag":
        return [_python[0], "-m", "diag", *words[1:]]
    if words[0] == "torchrun":
        return [_python[0], "-m", "torch.distributed.run", *words[1:]]
    return words


def run_line(line: str, workdir: Path, **fill) -> subprocess.CompletedProcess:
    how = COMMANDS[line]
    assert how[0] == "run", line
    command = how[1].format(**fill)
    proc = subprocess.run(_argv(command), cwd=workdir, env=_env(workdir), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def demo(workdir):
    proc = run_line("diag demo", workdir)
    run_dir = next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("Run directory: "))
    return proc.stdout, workdir / run_dir  # as printed: relative to the working directory


@pytest.mark.slow
def test_demo_and_its_analysis(workdir, demo):
    out, run_dir = demo
    assert out.startswith("Verdict: Compute-bound") and run_dir.parent == workdir / "runs", out
    assert (run_dir / "report.html").is_file()
    doc = json.loads(run_line("diag analyze runs/demo-<timestamp> --json", workdir, demo_dir=run_dir).stdout)
    assert doc["job"]["bound"] == "compute" and out.startswith(f"Verdict: {doc['diagnosis']['headline']['text']}")
    _assert_no_precision_advice_without_bf16_units(run_dir, doc["diagnosis"], out)
    data = run_line("diag demo --bottleneck data", workdir).stdout
    assert data.startswith("Verdict: Data-bound"), data


@pytest.mark.slow
def test_the_data_demos_action_is_graded_by_compare(workdir):
    before = run_line("diag demo --bottleneck data --run-dir runs/before", workdir).stdout
    assert before.startswith("Verdict: Data-bound"), before
    # The demo's report ranks its fixes by predicted gain, led by its cause, whose action (a
    # worker count) has its own prediction.
    recs = json.loads((workdir / "runs/before/summary.json").read_text())["diagnosis"]["recommendations"]
    action = recs[0]["prediction"]["action"]
    assert recs[0]["id"] == "phase-data" and action.startswith("num_workers="), recs[0]
    workers = action.removeprefix("num_workers=")
    run_line("diag demo --bottleneck data --num-workers K --run-dir runs/after", workdir, workers=workers)
    graded = run_line("diag compare runs/before runs/after", workdir).stdout
    assert f"Prediction check, num_workers 0 -> {workers} (from the runs' recorded DataLoader settings)" in graded
    result = json.loads((workdir / "runs/after/compare.json").read_text())["prediction"]
    assert result["kind"] == "action" and result["error"] is not None and result["within_range"] is not None
    ceiling = run_line("diag compare runs/before runs/after --applied no_data_wait", workdir).stdout
    assert "Prediction check, no_data_wait (as given): diag predicted" in ceiling, ceiling


# What only lower precision would win: the tree's [needs_half_precision] fixes and changes.
PRECISION_ADVICE = ("Use lower precision", "Keep matrix dimensions multiples of 8", "Train in bf16", "Run them in bf16")


def _assert_no_precision_advice_without_bf16_units(run_dir, diagnosis: dict, printed: str) -> None:
    """On a CPU without bf16 matrix units the default demo (fp32 linear layers) is offered no
    precision change: not in what it printed, the causes, the recommendations, the what-if
    table, report.md or report.html."""
    cpu = json.loads((run_dir / "rank-00000" / "rank.json").read_text())["cpu"]
    if cpu["bf16_units"] is not False:
        return
    views = {"printed": printed, "report.md": (run_dir / "report.md").read_text(),
             "report.html": (run_dir / "report.html").read_text(),
             "recommendations": json.dumps(diagnosis["recommendations"]), "causes": json.dumps(diagnosis["causes"])}
    for name, text in views.items():
        assert not [a for a in PRECISION_ADVICE if a in text], name
    for e in diagnosis["what_if"]["changes"]:
        if e["change"] in ("compute_2x", "half_precision_matrix_ops", "tensor_core_math"):
            assert e["predicted_step_ms"] is None and e["note"].startswith("withheld:"), e
    assert "has no bf16 matrix units" in views["printed"]


@pytest.mark.slow
def test_ci_gate_sample(workdir, demo):
    """The workflow's two steps: a second run of the same job passes the gate against the first."""
    _, baseline = demo
    run_line("diag run --run-dir runs/pr -- torchrun --nproc-per-node 8 train.py --max-steps 200", workdir)
    out = run_line("diag compare perf/baseline runs/pr --gate --max-slowdown 5% --junit gate.xml", workdir,
                   baseline=baseline).stdout
    assert out.startswith("diag gate: PASS: step time"), out
    junit = (workdir / "gate.xml").read_text()
    assert '<testsuite name="diag.gate"' in junit and 'failures="0"' in junit and 'name="step time"' in junit


@pytest.mark.slow
def test_straggler_sample(workdir):
    diagnosis = json.loads(run_line("diag demo --straggler rotating", workdir).stdout)
    episodes = diagnosis["straggler_episodes"]
    # Each rank late in turn: both are late across the episodes (noise can split the run into
    # episodes of one rank each).
    late = {r for e in episodes["episodes"] for r in e["ranks"]}
    assert episodes["pattern"] == "rotating" and {0, 1} <= late, episodes
    assert any(f["id"] == "straggler_rotating" for f in diagnosis["findings"])


@pytest.mark.slow
def test_top_samples(workdir, demo):
    _, run_dir = demo
    seen = run_line("diag top runs/demo-<timestamp>", workdir, demo_dir=run_dir).stdout
    assert "ranks 0/2 running" in seen and seen.count("completed") == 2, seen
    nodes = run_line("diag top --slurm-nodelist 'gpu[01-04]' --ranks-per-node 8", workdir).stdout
    assert nodes.count("unreachable") == 2 and "endpoints localhost:1, localhost:2" in nodes, nodes


@pytest.mark.slow
def test_plan_samples(workdir, demo):
    fit = run_line("diag plan --model llama3-8b --gpus 8 --device h100-sxm --zero 3 --global-batch 64 "
                   "--intra nvlink4", workdir).stdout
    assert "-> fits" in fit and "predicted step:" in fit, fit
    found = run_line("diag plan --model llama3-70b --gpus 64 --device h100-sxm --global-batch 512 --intra nvlink4 "
                     "--inter ib_ndr --nics-per-node 8 --search", workdir).stdout
    assert "fit; best:" in found and "why the others lose:" in found, found
    states = run_line("diag plan --params 7.5e9 --gpus 64 --zero 2 --optimizer adam", workdir).stdout
    assert "model_states      15.50 GiB" in states, states  # 16.6 GB: the ZeRO paper
    _, run_dir = demo
    own = run_line("diag plan --run runs/demo-<timestamp> --gpus 8 --zero 2", workdir, demo_dir=run_dir).stdout
    assert "rate flops: measured:" in own and "the run's own layout: predicted" in own, own


@pytest.mark.slow
def test_diag_run_with_torchrun(workdir):
    run_line("diag run --run-dir runs/job1 -- torchrun --nproc-per-node 8 train.py", workdir)
    assert (workdir / "runs" / "job1").is_dir()
    assert sorted(p.name for p in (workdir / "runs").iterdir() if p.name.startswith("train-done")) == [
        "train-done-0", "train-done-1"]


def test_config_file_and_show(workdir):
    out = run_line("diag config --show --config diag.toml", workdir).stdout
    every = next(line for line in out.splitlines() if line.strip().startswith("profiler.every "))
    assert every.split()[1] == "500" and "file diag.toml" in every
    assert any(line.strip().startswith("data_wait") and line.split()[1] == "0.3" for line in out.splitlines())


def test_analyze_synopsis_and_calibrate(workdir):
    trace = FIXTURES / "cpu_data_rank0.pt.trace.json.gz"
    doc = json.loads(run_line("diag analyze TRACE_OR_DIR... [--json] [--threshold data_wait=0.3] [--config diag.toml] "
                              "[--jobs N] [--report DIR]", workdir, fixture=trace).stdout)
    assert doc["schema"] == "diag.analysis/1" and doc["ranks"][0]["bound"] == "data"
    assert doc["ranks"][0]["path"][0]["threshold"] == 0.3
    assert (workdir / "rep" / "report.html").is_file()
    out = run_line("diag calibrate", workdir).stdout
    assert list((workdir / "cache").rglob("cpu_peaks.json")), out
    calibrated = run_line("diag analyze cpu_trace.json.gz --calibration ~/.cache/diag/cpu_peaks.json", workdir,
                          fixture=trace).stdout
    cpu = json.loads(next((workdir / "cache").rglob("cpu_peaks.json")).read_text())["cpu"]
    assert calibrated.startswith(f"rank 0  DATA-BOUND  ({cpu}, "), calibrated  # the device is the calibrated CPU


@pytest.mark.slow
def test_nccl_samples(workdir):
    out = run_line("diag nccl --nproc-per-node 4 -b 8 -e 1M -f 2", workdir).stdout
    assert "# Avg bus bandwidth" in out
    (workdir / "saved_all_reduce.txt").write_text(out)
    parsed = run_line("diag nccl parse saved_all_reduce.txt", workdir).stdout
    assert "all_reduce" in parsed
    out = run_line("torchrun --nproc-per-node 8 -m diag nccl -b 8 -e 8G -f 2 --intra nvlink4 --inter ib_ndr "
                   "--nics-per-node 8", workdir).stdout
    assert "all_reduce" in out and "65536" in out
    # The nccl-tests binary line cannot run here; its options must still parse (a missing
    # binary is a one-line input error, not a usage error).
    line = 'diag nccl --binary ./all_reduce_perf --mpirun "mpirun -np 16" -- -b 8 -e 8G -f 2'
    assert COMMANDS[line][0] == "not here"
    proc = subprocess.run(_argv(line), cwd=workdir, env=_env(workdir), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" not in proc.stderr and "all_reduce_perf" in proc.stderr, proc.stderr


def test_nccl_log_sample(workdir, real_data):
    logs = sorted((real_data / "nccl").glob("nccllog_*.txt"))[:2]
    for i, src in enumerate(logs):
        shutil.copy(src, workdir / f"rank{i}.log")
    out = run_line("diag nccl-log rank*.log", workdir, logs=" ".join(f"rank{i}.log" for i in range(len(logs))))
    assert "rank0.log" in out.stdout or "NCCL" in out.stdout


# ------------------------------------------------------------------------------ Python samples


def _train_loader():
    import torch

    data = torch.utils.data.TensorDataset(torch.randn(64, 16))
    return torch.utils.data.DataLoader(data, batch_size=8, collate_fn=lambda rows: torch.stack([r[0] for r in rows]))


def _train_step():
    """(model, optimizer, train_step) of a linear model."""
    import torch

    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train_step(batch):
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, opt, train_step


def _tiny_gpt2_and_tokens():
    import torch
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 16))
    dataset = [{"input_ids": row, "labels": row.clone()} for row in ids]
    return model, dataset


# A marker that identifies each README Python block -> the names it needs.
PYTHON_SAMPLES = {
    "with diag.Agent(": lambda: {"train_loader": _train_loader(),
                                 **dict(zip(("model", "optimizer", "train_step"), _train_step()))},
    "diag.integrations.lightning_callback(": lambda: dict(zip(("model", "dataset"), _tiny_gpt2_and_tokens())),
}


@pytest.mark.parametrize("marker", sorted(PYTHON_SAMPLES))
def test_python_sample_runs(marker, tmp_path, monkeypatch):
    code = next(code for lang, code in _blocks() if lang == "python" and marker in code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DIAG_EXPORTER", "0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    names = PYTHON_SAMPLES[marker]()
    exec(compile(code, "README.md", "exec"), names)  # the README's own code, run as written
    if marker == "with diag.Agent(":
        from diag import rundir

        rd = rundir.RunDir(tmp_path / "runs" / "exp1")
        assert [s.samples for s in rd.steps(0)] == [8] * 8
        facts = rd.rank_info(0)["model"]  # Linear(16, 1) with SGD momentum: one fp32 buffer per parameter
        assert facts["params"] == 17 and facts["optimizer_state_bytes"] == 4 * 17
        assert (tmp_path / "runs" / "exp1" / "report.html").is_file()
    else:
        names["trainer"].fit  # noqa: B018 - the Lightning trainer exists, with the callback
        assert type(names["trainer"].logger).__name__ == "MLFlowLogger"
        assert any(type(cb).__name__ == "DiagTrainerCallback" for cb in names["hf_trainer"].callback_handler.callbacks)
        assert any(type(cb).__name__ == "DiagLightningCallback" for cb in names["trainer"].callbacks)


# Gradients averaged by hand rather than through DDP: DDP's teardown on gloo aborts now and
# then at interpreter exit under torch 2.13 ("terminate called without an active
# exception"), which would fail this test for a reason that is not diag's.
TRAIN_PY = '''"""A small data-parallel job on gloo, as `diag run` would launch a user's script."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(10):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.barrier()
open(os.path.join("runs", f"train-done-{dist.get_rank()}"), "w").close()
dist.destroy_process_group()
'''


@pytest.mark.parametrize("gpu", [False, True])
def test_the_torch_install_takes_the_cpu_build_only_without_a_gpu(tmp_path, gpu):
    """The set-up commands' torch install, as sh expands it: PyTorch's CPU index added where no
    nvidia-smi lists a GPU, nothing added where one does; .ci/run installs torch the same way."""
    import shutil
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("echo",):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
        smi.chmod(0o755)
    words = TORCH.replace("python3 -m pip install", "echo", 1)
    out = subprocess.run(["/bin/sh", "-c", words], capture_output=True, text=True, env={"PATH": str(bin_dir)})
    args = out.stdout.split()
    assert args[0] == "torch==2.13.0" and (CPU_INDEX in args) is not gpu
    assert README.read_text().count(TORCH + " && ") == 2  # the two set-up commands
    assert (REPO / "CONTRIBUTING.md").read_text().count(TORCH + " && ") == 1  # the development install
    assert TORCH.split("torch==2.13.0", 1)[1] in (REPO / ".ci" / "run").read_text()
