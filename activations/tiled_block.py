"""Sequence-tiled decoder blocks: a recomputed block's memory grows with the tile, not the sequence.

A recomputed block (``RECOMPUTE*``) saves only its input; in the backward
``torch.utils.checkpoint`` runs the whole block again and holds everything it saves for
every token at once: at 16K tokens of SmolLM2-135M in fp32, ~320 MiB (the norms' fp32
copies, q / k / v, the attention output) beside ~4 MiB per block of checkpoints.
:class:`TiledBlock` is that checkpoint computed ``tile`` positions at a time:

* **forward** (no graph): tiles in order; each tile's keys and values are written into one
  ``[batch, kv_heads, seq, head_dim]`` buffer, and its queries attend to the buffer's prefix
  (causal, so every key a tile needs exists by then). Everything else in a block is per token.
* **backward**: the keys and values of every tile but the last are recomputed first (the
  block's forward runs up to its attention and stops: the norm and three projections), then
  the tiles in *reverse* order, each with a graph of its own: its queries attend to the
  earlier keys and values as leaves, so its backward yields their gradients, summed into
  fp32 buffers; a tile's own keys and values have then received every later tile's gradient
  (causal: only later queries read them) and get it as a second root of their graph.

So the backward holds, beyond the checkpoint and the gradients in and out, the keys and
values and their gradient sums (``4 x kv_heads x head_dim`` per token: a third of the hidden
size in SmolLM2's grouped attention) and one tile's graph. The cost: the recompute runs the
norm and the k / v projections twice (and q's once more, discarded), ~15% of SmolLM2-135M's
block FLOPs, and copies each tile's key / value prefix once (``O(seq)`` per tile).

The block's own ``forward`` does the work (its norms, residuals, projections, RoPE, MLP — a
tiled MLP's wrapper included), so any family whose attention goes through transformers'
attention interface is tiled as it is written: only the attention function is replaced,
for the duration of one tile's call, by :func:`_tile_attention`. Blocks are tiled where
:func:`tileable` says: SDPA attention, pure causal (no mask tensor: no padding, no packed
documents, no sliding window in effect), no dropout; elsewhere the block is checkpointed whole.

**Exactness (fp32, CPU).** Per-token work is the same rows whatever the tile (as the tiled
MLP: ``tiling.py``). Attention over tiles of a multiple of 1024 positions is bit-identical
to one call over the sequence: PyTorch's CPU flash kernel splits queries by 256 and keys by
512 from position 0 either way (tested). So the block's output, and the gradient w.r.t. its
input, match the untiled block but for the order of the sums that cross tiles: each
weight's gradient (one sum per tile, as the tiled MLP's) and each key's and value's (one
per later tile). Those differ by fp32 rounding: a reordered sum of ``tiles`` partial sums,
measured ~1e-7 of the largest element on a tiny Llama. Other tiles, and accelerators
(whose flash kernels tile differently), differ from the untiled attention by rounding too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError

ATTENTION_NAME = "outcore_tiled_sdpa"  # registered in transformers' AttentionInterface
_now = threading.local()  # .tile: the _Tile being computed on this thread (the backward may run on another)


class _KeysReady(Exception):
    """Stops a block's forward at its attention: the tile's keys and values are stored."""


class _Tile:
    """One tile's positions ``[lo, hi)`` and the sequence's key / value buffers it reads and writes.

    ``mode``: ``"forward"`` (store this tile's keys, attend to the prefix), ``"keys"`` (store
    them and stop) or ``"grad"`` (attend to the stored prefix as leaves, keep this tile's own
    keys and values with their graph: ``own``, ``prev``).
    """

    def __init__(self, kv: dict, lo: int, hi: int, mode: str):
        self.kv, self.lo, self.hi, self.mode = kv, lo, hi, mode
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prev: tuple[torch.Tensor, ...] = ()

    def __enter__(self) -> "_Tile":
        _now.tile = self
        return self

    def __exit__(self, *exc) -> None:
        _now.tile = None

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if "k" not in self.kv:  # (shapes and dtype from the first tile's keys)
            shape = (*key.shape[:2], self.kv["seq"], key.shape[3])
            self.kv["k"] = key.new_empty(shape)
            self.kv["v"] = value.new_empty((*shape[:3], value.shape[3]))
        self.kv["k"][:, :, self.lo:self.hi] = key
        self.kv["v"][:, :, self.lo:self.hi] = value


def _tile_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal SDPA of one tile's queries over the keys up to its end (transformers' attention signature)."""
    t: _Tile | None = getattr(_now, "tile", None)
    if t is None or attention_mask is not None or dropout:
        raise ModelError("outcore's tiled attention ran outside a tiled block, or with a mask or dropout; "
                         "set seq_tile=0 to run this model untiled")
    if t.mode == "grad":
        t.own = (key, value)
        if t.lo:  # the earlier keys and values: leaves whose gradients the backward sums
            t.prev = tuple(t.kv[n][:, :, :t.lo].detach().requires_grad_(x.requires_grad)
                           for n, x in (("k", key), ("v", value)))
            key, value = torch.cat([t.prev[0], key], 2), torch.cat([t.prev[1], value], 2)
    else:
        t.store(key, value)
        if t.mode == "keys":
            raise _KeysReady
        key, value = t.kv["k"][:, :, :t.hi], t.kv["v"][:, :, :t.hi]
    gqa = query.shape[1] != key.shape[1]
    if t.lo == 0:  # the first tile: square and causal, as the untiled call's first rows
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif query.device.type == "cpu":
        # row r of the tile sees keys <= lo + r; a boolean mask keeps the CPU flash kernel
        # (bit-identical to the untiled rows, see the module doc)
        mask = torch.ones(t.hi - t.lo, t.hi, dtype=torch.bool, device=query.device).tril(t.lo)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    else:  # accelerators: lower-right causal, which their flash / memory-efficient kernels take
        from torch.nn.attention.bias import causal_lower_right
        if gqa:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(t.hi - t.lo, t.hi),
                                             scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, _tile_attention)


