"""The learning-rate schedule every recipe follows: linear warmup, then cosine decay."""
from __future__ import annotations

import math
from typing import Callable


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor
