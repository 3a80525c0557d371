"""The notebook runs top to bottom at toy size on the CPU (its code cells, executed in order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs_at_toy_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_SPECDIFF_NOTEBOOK_SMALL", "1")
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}", "exec"), namespace)
    assert (tmp_path / "runs" / "notebook" / "run" / "speculator" / "config.json").is_file()
