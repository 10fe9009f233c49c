"""training/ sits between the recipes and the engine: it imports neither ``recipes`` nor ``tui``,
and nothing below it (offload, optim, models, data, ...) imports it or the recipes."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the package outcore
# what may import training/: the recipes and what sits above them
ABOVE = {"recipes", "cli", "tui", "integrations", "api.py", "__init__.py", "__main__.py", "scripts", "tests"}


def _sources(top: str) -> list[Path]:
    path = ROOT / top
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    """The top-level outcore packages (or modules) ``path`` imports, at its top or inside a function."""
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
            elif (node.module or "").split(".")[0] == "outcore":
                base = []
                node = ast.ImportFrom(module=node.module.partition(".")[2] or None, names=node.names, level=0)
            else:
                continue
            parts = base + (node.module.split(".") if node.module else [])
            found.update([parts[0]] if parts else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("outcore."))
    return found


def test_training_imports_no_recipe_and_no_ui():
    for path in _sources("training"):
        assert not _imported_packages(path) & {"recipes", "tui"}, path


def test_nothing_below_training_imports_it_or_the_recipes():
    below = sorted(p.name for p in ROOT.iterdir() if p.name not in ABOVE | {"training"}
                   and (p.suffix == ".py" or (p / "__init__.py").is_file()))
    assert {"offload", "optim", "models", "errors.py"} <= set(below)
    for top in below:
        for path in _sources(top):
            assert not _imported_packages(path) & {"training", "recipes", "tui"}, path


def test_importing_training_loads_no_recipe_and_no_ui():
    modules = sorted("outcore." + ".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (ROOT / "training").rglob("*.py") if p.stem != "__init__")
    code = (f"import sys, {', '.join(modules)}; "
            "print([m for m in sys.modules if m.startswith(('outcore.recipes', 'outcore.tui'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_package_names_resolve_and_import_no_torch_until_used():
    code = ("import sys, outcore.training as t; light = 'torch' not in sys.modules; "
            "[getattr(t, n) for n in t.__all__]; print(light, sorted(set(t.__all__) - set(dir(t))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True []"
