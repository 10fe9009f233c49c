"""The largest model a disk holds for a full fine-tune out of core, in the write-lean mode.

Out of core, RAM holds windows and the swap disk holds the model: its weights and optimizer
state (and, with clipping or accumulation, each step's spilled gradients). In the write-lean
mode (``precision=bf16-lean`` with ``optim=adamw8bit``) that is 2 B of bf16 weight and 2 B of
8-bit moments per parameter (their scales stay in RAM), so the free space of the swap
directory (``outcore doctor``'s figure) bounds the model. :func:`largest_full_finetune`
sizes each of :data:`REFERENCE_SHAPES` exactly as the plan does (``sizes.unit_bytes``: every
tensor padded as the store pads it) and names the largest that fits, with what it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes import BF16_LEAN
from .sizes import model_spec, unit_bytes

#: free space kept back: the swap file's growth margin (``nvme.reserve_margin``: 1/16) and the
#: run's own checkpoints and export are not in the swap, but a disk filled to its last byte is
#: no place for them either
HEADROOM = 1 / 16

#: Llama-style shapes named by the size class of the models that have them (their HF config
#: fields); ``scripts/bench_big.py --shape`` builds them with random weights
REFERENCE_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                         rope_theta=130000.0, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=False),
    # Qwen2.5-14B's dimensions as a Llama block (no q/k/v biases): 14.8B parameters
    "14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                rope_theta=1000000.0, tie_word_embeddings=False),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_theta=500000.0, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class DiskFit:
    """What one shape needs on the swap disk for a full fine-tune."""

    shape: str
    params: int
    swap_bytes: int  # weights + optimizer state on NVMe (+ spilled gradients when kept)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "params": self.params, "swap_bytes": self.swap_bytes}


def swap_bytes_per_shape(optim: str = "adamw8bit", precision: str = BF16_LEAN, grads_kept: bool = False,
                         layers: int | None = None) -> list[DiskFit]:
    """Each reference shape's swap bytes for a full fine-tune, smallest first.

    Args:
        optim, precision: the optimizer and precision (default: the write-lean mode).
        grads_kept: clipping or accumulation: each step's gradients spill to the disk too.
        layers: size only this many blocks of each shape (tests); None: the whole shape.

    Returns:
        One :class:`DiskFit` per shape of :data:`REFERENCE_SHAPES`, by swap bytes.
    """
    from transformers import LlamaConfig

    out = []
    for name, fields in REFERENCE_SHAPES.items():
        config = LlamaConfig(**{**fields, **({"num_hidden_layers": layers} if layers else {})})
        units = unit_bytes(model_spec(config), method="full", optim=optim, dtype="bfloat16", precision=precision)
        need = sum(u.weights + u.state - u.ram_state + (u.grads if grads_kept else 0) for u in units)
        out.append(DiskFit(name, sum(u.trainable for u in units), need))
    return sorted(out, key=lambda f: f.swap_bytes)


def largest_full_finetune(free_bytes: int, **kwargs: Any) -> DiskFit | None:
    """The largest reference shape whose full fine-tune fits ``free_bytes`` of swap disk (less
    :data:`HEADROOM`), or None when not even the smallest does.

    Args:
        free_bytes: the swap directory's free space (``probe_hardware().swap_free_bytes``).
        **kwargs: as :func:`swap_bytes_per_shape`.
    """
    usable = int(free_bytes * (1 - HEADROOM))
    fits = [f for f in swap_bytes_per_shape(**kwargs) if f.swap_bytes <= usable]
    return fits[-1] if fits else None
