"""outcore: fine-tune language models larger than the memory that trains them.

The public API is imported lazily so that ``import outcore`` (and the CLI's
``--help``) stay fast and never import torch before it is needed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._exports import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_LAZY = {
    "FinetuneConfig": ".training.config",
    "load_config": ".training.config",
    "finetune": ".api",
    "generate": ".recipes.generate",
    "load_generator": ".recipes.generate",
    "evaluate": ".api",
    "OutcoreError": ".errors",
}

__all__ = list(sorted(_LAZY)) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers; `X as X` marks a re-export
    from .errors import OutcoreError as OutcoreError
    from .training.config import FinetuneConfig as FinetuneConfig, load_config as load_config
    from .api import evaluate as evaluate, finetune as finetune
    from .recipes.generate import generate as generate, load_generator as load_generator


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
