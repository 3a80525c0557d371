"""The code passes ruff with the project's style rules (pyproject.toml's `[tool.ruff]`: pycodestyle errors and
warnings, pyflakes, lines of at most 120 characters), so that CI checks them along with the tests: a long line, an
unused import or an undefined name fails here, not in a later review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_code_passes_ruff():
    repo_root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(repo_root)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"
