"""Use outcore from the tools people already train with.

``OutOfCoreTrainer`` is ``transformers.Trainer`` trained out of core; ``out_of_core(cls)`` does
the same to any Trainer subclass (TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``). See
``trainer.py``.
"""
from __future__ import annotations

from .trainer import EngineOptimizer, OutOfCoreMixin, OutOfCoreTrainer, out_of_core

__all__ = ["EngineOptimizer", "OutOfCoreMixin", "OutOfCoreTrainer", "out_of_core"]
