"""Lazy exports (PEP 562): a package's public names, imported on first use.

``import outcore`` and its packages stay free of torch until a name that needs it is
used, so the command line's ``--help`` and the config checks start fast. A package names
them once, in ``_EXPORTS``, and lists them as ``__all__ = list(sorted(_EXPORTS))`` (the
``list(...)`` is the form ruff reads as a list of names: PLE0605).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the module that defines it, relative to ``package``
            (``".store"``).

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.
    """
    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
