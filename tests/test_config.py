"""The agent's configuration: one typed object from defaults, a file, the environment and arguments."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
import torch

import diag
from diag import rundir
from diag.collectors import profiler_windows as pw
from diag.config import FLAT, SECTIONS, AgentConfig
from diag.errors import DiagInputError

FILE = """
[thresholds]
data_wait = 0.3

[agent.profiler]
skip_first = 2
every = 4
active = 1

[agent.exporter]
enabled = false

[agent.report]
enabled = false
wait_s = 5.0
"""


def test_defaults_are_the_ones_the_agent_documents():
    cfg = AgentConfig.resolve(env={})
    assert (cfg.profiler.skip_first, cfg.profiler.warmup, cfg.profiler.active, cfg.profiler.every) == (
        pw.SKIP_FIRST, pw.WARMUP, pw.ACTIVE, pw.EVERY)
    assert cfg.profiler.trace_budget_bytes == 1 << 30 and cfg.sampling.interval_s == 1.0
    assert cfg.exporter.enabled and cfg.exporter.port is None and cfg.report.wait_s == 120.0
    assert cfg.run.heartbeat_s == 5.0 and cfg.run.flush_s == 1.0 and cfg.sampling.device == "auto"
    assert cfg.sources == {}
    # Every field has a one-line doc and a flat keyword name, and the names do not collide.
    fields = [f for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert all(f.metadata["doc"] and "\n" not in f.metadata["doc"] for f in fields)
    assert len(FLAT) == len(fields)


def test_precedence_defaults_file_environment_arguments(tmp_path):
    path = tmp_path / "diag.toml"
    path.write_text(FILE)
    env = {"DIAG_PROFILER_EVERY": "8", "DIAG_EXPORTER_PORT": "9950", "DIAG_RUN_DIR": "/tmp/from-env"}
    cfg = AgentConfig.resolve(config_file=path, env=env, active=3)
    assert cfg.profiler.skip_first == 2 and cfg.source("profiler", "skip_first") == f"file {path}"
    assert cfg.profiler.every == 8 and cfg.source("profiler", "every") == "env DIAG_PROFILER_EVERY"
    assert cfg.profiler.active == 3 and cfg.source("profiler", "active") == "argument"
    assert cfg.profiler.warmup == pw.WARMUP and cfg.source("profiler", "warmup") == "default"
    assert cfg.exporter.port == 9950 and cfg.run.dir == "/tmp/from-env"
    assert cfg.exporter.enabled is False and cfg.report.wait_s == 5.0
    # The file is found through DIAG_CONFIG too, and the older DIAG_EXPORTER=0 still turns the endpoint off.
    cfg = AgentConfig.resolve(env={"DIAG_CONFIG": str(path)})
    assert cfg.config_file == str(path) and cfg.profiler.every == 4
    assert AgentConfig.resolve(env={"DIAG_EXPORTER": "0"}).exporter.enabled is False
    assert AgentConfig.resolve(env={"DIAG_EXPORTER": "0", "DIAG_EXPORTER_ENABLED": "1"}).exporter.enabled is True
    # A YAML file works the same way.
    yml = tmp_path / "diag.yaml"
    yml.write_text("agent:\n  sampling:\n    interval_s: 2\n    device: none\n")
    cfg = AgentConfig.resolve(config_file=yml, env={})
    assert cfg.sampling.interval_s == 2.0 and cfg.sampling.device is None


@pytest.mark.parametrize("env, message", [
    ({"DIAG_PROFILER_EVERY": "often"}, "DIAG_PROFILER_EVERY='often': expected a whole number"),
    ({"DIAG_SAMPLING_INTERVAL_S": "1s"}, "DIAG_SAMPLING_INTERVAL_S='1s': expected a number"),
    ({"DIAG_NCCL_LOG": "maybe"}, "DIAG_NCCL_LOG='maybe': expected one of"),
])
def test_bad_environment_values_name_the_variable(env, message):
    with pytest.raises(DiagInputError, match=message.replace("(", r"\(")):
        AgentConfig.resolve(env=env)


@pytest.mark.parametrize("text, message", [
    ("[agent.profiler]\nevry = 3\n", "unknown key 'evry' in \\[agent.profiler\\]; known: enabled"),
    ("[agent.profilr]\nevery = 3\n", "unknown section \\[agent.profilr\\]"),
    ("[agent.profiler]\nevery = '3'\n", "\\[agent.profiler\\] every = '3': expected int"),
    ("[agent.exporter]\nenabled = 1\n", "expected bool"),
    ("[agent\nevery = 3\n", "not a readable TOML/YAML config"),
])
def test_bad_files_give_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(DiagInputError, match=message) as err:
        AgentConfig.resolve(config_file=path, env={})
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(DiagInputError, match="config file not found"):
        AgentConfig.resolve(config_file=tmp_path / "missing.toml", env={})


def test_agent_keeps_its_keyword_arguments_and_rejects_unknown_ones(tmp_path):
    # Every flat name is accepted, as the callers of diag.Agent(...) and the callbacks pass them.
    agent = diag.Agent(run_dir=tmp_path / "r", export=False, skip_first=5, trace_budget_bytes=1, report=False)
    assert agent.config.profiler.skip_first == 5 and agent.config.exporter.enabled is False
    assert agent.config.run.dir == str(tmp_path / "r")
    with pytest.raises(TypeError, match="unknown agent option"):
        diag.Agent(run_dir=tmp_path / "r", skip_frist=5)
    # The signature holds only what is not a setting; the settings are AgentConfig's.
    params = set(inspect.signature(diag.Agent).parameters)
    assert params == {"run_dir", "config", "config_file", "thresholds", "on_closed", "options"}
    base = AgentConfig.resolve(env={}, every=7)
    agent = diag.Agent(config=base, skip_first=1)
    assert agent.config.profiler.every == 7 and agent.config.profiler.skip_first == 1
    assert base.profiler.skip_first == pw.SKIP_FIRST  # the given object is not changed


def test_a_config_file_drives_a_real_run(tmp_path, monkeypatch):
    path = tmp_path / "diag.toml"
    path.write_text(FILE)
    monkeypatch.setenv("DIAG_CONFIG", str(path))
    monkeypatch.setenv("DIAG_SAMPLING_ENABLED", "false")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with diag.Agent(run_dir=tmp_path / "run", verbose=False) as agent:
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            agent.step(samples=4)
            agent.windows.wait_exported(30.0)  # a window starting while one exports would be skipped
    assert agent.exporter is None and agent.collectors.sampler is None
    rd = rundir.RunDir(agent.run_dir)
    assert [(w.first_step, w.last_step) for w in rd.windows(0)] == [(3, 3), (7, 7), (11, 11)]
    assert not (agent.run_dir / "report.html").exists()  # [agent.report] enabled = false
    assert agent.tree.thresholds["data_wait"] == 0.3  # the same file's [thresholds]
    manifest = rd.manifest()
    assert manifest["config"]["profiler"]["every"] == 4 and manifest["config"]["config_file"] == str(path)


def test_a_bad_file_never_stops_the_training(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent.profiler]\nevery = 'often'\n")
    monkeypatch.setenv("DIAG_CONFIG", str(bad))
    with diag.Agent(run_dir=tmp_path / "run", export=False, report=False, profile=False) as agent:
        agent.step()
    assert agent.config.profiler.every == pw.EVERY and agent.config.config_file is None
    assert "config:" in capsys.readouterr().err and str(bad) in " ".join(
        e["message"] for e in rundir.RunDir(agent.run_dir).events(0))


def _diag(*args, env=None):
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_diag_config_show(tmp_path):
    path = tmp_path / "diag.toml"
    path.write_text(FILE)
    import os

    env = {**os.environ, "DIAG_PROFILER_ACTIVE": "2"}
    proc = _diag("config", "--show", "--config", str(path), env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    every = next(line for line in lines if line.strip().startswith("profiler.every "))
    assert every.split()[1] == "4" and f"file {path}" in every
    active = next(line for line in lines if line.strip().startswith("profiler.active "))
    assert active.split()[1] == "2" and "env DIAG_PROFILER_ACTIVE" in active
    assert any(line.strip().startswith("data_wait") and line.split()[1] == "0.3" for line in lines)
    # Whole numbers as the TOML holds them, not in exponent notation.
    shown = {line.split()[0]: line.split()[1] for line in lines if line.startswith("  ") and len(line.split()) == 2}
    assert shown["busbw_small_message_bytes"] == "16777216" and shown["small_collective_bytes"] == "1048576"
    proc = _diag("config", "--json", "--config", str(path), env=env)
    doc = json.loads(proc.stdout)
    rows = {f"{r['section']}.{r['name']}": r for r in doc["settings"]}
    assert rows["exporter.enabled"]["value"] is False and rows["exporter.enabled"]["env"] == "DIAG_EXPORTER_ENABLED"
    assert rows["run.dir"]["argument"] == "run_dir" and rows["report.wait_s"]["source"] == f"file {path}"
    assert doc["thresholds"]["data_wait"] == 0.3
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent.nope]\n")
    proc = _diag("config", "--show", "--config", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown section" in proc.stderr


def test_every_flag_of_every_command_says_what_it_does():
    """`diag CMD --help` explains each flag: none is left with only its name."""
    import argparse
    import importlib

    from diag.cli import COMMANDS

    bare = []
    for name, module, _ in COMMANDS:
        parser = argparse.ArgumentParser(prog=f"diag {name}")
        importlib.import_module(f"diag.commands.{module}").add_arguments(parser)
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                bare.append(f"diag {name} {'/'.join(action.option_strings) or action.dest}")
    assert not bare, bare


def test_the_exit_statuses_are_the_documented_ones(tmp_path, capsys, monkeypatch):
    """The documented table (docs/reference.md): 2 for input that can not be used, 1 for a file
    that can not be written, 130 for an interruption; each with one line on stderr."""
    from pathlib import Path

    from diag import cli

    reference = (Path(__file__).parent.parent / "docs" / "reference.md").read_text()
    table = reference[reference.index("## Exit status"):reference.index("## The run directory")]
    assert all(f"| {code} |" in table for code in (0, 1, 2, 130))
    bad = tmp_path / "trace.json"
    bad.write_text('{"traceEvents": [')
    assert cli.main(["analyze", str(bad)]) == 2
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "report.html").mkdir()  # a directory where the report goes
    trace = Path(__file__).parent / "fixtures" / "real" / "h200" / "item_sync.json.gz"
    assert cli.main(["analyze", str(trace), "--report", str(out_dir)]) == 1
    with pytest.raises(SystemExit) as usage:
        cli.main(["analyze", "--no-such-flag"])
    assert usage.value.code == 2

    def interrupted(args):
        raise KeyboardInterrupt

    import diag.commands.analyze as analyze_cmd

    monkeypatch.setattr(analyze_cmd, "run", interrupted)
    assert cli.main(["analyze", str(trace)]) == 130
    errs = [x for x in capsys.readouterr().err.splitlines() if x.startswith("diag:")]
    assert len(errs) == 3 and "Traceback" not in "".join(errs)
