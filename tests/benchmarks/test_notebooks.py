"""Executes every benchmarks/notebooks/*.ipynb; a notebook `NAME.ipynb` reads `results/NAME.json`."""

from pathlib import Path

import nbformat
import pytest
from helpers import REPO
from nbclient import NotebookClient

NOTEBOOK_DIR = REPO / "benchmarks" / "notebooks"
RESULTS_DIR = NOTEBOOK_DIR.parent / "results"
# Per cell: a kernel start plus a few plots take seconds; a cell needing minutes is a bug.
CELL_TIMEOUT_S = 300


def execute_notebook(notebook: Path) -> None:
    """Run all cells with the venv's `python3` kernel in the notebook's folder; raises on any error."""
    nb = nbformat.read(notebook, as_version=4)
    resources = {"metadata": {"path": str(notebook.parent)}}
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources=resources).execute()


@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_DIR.glob("*.ipynb")), ids=lambda path: path.stem)
def test_notebook_runs(notebook: Path):
    results = RESULTS_DIR / f"{notebook.stem}.json"
    if not results.exists():
        pytest.skip(f"{results} does not exist yet: run the {notebook.stem} benchmark and commit its JSON")
    execute_notebook(notebook)
