"""Sequence-tiled MLP: a block's MLP over tiles of its tokens, so its memory grows with the tile.

A Llama-style block's MLP is per token: ``down(act(gate(x)) * up(x))``. Untiled, its
backward keeps four ``[tokens, intermediate]`` tensors (gate, act(gate), up, their
product) and builds three more gradients of that size: at 16K tokens and SmolLM2's
intermediate 1536 in fp32, ~100 MiB each, the largest part of what one block holds —
and what one block's recompute holds (``RECOMPUTE``). :class:`TiledMLP` (as Arctic Long
Sequence Training's TiledMLP) saves only the MLP's input, computes the output ``tile``
tokens at a time without a graph, and in the backward recomputes each tile with one and
takes its gradients, so those seven tensors exist for one tile at a time: the peak
grows with the tile, not the sequence.

**Exactness (fp32).** Every row of a matmul is the same dot products whichever rows it
is computed with, so the output, the loss and the gradient w.r.t. the MLP's input — and
from it every gradient below, and every other parameter's — are bit-identical to the
untiled block. The gradient of the MLP's own weights is a sum over tokens; tiled, it is
one sum per tile added up, a different order of the same fp32 additions, so it differs
by rounding: within ``(tokens + tiles) * 2**-24`` of ``|dy|^T |x|`` element-wise
(the standard bound of a reordered fp32 sum; measured on a tiny Llama, ~4e-7 of the
gradient's largest element). In 16 bits each tile's gradient is rounded by its own GEMM and
the tiles are added in fp32, rounded once: within one 16-bit rounding of a partial sum per
tile. Tiled and offloaded == tiled in memory, bit for bit.

The tile is ``seq_tile`` tokens of the micro-batch's rows flattened (batch x sequence):
``auto`` (:func:`auto_tile`) gives a tile ~32 MiB of one intermediate tensor, the chunked
loss's size (``kernels/linear_cross_entropy.py``); a micro-batch of at most one tile runs
the MLP untiled. Only a dense gated MLP (``gate_proj`` / ``up_proj`` / ``down_proj``,
whatever ``act_fn``) is tiled; a mixture of experts routes per batch and is left as it is.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError
from .policy import SEQ_TILE_AUTO, parse_seq_tile

_TILE_BYTES = 32 << 20  # one [tile, intermediate] tensor: the chunked loss's chunk of logits


def auto_tile(intermediate: int, dtype_bytes: int) -> int:
    """Tokens per tile so one ``[tile, intermediate]`` tensor is ~32 MiB: a power of two >= 256."""
    rows = max(256, _TILE_BYTES // max(1, intermediate * dtype_bytes))
    return 1 << (rows.bit_length() - 1)  # steady GEMM shapes


def resolve_tile(seq_tile: "int | str", intermediate: int, dtype_bytes: int) -> int:
    """Tokens per tile of ``seq_tile`` (``auto``, 0 = untiled, or a count) for a model's shape.

    Raises:
        ConfigError: neither ``auto`` nor an integer >= 0.
    """
    value = parse_seq_tile(seq_tile)
    return auto_tile(intermediate, dtype_bytes) if value == SEQ_TILE_AUTO else int(value)


def tile_of(model: nn.Module, seq_tile: "int | str") -> int:
    """Tokens per MLP tile of ``seq_tile`` for ``model``'s blocks (0: untiled, or no block to tile).

    Raises:
        ConfigError: a bad ``seq_tile``.
    """
    from ..models._structure import decoder_layers

    value = parse_seq_tile(seq_tile)
    layers = decoder_layers(model, any_layout=True)
    mlp = getattr(layers[0], "mlp", None) if len(layers) else None
    if not is_tileable(mlp):
        return 0
    gate = mlp.gate_proj
    weight = getattr(gate, "weight", None)  # (its dtype even while the engine holds it elsewhere)
    nbytes = weight.element_size() if isinstance(weight, torch.Tensor) else 4
    return resolve_tile(value, int(getattr(gate, "out_features", 0) or 1), nbytes)


def is_tileable(mlp: Any) -> bool:
    """A dense gated MLP (per token): what :class:`TiledMLP` may split."""
    return isinstance(mlp, nn.Module) and all(isinstance(getattr(mlp, n, None), nn.Module)
                                              for n in ("gate_proj", "up_proj", "down_proj"))


class TiledMLP(torch.autograd.Function):
    """``fn(x)`` over ``tile`` rows at a time, saving only ``x`` (see the module doc).

    ``params`` are the MLP's trainable parameters: inputs of the function, so autograd
    hands each its gradient once — summed over the tiles here — and a hook counting
    accumulations (the out-of-core engine's) sees one, as untiled.
    """

    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], tile: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile, ctx.params = fn, tile, params  # (parameters, not activations: nothing to save)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _tiled(fn, x, tile)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        params = [p for p, need in zip(ctx.params, needs) if need]
        rows, h = x.numel() // x.shape[-1], x.shape[-1]
        flat_x, flat_g = x.reshape(1, rows, h), grad_out.reshape(1, rows, -1)
        grad_x = torch.empty_like(flat_x) if ctx.needs_input_grad[2] else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for lo in range(0, rows, ctx.tile):
            # the tile's graph exists only here: recomputed, differentiated, dropped
            xt = flat_x[:, lo:lo + ctx.tile].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = ctx.fn(xt)
            wanted = ([xt] if grad_x is not None else []) + params
            grads = torch.autograd.grad(out, wanted, flat_g[:, lo:lo + ctx.tile], allow_unused=True)
            if grad_x is not None:
                grad_x[:, lo:lo + ctx.tile] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):  # one sum per tile, added in token order (16-bit: in fp32,
                if g is not None:          # as one GEMM over every token would accumulate)
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        it = iter(s if s is None else s.to(p.dtype) for s, p in zip(sums, params))
        return (None, None, None if grad_x is None else grad_x.view_as(x),
                *(next(it) if need else None for need in needs))


def _tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn`` over ``tile`` flattened rows of ``x`` at a time, into one output (no graph kept)."""
    rows, h = x.numel() // x.shape[-1], x.shape[-1]
    flat = x.reshape(1, rows, h)
    out = None
    for lo in range(0, rows, tile):
        part = fn(flat[:, lo:lo + tile])
        if out is None:
            out = part.new_empty((1, rows, part.shape[-1]))
        out[:, lo:lo + tile] = part
    return out.view(*x.shape[:-1], out.shape[-1])


def tile_mlp(mlp: nn.Module, tile: int) -> Callable[[], None]:
    """Run ``mlp`` (a dense gated MLP) over ``tile``-token tiles when its input has more rows.

    Wraps ``forward`` on the instance (the class's method is untouched). With autograd
    recording, :class:`TiledMLP`; without (eval, ``no_grad``), the same tiles without a
    graph, so an evaluation's peak also grows with the tile.

    Args:
        mlp: the block's MLP (:func:`is_tileable`).
        tile: tokens per tile (> 0).

    Returns:
        A function that removes the wrapper.
    """
    forward = mlp.forward
    if tile < 1:
        raise ConfigError(f"seq_tile={tile} must be >= 1 to tile")

    def tiled(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= tile:
            return forward(x)
        if not torch.is_grad_enabled():
            return _tiled(forward, x, tile)
        return TiledMLP.apply(forward, tile, x, *(p for p in mlp.parameters() if p.requires_grad))

    mlp.forward = tiled
    return lambda: mlp.__dict__.pop("forward", None)
