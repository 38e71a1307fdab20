"""`diag nccl parse` and `diag nccl-log` on every file in ../shared/data/nccl, one file at a
time, text and JSON: each run ends with an exit status and at most one-line errors, never a
traceback, whatever the file holds (a log given to the table parser and the reverse too)."""

from __future__ import annotations

import json

import pytest
from conftest import real_data_dir

from diag.cli import main


def _names():
    d = real_data_dir()
    if d is None or not (d / "nccl").is_dir():
        return ["(no data)"]
    return sorted(f.name for f in (d / "nccl").iterdir() if f.is_file())


def _run(capsys, argv):
    code = main(argv)  # an exception other than the handled input errors fails the test
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    for line in err.splitlines():
        assert line.startswith(("diag: error: ", "diag nccl")) or not line.strip(), line
    return code, out, err


@pytest.mark.parametrize("name", _names())
def test_every_file_through_both_commands(real_nccl, capsys, name):
    path = str(real_nccl / name)
    tables = name.startswith(("nccltests_", "rccltests_"))

    code, out, err = _run(capsys, ["nccl", "parse", path])
    if tables:
        assert code in (0, 1) and f"# {path}: " in out
    else:  # a log holds no table, or (a log of an nccl-tests run) its header
        assert code == 2 and err.startswith("diag: error: ") and name in err or code in (0, 1) and f"# {path}: " in out
    code, out, _ = _run(capsys, ["nccl", "parse", path, "--json"])
    if code != 2:
        doc = json.loads(out)
        assert doc["schema"] == "diag.nccl_bench/1" and doc["tests"]

    code, out, err = _run(capsys, ["nccl-log", path])
    assert code in (0, 1, 2)
    code, out, err = _run(capsys, ["nccl-log", path, "--json"])
    assert code in (0, 1, 2)
    if out.strip():
        doc = json.loads(out)
        assert doc["schema"] == "diag.nccl_log/2"
        if name.startswith(("nccllog_", "rccllog_", "torchlog_", "torchfr_")):
            assert doc["sources"] == [path] and doc["findings"] is not None


def test_parse_has_its_own_usage_and_help(capsys):
    """`diag nccl parse --help` is parse's: its files, outputs and topology, not the sweep's
    flags; without a file it says so in one line."""
    from diag import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["nccl", "parse", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: diag nccl parse ") and "FILE" in out and "--intra" in out and "--json" in out
    assert "--minbytes" not in out and "--nproc-per-node" not in out
    assert cli.main(["nccl", "parse"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "diag: error: parse needs at least one saved nccl-tests output file"
