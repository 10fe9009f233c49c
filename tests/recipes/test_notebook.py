"""The quickstart notebook runs end to end (a few steps of the real default)."""
from __future__ import annotations

import pytest

from tests._helpers import ROOT

NOTEBOOK = ROOT / "recipes" / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow(ci=True)
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("OUTCORE_QUICKSTART_STEPS", "2")
    monkeypatch.setenv("OUTCORE_QUICKSTART_BYTES", "200000")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "validation perplexity:" in outputs
    assert "ROMEO: ->" in outputs and "model>" in outputs  # the chat cell streamed answers
    assert "task accuracy:" in outputs and "40 questions" in outputs  # the evaluation cell
    assert (tmp_path / "runs" / "quickstart" / "final" / "config.json").is_file()
