"""The wheel holds every module and data file of the three source folders.

CI installs editable, which sees the folders themselves; a wheel sees only what packaging
found. A subpackage left out once shipped a wheel that failed on the first `diag analyze`.
`.ci/wheel_check` goes further: it installs the wheel into a fresh environment and runs
the demo and an analysis from it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"agent": "diag", "collectors": "diag/collectors", "analyzers": "diag/analyzers"}


def _source_files() -> set[str]:
    out = set()
    for folder, prefix in ROOTS.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                rel = path.relative_to(REPO / folder).as_posix()
                # collectors/ and analyzers/ are also folders of agent/'s package in the mapping, not inside it.
                out.add(f"{prefix}/{rel}")
    return out


@pytest.mark.slow
def test_the_wheel_holds_every_source_and_data_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("diag-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"left out of the wheel: {missing[:20]}"
    assert "diag/analyzers/whatif/replay.py" in names and "diag/analyzers/diagnosis/decision_tree.toml" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "diag = diag.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
