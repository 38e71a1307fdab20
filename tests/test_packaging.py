"""The wheel holds every module and data file of the source folders, and no module they lack.

CI installs editable, which sees the folders themselves; a wheel sees only what packaging
found. A subpackage left out once shipped a wheel that failed on the first `diag analyze`.
`.ci/wheel_check` goes further: it installs the wheel into a fresh environment and runs
the demo and an analysis from it.
"""

from __future__ import annotations

import zipfile

import pytest
from conftest import REPO

ROOTS = {"agent": "diag", "collectors": "diag/collectors", "analyzers": "diag/analyzers",
         "dashboards": "diag/dashboards"}


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
def test_the_wheel_holds_every_source_and_data_file(built_wheel):
    """built_wheel is built as a user builds it, from a clean copy of the tree: every file of the
    source folders is in it, and it has no module they lack (a stale one from an old build)."""
    names = set(zipfile.ZipFile(built_wheel).namelist())
    sources = _source_files()
    missing = sorted(sources - names)
    assert not missing, f"left out of the wheel: {missing[:20]}"
    stale = sorted(n for n in names if n.startswith("diag/") and n.endswith(".py") and n not in sources)
    assert not stale, f"in the wheel but not in the source folders: {stale[:20]}"
    assert "diag/analyzers/whatif/replay.py" in names and "diag/analyzers/diagnosis/decision_tree.toml" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "diag = diag.cli:main" in zipfile.ZipFile(built_wheel).read(entry).decode()
