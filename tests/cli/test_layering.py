"""cli/ is the top of the package: tui/ and everything below it import no ``cli``; only
``python -m outcore`` (``__main__.py``), the scripts and the tests do."""
from __future__ import annotations

import subprocess
import sys

from tests._helpers import ROOT, load_module

# the AST scan of what a module imports (at its top or inside a function)
layering = load_module(ROOT / "tests" / "training" / "test_layering.py", "_training_layering")


def test_nothing_below_the_command_line_imports_it():
    tops = sorted(p.name for p in ROOT.iterdir()
                  if p.name not in {"cli", "__main__.py", "scripts", "tests"}
                  and (p.suffix == ".py" or (p / "__init__.py").is_file()))
    assert {"tui", "api.py", "recipes", "training", "offload", "__init__.py"} <= set(tops)
    for top in tops:
        for path in layering._sources(top):
            assert "cli" not in layering._imported_packages(path), path


def test_importing_the_ui_loads_no_command_line():
    modules = sorted(f"outcore.tui.{p.stem}" for p in (ROOT / "tui").glob("*.py") if p.stem != "__init__")
    code = f"import sys, {', '.join(modules)}; print([m for m in sys.modules if m.startswith('outcore.cli')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
