"""The code base stays clean under the project's ruff configuration."""

import shutil
import subprocess

import pytest
from conftest import REPO


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (pip install -e '.[test]')")
    proc = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_layering():
    """Analyzers never import collectors, and collectors never import analyzers."""
    for folder, forbidden in (("analyzers", "diag.collectors"), ("collectors", "diag.analyzers")):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            assert f"import {forbidden}" not in text and f"from {forbidden}" not in text, (
                f"{path.relative_to(REPO)} imports {forbidden}"
            )
