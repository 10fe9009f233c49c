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
  earlier keys and values, whose gradients its backward adds, a prefix chunk at a time, into
  fp32 sums; a tile's own keys and values have then received every later tile's gradient
  (causal: only later queries read them) and get it as a second root of their graph. The
  gradient w.r.t. the block's input is written, tile by tile, over the gradient w.r.t. its
  output where only autograd holds that (``_private``; every block of transformers' decoders).

So the backward holds, beyond the checkpoint and the gradient flowing through the blocks, the
keys and values and their fp32 gradient sums (``(c + 4) x 2 x kv_heads x head_dim`` bytes per
token: 1.3 checkpoints' worth in SmolLM2's grouped attention in fp32; on an accelerator, until
it gets the same merge, the prefix is also concatenated and repeated per query head, and its
gradient is whole) and one tile's graph. The cost: the recompute runs the norm and the k / v
projections twice (and q's once more, discarded), ~15% of SmolLM2-135M's block FLOPs;
measured, the same step time as untiled at 8K and 16K.

The block's own ``forward`` does the work (its norms, residuals, projections, RoPE, MLP — a
tiled MLP's wrapper included), so any family whose attention goes through transformers'
attention interface is tiled as it is written: only the attention function is replaced,
for the duration of one tile's call, by :func:`_tile_attention`. Blocks are tiled where
:func:`tileable` says: SDPA attention, pure causal (no mask tensor: no padding, no packed
documents, no sliding window in effect), no dropout; elsewhere the block is checkpointed whole.

**Exactness (fp32).** Per-token work is the same rows whatever the tile (as the tiled MLP:
``tiling.py``). A tile's attention after the first is two flash calls merged by their
log-sum-exps (:class:`_PrefixAttention`; no ``[tile, seq]`` mask, which SDPA would widen to
floats and save), which rounds differently from one call over the sequence; and the sums that
cross tiles — each weight's gradient (one sum per tile, as the tiled MLP's) and each key's and
value's (one per later tile) — are added in another order. So the loss and every gradient
match the untiled block within fp32 rounding: measured within ~5e-7 of each gradient's largest
element on a tiny Llama (``tests/activations/test_tiled_block.py`` bounds it at 2e-6).
Offloaded == in memory, bit for bit.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError

ATTENTION_NAME = "outcore_tiled_sdpa"  # registered in transformers' AttentionInterface
MERGED_ON = ("cpu",)  # device types whose tiles attend to their prefix by _PrefixAttention (CPU flash ops)
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

    def chunks(self) -> list[tuple[int, int]]:
        """The prefix ``[0, lo)`` in tiles (``_PrefixAttention`` attends to one at a time)."""
        step = self.kv["tile"]
        return [(a, min(a + step, self.lo)) for a in range(0, self.lo, step)]

    def grad_sum(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The fp32 sum of the gradients w.r.t. the sequence's keys (``"k"``) or values (``"v"``),
        which every later tile adds to (allocated by the first tile that does)."""
        if self.summed(name) is None:
            self.kv["d" + name] = torch.zeros(self.kv[name].shape, dtype=torch.float32, device=like.device)
        return self.kv["d" + name]

    def summed(self, name: str) -> torch.Tensor | None:
        """:meth:`grad_sum` where a later tile has added to it, else None."""
        return self.kv.get("d" + name)


class _PrefixAttention(torch.autograd.Function):
    """Causal attention of one tile's queries (positions ``[lo, hi)``) over the keys before it
    and its own, on the CPU, with no ``[tile, hi]`` mask: flash calls merged by their
    log-sum-exps (the split softmax of ring attention), ``softmax = sum_j w_j softmax_j``:

    * the tile's own keys, causal and square: repeated per query head (a tile's worth);
    * the prefix ``[0, lo)`` in chunks of a tile, unmasked: a kv group's query heads stacked
      along the sequence (rows are independent without a mask), so grouped attention reads
      its keys unrepeated, straight from the sequence's buffers (strided views: no copy).

    The backward of each part is flash's own, given the *merged* output and log-sum-exp (what a
    part's softmax is, renormalized: each part's gradient is exact). A prefix chunk's key and
    value gradients are added in place into the tile's fp32 sums (``_Tile.grad_sum``), so the
    backward holds one chunk's, not the prefix's: 1.5 KB per token of the prefix in SmolLM2's
    fp32. A boolean mask instead would be widened by SDPA to ``[tile, hi]`` floats and saved:
    128 MiB per tile of 4096 at 8K tokens in fp32, growing with the sequence. Merging rounds
    differently from one call (~1e-7 of the output in fp32).
    """

    @staticmethod
    def forward(ctx, q, k_own, v_own, t: "_Tile", scale):
        b, h, n, d = q.shape
        rep = h // k_own.shape[1]
        fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = fa(q, k_own.repeat_interleave(rep, 1), v_own.repeat_interleave(rep, 1), 0.0, True, scale=scale)
        out = out.float()  # (the merge in fp32: one rounding in 16 bits)
        stacked = q.reshape(b, -1, rep * n, d)
        for lo, hi in t.chunks():
            part, part_lse = fa(stacked, t.kv["k"][:, :, lo:hi], t.kv["v"][:, :, lo:hi], 0.0, False, scale=scale)
            part_lse = part_lse.reshape(b, h, n)
            merged = torch.logaddexp(lse, part_lse)
            out = (torch.exp(lse - merged).unsqueeze(-1) * out
                   + torch.exp(part_lse - merged).unsqueeze(-1) * part.reshape(b, h, n, d))
            lse = merged
        out = out.to(q.dtype)
        ctx.scale, ctx.t = scale, t
        ctx.save_for_backward(q, k_own, v_own, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_own, v_own, out, lse = ctx.saved_tensors
        t, scale = ctx.t, ctx.scale
        b, h, n, d = q.shape
        g = k_own.shape[1]
        rep = h // g
        fb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq, dk, dv = fb(grad, q, k_own.repeat_interleave(rep, 1), v_own.repeat_interleave(rep, 1), out, lse,
                        0.0, True, scale=scale)
        dq = dq.float()  # (summed over the parts in fp32, as the keys' gradients: one rounding in 16 bits)
        stacked = [x.reshape(b, g, rep * n, d) for x in (grad, q, out)]
        lse = lse.reshape(b, g, rep * n)
        sums = [t.grad_sum(name, x) if need else None
                for name, x, need in (("k", k_own, ctx.needs_input_grad[1]), ("v", v_own, ctx.needs_input_grad[2]))]
        for lo, hi in t.chunks():
            dq_part, *dkv = fb(stacked[0], stacked[1], t.kv["k"][:, :, lo:hi], t.kv["v"][:, :, lo:hi], stacked[2], lse,
                               0.0, False, scale=scale)
            dq += dq_part.reshape(b, h, n, d)
            for acc, part in zip(sums, dkv):
                if acc is not None:
                    acc[:, :, lo:hi].add_(part)
        own = (b, g, rep, n, d)
        return dq.to(q.dtype), dk.reshape(own).sum(2), dv.reshape(own).sum(2), None, None


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
    else:
        t.store(key, value)
        if t.mode == "keys":
            raise _KeysReady
    if not t.lo:  # the first tile: square and causal, as the untiled call's first rows
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    elif query.device.type in MERGED_ON:  # (its backward adds the prefix's gradients to the sums)
        out = _PrefixAttention.apply(query, key, value, t, scaling)
    else:  # accelerators: lower-right causal, which their flash kernels take without a mask
        from torch.nn.attention.bias import causal_lower_right
        prev = tuple(t.kv[n][:, :, :t.lo] for n in ("k", "v"))
        if t.mode == "grad":  # the earlier keys and values: leaves whose gradients the backward sums
            prev = t.prev = tuple(p.detach().requires_grad_(x.requires_grad) for p, x in zip(prev, (key, value)))
        rep = query.shape[1] // key.shape[1]
        key, value = (torch.cat([p, x], 2).repeat_interleave(rep, 1) for p, x in zip(prev, (key, value)))
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
        was = config._attn_implementation  # the config's attention, for this call only
        config._attn_implementation = ATTENTION_NAME
        try:
            out = forward(x, **part)
        finally:
            config._attn_implementation = was
        if not isinstance(out, torch.Tensor):
            raise ModelError(f"{type(layer).__name__} returns {type(out).__name__}, not its hidden states; "
                             f"set seq_tile=0 to run it untiled")
        return out
    return run


def _private(grad: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether the backward may write into ``grad``: a dense tensor of ``like``'s layout that only
    autograd's call holds (no view, no alias; one reference to it and to its storage). A node
    that hands the same gradient to two inputs (an add whose other input is still waiting) holds
    a second reference, and then the input's gradient gets its own buffer."""
    use_count = getattr(grad, "_use_count", None)  # (a private API: where it is missing, never in place)
    return (use_count is not None and use_count() == 1 and grad._base is None and grad.is_contiguous()
            and grad.shape == like.shape and grad.dtype == like.dtype and grad.device == like.device
            and torch._C._storage_Use_Count(grad.untyped_storage()._cdata) <= 2)  # (this tensor's, and ours)


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
        seq, kv = x.shape[1], {"seq": x.shape[1], "tile": tile}
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
        kv: dict = {"seq": seq, "tile": tile}
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
        # the input's gradient, tile by tile, into grad_out's rows once they are seeded (reverse
        # order: a tile's rows are read by no later step) where nothing else holds it: one
        # sequence-long gradient instead of two
        grad_x = (grad_out if _private(grad_out, x) else torch.empty_like(x)) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for lo in reversed(starts):
            hi = min(seq, lo + tile)
            xt = x[:, lo:hi].detach().requires_grad_(need_x)
            with _Tile(kv, lo, hi, "grad") as t, torch.enable_grad():
                y = run(xt, lo, hi)
            roots, seeds = [y], [grad_out[:, lo:hi]]
            for own, name in zip(t.own, "kv"):  # every later tile's gradient w.r.t. this tile's keys
                if (acc := t.summed(name)) is not None and own.requires_grad:
                    roots.append(own)
                    seeds.append(acc[:, :, lo:hi].to(own.dtype))
            prev = [p for p in t.prev if p.requires_grad]  # (accelerators: the prefix as leaves)
            wanted = ([xt] if need_x else []) + prev + params
            grads = list(torch.autograd.grad(roots, wanted, seeds, allow_unused=True))
            if need_x:
                grad_x[:, lo:hi] = grads.pop(0)
            for p, name in zip(t.prev, "kv"):
                if p.requires_grad and (g := grads.pop(0)) is not None:
                    t.grad_sum(name, p)[:, :, :lo].add_(g)
            for i, g in enumerate(grads):  # one sum per tile, in fp32 (as TiledMLP)
                if g is not None:
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        it = iter(s if s is None else s.to(p.dtype) for s, p in zip(sums, params))
        return (None, None, grad_x, *(next(it) if need else None for need in ctx.needs_input_grad[3:]))