def tileable_layer(layer: Any) -> bool:
    """Whether ``layer`` is a block :class:`TiledBlock` can run: SDPA attention (``self_attn``
    with the model's config), no dropout anywhere in it."""
    attn = getattr(layer, "self_attn", None)
    config = getattr(attn, "config", None)
    return (isinstance(layer, nn.Module) and config is not None
            and getattr(config, "_attn_implementation", None) in ("sdpa", None)  # (None: transformers' default)
            and not float(getattr(attn, "attention_dropout", 0.0) or 0.0)
            and not any(isinstance(m, nn.Dropout) and m.p > 0 for m in layer.modules()))


def tileable(layer: nn.Module, kwargs: dict, seq: int, tile: int) -> bool:
    """Whether :class:`TiledBlock` computes this call of ``layer`` as its own forward: a
    :func:`tileable_layer`, a sequence longer than one tile, a pure causal mask (none passed:
    no padding, no packed documents, no sliding window in effect), RoPE as ``(cos, sin)``."""
    pe = kwargs.get("position_embeddings")
    return (0 < tile < seq and kwargs.get("attention_mask") is None and not kwargs.get("output_attentions")
            and isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(p, torch.Tensor) for p in pe)
            and tileable_layer(layer))


def block_runner(layer: nn.Module, forward: Callable[..., Any], kwargs: dict
                 ) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """``run(x, lo, hi)``: ``layer``'s own ``forward`` on positions ``[lo, hi)`` (``x`` those rows),
    its RoPE and position ids sliced to them, attention through :func:`_tile_attention`
    (``kwargs``: the block's, without a KV cache)."""
    _register()
    config = layer.self_attn.config

    def run(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        part = dict(kwargs, position_embeddings=tuple(p[:, lo:hi] for p in kwargs["position_embeddings"]))
        for name in ("position_ids", "cache_position"):
            if isinstance(part.get(name), torch.Tensor):
                part[name] = part[name][..., lo:hi]
        # the config's attention for this call only (the attribute its setter writes)
        was = config._attn_implementation_internal
        config._attn_implementation_internal = ATTENTION_NAME
        try:
            out = forward(x, **part)
        finally:
            config._attn_implementation_internal = was
        if not isinstance(out, torch.Tensor):
            raise ModelError(f"{type(layer).__name__} returns {type(out).__name__}, not its hidden states; "
                             f"set seq_tile=0 to run it untiled")
        return out
    return run


class TiledBlock(torch.autograd.Function):
    """``run`` over ``tile`` positions at a time, saving only ``x`` (see the module doc).

    ``params`` are the block's trainable parameters: inputs of the function, so each gets its
    gradient once, summed over the tiles (the out-of-core engine counts one accumulation).
    """

    @staticmethod
    def forward(ctx, run: Callable[[torch.Tensor, int, int], torch.Tensor], tile: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tile, ctx.params = run, tile, params
        ctx.save_for_backward(x)
        seq, kv = x.shape[1], {"seq": x.shape[1]}
        out = torch.empty_like(x)
        with torch.no_grad():
            for lo in range(0, seq, tile):
                hi = min(seq, lo + tile)
                with _Tile(kv, lo, hi, "forward"):
                    out[:, lo:hi] = run(x[:, lo:hi], lo, hi)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        seq, tile, run = x.shape[1], ctx.tile, ctx.run
        starts = list(range(0, seq, tile))
        kv: dict = {"seq": seq}
        with torch.no_grad():  # the keys and values the tiles after the first attend to
            for lo in starts[:-1]:
                try:
                    with _Tile(kv, lo, lo + tile, "keys"):
                        run(x[:, lo:lo + tile], lo, lo + tile)
                except _KeysReady:
                    continue
                raise ModelError("a tiled block computed no attention through outcore's tiles; set seq_tile=0")
        need_x = ctx.needs_input_grad[2]
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        kv_grads: list[torch.Tensor | None] = [None, None]  # fp32 sums for the keys / values before the last tile
        for lo in reversed(starts):
            hi = min(seq, lo + tile)
            xt = x[:, lo:hi].detach().requires_grad_(need_x)
            with _Tile(kv, lo, hi, "grad") as t, torch.enable_grad():
                y = run(xt, lo, hi)
            roots, seeds = [y], [grad_out[:, lo:hi]]
            for own, acc in zip(t.own, kv_grads):  # every later tile's gradient w.r.t. this tile's keys
                if acc is not None and own.requires_grad:
                    roots.append(own)
                    seeds.append(acc[:, :, lo:hi].to(own.dtype))
            prev = [p for p in t.prev if p.requires_grad]
            wanted = ([xt] if need_x else []) + prev + params
            grads = list(torch.autograd.grad(roots, wanted, seeds, allow_unused=True))
            if need_x:
                grad_x[:, lo:hi] = grads.pop(0)
            for j, p in enumerate(t.prev):
                if not p.requires_grad:
                    continue
                g = grads.pop(0)
                if kv_grads[j] is None:
                    kv_grads[j] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                if g is not None:
                    kv_grads[j][:, :, :lo].add_(g)
            for i, g in enumerate(grads):  # one sum per tile, in fp32 (as TiledMLP)
                if g is not None:
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        it = iter(s if s is None else s.to(p.dtype) for s, p in zip(sums, params))
        return (None, None, grad_x, *(next(it) if need else None for need in ctx.needs_input_grad[3:]))
