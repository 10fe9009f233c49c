"""Chunked linear + cross-entropy: the causal-LM loss without [tokens, vocab] logits.

The full-logits path materialises ``hidden @ weight.T`` ([N, V] fp32: 1.6 GB at
8k tokens and a 49k vocabulary) plus its log-softmax and their gradients. Here
the rows are processed ``chunk_size`` at a time: a chunk's logits are computed,
turned *in place* into the gradient of the loss w.r.t. those logits, and
contracted into ``d_hidden`` (rows of the chunk) and ``d_weight`` (accumulated in
fp32, or in 16 bits one GEMM over the kept [N, V] d_logits when N is small).

Gradients are computed **during the forward** for ``reduction="mean"|"sum"``:
the backward then only scales them by the incoming scalar gradient. That costs
the same three matmuls as the reference (recomputing in the backward would cost
four, ~1.33x the time); the price is that ``d_weight`` ([V, H]) is held from the
forward until the backward. ``reduction="none"`` needs one gradient per row, so
its backward recomputes the logits chunk by chunk (a second op).

Ops (docs/architecture.md §9), declared with ``torch.library.custom_op``:

- ``outcore::linear_cross_entropy_fwd`` -> (loss, d_hidden, d_weight, d_bias)
- ``outcore::linear_cross_entropy_bwd`` -> (d_hidden, d_weight, d_bias)

Their default impl (CPU and any device) is pure PyTorch; on ``cuda`` the same chunk loop
runs the per-chunk softmax/gradient pass as a Triton kernel (``linear_cross_entropy_triton.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError, DataError, ModelError
from ._library import op_name, triton_usable

REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
# default chunk: ~32 MiB of fp32 logits. The chunk is the loss's own peak memory; at vocab
# 49152 x hidden 576 on 2 cores 32 and 64 MiB chunks take the same time (0.47-0.51 s for 510
# rows, forward and backward), 16 MiB about 20% more (the [V, H] d_weight is re-read per chunk).
_CHUNK_LOGITS_BYTES = 32 << 20

# A chunk CE function: (logits [c, V] fp32, modified in place into d_logits when need_grad;
# targets [c] int64; scale [c] fp32; ignore_index; label_smoothing; need_grad) -> loss [c] fp32.
ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, bool], torch.Tensor]


def default_chunk_size(n_rows: int, vocab: int) -> int:
    """Rows per chunk so that one chunk of fp32 logits is about 32 MiB.

    Args:
        n_rows: rows (tokens) in the loss.
        vocab: vocabulary size V.

    Returns:
        A power of two in [16, max(16, n_rows)], or ``n_rows`` when that is smaller.
    """
    rows = max(16, _CHUNK_LOGITS_BYTES // (4 * max(1, vocab)))
    rows = 1 << (rows.bit_length() - 1)  # power of two: steady GEMM shapes
    return max(1, min(rows, n_rows))


def ce_chunk_reference(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       ignore_index: int, label_smoothing: float, need_grad: bool) -> torch.Tensor:
    """Cross-entropy of one chunk of logits; optionally turns them into their gradient.

    Args:
        logits: [c, V] fp32, contiguous. Overwritten with
            ``scale * (softmax - (1 - eps) * onehot - eps / V)`` (0 on ignored rows)
            when ``need_grad``.
        targets: [c] int64 class ids (``ignore_index`` marks rows without a loss).
        scale: [c] fp32 gradient weight of each row's loss.
        ignore_index: target value of ignored rows.
        label_smoothing: eps in [0, 1].
        need_grad: whether to write the gradient into ``logits`` (without it,
            ``logits`` is left holding unnormalised exponentials).

    Returns:
        [c] fp32 per-row loss (0 on ignored rows).
    """
    c, vocab = logits.shape
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    loss = (label_smoothing - 1.0) * logits.gather(1, safe_t).squeeze(1)
    if label_smoothing > 0.0:
        loss -= (label_smoothing / vocab) * logits.sum(dim=1)
    # Softmax in place (one [c, V] buffer, no temporaries): x -> exp(x - max) -> / sum.
    row_max = logits.amax(dim=1, keepdim=True)
    logits.sub_(row_max).exp_()
    sum_exp = logits.sum(dim=1, keepdim=True)
    loss += (row_max + sum_exp.log()).squeeze(1)  # + logsumexp
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if need_grad:
        logits.div_(sum_exp)
        logits.scatter_add_(1, safe_t, torch.full_like(loss, label_smoothing - 1.0).unsqueeze(1))
        if label_smoothing > 0.0:
            logits.sub_(label_smoothing / vocab)
        logits.mul_(torch.where(valid, scale, torch.zeros_like(scale)).unsqueeze(1))
    return loss


def _ce_chunk_cuda(logits, targets, scale, ignore_index, label_smoothing, need_grad):
    """The CUDA chunk impl: the Triton kernel where triton is installed, else the reference."""
    if triton_usable(logits):
        from .linear_cross_entropy_triton import ce_chunk_triton  # lazy: triton only on use
        return ce_chunk_triton(logits, targets, scale, ignore_index, label_smoothing, need_grad)
    return ce_chunk_reference(logits, targets, scale, ignore_index, label_smoothing, need_grad)


def lce_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               bias: Optional[torch.Tensor], scale: torch.Tensor, ignore_index: int,
               label_smoothing: float, chunk_size: int, need_dh: bool, need_dw: bool,
               need_db: bool, ce_chunk: ChunkFn = ce_chunk_reference):
    """The chunk loop shared by the forward and backward ops (and by the Triton path).

    Args:
        hidden: [N, H] in the compute dtype.
        weight: [V, H] same dtype as ``hidden``.
        targets: [N] int64.
        bias: [V] or None.
        scale: 0-d or [N] fp32 gradient weight of each row's loss.
        ignore_index, label_smoothing: as in ``torch.nn.functional.cross_entropy``.
        chunk_size: rows per chunk (>= 1).
        need_dh, need_dw, need_db: which gradients to compute.
        ce_chunk: per-chunk CE function (reference or Triton).

    Returns:
        (loss_rows [N] fp32, d_hidden [N, H], d_weight [V, H] fp32 (16-bit: ``few``),
        d_bias [V] fp32; each None when not needed).
    """
    n, _ = hidden.shape
    vocab = weight.shape[0]
    need_grad = need_dh or need_dw or need_db
    loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if need_dh else None
    # 16-bit, few rows: d_logits kept ([N, V] <= the [V, H] fp32 accumulator), d_weight one GEMM
    # after the loop (Llama-3-8B, 256 tokens: 63 MiB, not 2 GiB + 3 GiB of temporaries per chunk)
    few = need_dw and hidden.dtype != torch.float32 and n * hidden.element_size() <= 4 * hidden.shape[1]
    d_logits = hidden.new_empty(n, vocab) if few else None
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw and not few else None
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_db else None
    scale = scale.to(torch.float32).expand(n) if scale.dim() == 0 else scale.to(torch.float32)
    w_t = weight.t()
    for start in range(0, n, chunk_size):
        stop = min(n, start + chunk_size)
        h = hidden[start:stop]
        logits = torch.addmm(bias, h, w_t) if bias is not None else torch.mm(h, w_t)  # [c, V]
        if logits.dtype != torch.float32:
            logits = logits.float()  # like HF's ForCausalLMLoss: the loss is taken in fp32
        loss_rows[start:stop] = ce_chunk(logits, targets[start:stop], scale[start:stop],
                                         ignore_index, label_smoothing, need_grad)
        if not need_grad:
            del logits
            continue
        g = logits.to(hidden.dtype)  # d_logits [c, V]; a no-op in fp32
        if need_dh:
            torch.mm(g, weight, out=d_hidden[start:stop])
        if few:
            d_logits[start:stop] = g
        elif need_dw:
            # 16-bit: the chunk's product added as it is (widened element by element, exactly:
            # no fp32 [V, H] copy beside the accumulator)
            d_weight.addmm_(g.t(), h) if g.dtype == torch.float32 else d_weight.add_(torch.mm(g.t(), h))
        if need_db:
            d_bias.add_(logits.sum(dim=0))
        # drop this chunk now: rebinding `logits` would free it after the next one exists
        del logits, g
    if few:
        d_weight = torch.mm(d_logits.t(), hidden)
    return loss_rows, d_hidden, d_weight, d_bias



def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


# ----------------------------------------------------------------------------- ops
@torch.library.custom_op(op_name("linear_cross_entropy_fwd"), mutates_args=())
def _lce_fwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
             reduction: int, chunk_size: int, need_dh: bool, need_dw: bool, need_db: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                     chunk_size, need_dh, need_dw, need_db, ce_chunk_reference)


def _fwd_impl(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, chunk_size,
              need_dh, need_dw, need_db, ce_chunk: ChunkFn):
    n_valid = (targets != ignore_index).sum().to(torch.float32)
    if reduction == REDUCTIONS["none"]:
        need_dh = need_dw = need_db = False  # per-row grads: the backward op recomputes them
    if reduction == REDUCTIONS["mean"]:
        scale = 1.0 / n_valid
    else:  # sum (and "none", where no grads are computed here)
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    loss_rows, dh, dw, db = lce_chunks(hidden, weight, targets, bias, scale, ignore_index,
                                       label_smoothing, chunk_size, need_dh, need_dw, need_db,
                                       ce_chunk)
    if reduction == REDUCTIONS["mean"]:
        loss = loss_rows.sum() / n_valid
    elif reduction == REDUCTIONS["sum"]:
        loss = loss_rows.sum()
    else:
        loss = loss_rows
    return (loss, dh if dh is not None else _empty(hidden),
            dw.to(weight.dtype) if dw is not None else _empty(weight),
            db.to(bias.dtype) if db is not None else _empty(weight))


@_lce_fwd.register_fake
def _lce_fwd_fake(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                  chunk_size, need_dh, need_dw, need_db):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == REDUCTIONS["none"] else (), dtype=torch.float32)
    if reduction == REDUCTIONS["none"]:
        need_dh = need_dw = need_db = False
    return (loss, torch.empty_like(hidden) if need_dh else _empty(hidden),
            torch.empty_like(weight) if need_dw else _empty(weight),
            torch.empty_like(bias) if need_db else _empty(weight))


@torch.library.custom_op(op_name("linear_cross_entropy_bwd"), mutates_args=())
def _lce_bwd(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
             targets: torch.Tensor, bias: Optional[torch.Tensor], ignore_index: int,
             label_smoothing: float, chunk_size: int, need_dh: bool, need_dw: bool,
             need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(grad_rows, hidden, weight, targets, bias, ignore_index, label_smoothing,
                     chunk_size, need_dh, need_dw, need_db, ce_chunk_reference)


def _bwd_impl(grad_rows, hidden, weight, targets, bias, ignore_index, label_smoothing, chunk_size,
              need_dh, need_dw, need_db, ce_chunk: ChunkFn):
    _, dh, dw, db = lce_chunks(hidden, weight, targets, bias, grad_rows, ignore_index,
                               label_smoothing, chunk_size, need_dh, need_dw, need_db, ce_chunk)
    return (dh if dh is not None else _empty(hidden),
            dw.to(weight.dtype) if dw is not None else _empty(weight),
            db.to(bias.dtype) if db is not None else _empty(weight))


@_lce_bwd.register_fake
def _lce_bwd_fake(grad_rows, hidden, weight, targets, bias, ignore_index, label_smoothing,
                  chunk_size, need_dh, need_dw, need_db):
    return (torch.empty_like(hidden) if need_dh else _empty(hidden),
            torch.empty_like(weight) if need_dw else _empty(weight),
            torch.empty_like(bias) if need_db else _empty(weight))


# CUDA: the same chunk loop (cuBLAS matmuls) with the Triton softmax/gradient kernel per chunk.
@_lce_fwd.register_kernel("cuda")
def _lce_fwd_cuda(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                  chunk_size, need_dh, need_dw, need_db):
    return _fwd_impl(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction,
                     chunk_size, need_dh, need_dw, need_db, _ce_chunk_cuda)


@_lce_bwd.register_kernel("cuda")
def _lce_bwd_cuda(grad_rows, hidden, weight, targets, bias, ignore_index, label_smoothing,
                  chunk_size, need_dh, need_dw, need_db):
    return _bwd_impl(grad_rows, hidden, weight, targets, bias, ignore_index, label_smoothing,
                     chunk_size, need_dh, need_dw, need_db, _ce_chunk_cuda)


def _setup_context(ctx, inputs, output):
    (hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, chunk_size,
     need_dh, need_dw, need_db) = inputs
    ctx.needs = (need_dh, need_dw, need_db)
    ctx.reduction = reduction
    # The op's other outputs (d_hidden, d_weight, d_bias) get no gradient; without this,
    # autograd would hand the backward a zero tensor for each: [V, H] fp32, 108 MiB for SmolLM2.
    ctx.set_materialize_grads(False)
    if reduction == REDUCTIONS["none"]:
        ctx.args = (ignore_index, label_smoothing, chunk_size)
        ctx.save_for_backward(hidden, weight, targets, bias)
    else:
        ctx.save_for_backward(*output[1:])


def _backward(ctx, g_loss, _g_dh, _g_dw, _g_db):
    need_dh, need_dw, need_db = ctx.needs
    if ctx.reduction == REDUCTIONS["none"]:
        hidden, weight, targets, bias = ctx.saved_tensors
        dh, dw, db = _lce_bwd(g_loss.contiguous(), hidden, weight, targets, bias, *ctx.args,
                              need_dh, need_dw, need_db)
    else:
        dh, dw, db = ctx.saved_tensors
        # The usual incoming gradient is exactly 1: then the saved grads are the answer and
        # no [V, H] temporary is made. Reading it is free on CPU (on CUDA it would be a sync);
        # only a plain tensor is read: under tracing (fake/functional subclasses) it has no value.
        if not (type(g_loss) is torch.Tensor and g_loss.device.type == "cpu" and g_loss.item() == 1.0):
            dh, dw, db = dh * g_loss, dw * g_loss, db * g_loss
    return (dh if need_dh else None, dw if need_dw else None, None,
            db if need_db else None, None, None, None, None, None, None, None)


_lce_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk_size: Optional[int] = None) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets, ...)`` without the full logits.

    Args:
        hidden: [N, H] final hidden states (fp32/bf16/fp16).
        weight: [V, H] output projection (e.g. ``lm_head.weight``; may be tied to the
            embedding, gradients then accumulate into the shared parameter).
        targets: [N] integer class ids; ``ignore_index`` rows contribute nothing.
        bias: optional [V] output bias.
        ignore_index: target value to ignore.
        label_smoothing: in [0, 1], as in ``torch.nn.functional.cross_entropy``.
        reduction: "mean" (over non-ignored rows), "sum" or "none" ([N] fp32).
        chunk_size: rows per chunk; None picks ~32 MiB of logits per chunk.

    Returns:
        The fp32 loss: a scalar, or [N] for ``reduction="none"``.

    Raises:
        ConfigError: unknown ``reduction``, ``label_smoothing`` outside [0, 1], ``chunk_size`` < 1.
        ModelError: shapes or dtypes of ``hidden``/``weight``/``bias`` do not fit together.
        DataError: ``targets`` has the wrong shape/dtype or a class id outside [0, V).
    """
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not one of: {', '.join(REDUCTIONS)}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ConfigError(f"label_smoothing={label_smoothing!r} must be in [0, 1]")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ConfigError(f"chunk_size={chunk_size!r} must be >= 1 (or None for automatic)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ModelError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         f"[N, H] and [V, H] with the same H")
    if hidden.dtype != weight.dtype:
        raise ModelError(f"hidden dtype {hidden.dtype} differs from weight dtype {weight.dtype}; "
                         f"cast one of them")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ModelError(f"bias shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise DataError(f"targets {tuple(targets.shape)} {targets.dtype} must be integer class ids "
                        f"of shape ({hidden.shape[0]},)")
    vocab = weight.shape[0]
    targets = targets.long()
    if targets.device.type == "cpu" and targets.numel():  # free here; a sync on CUDA, so skipped
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise DataError(f"target {int(targets[bad][0])} is outside [0, {vocab}) and is not "
                            f"ignore_index={ignore_index}; check the tokenizer and the model's vocab")
    # Which grads autograd will ask for; with reduction mean/sum the forward op computes
    # them right away, with "none" its backward recomputes them.
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    chunk = int(chunk_size) if chunk_size is not None else default_chunk_size(hidden.shape[0], vocab)
    loss, *_ = _lce_fwd(hidden.contiguous(), weight, targets, bias, int(ignore_index),
                        float(label_smoothing), REDUCTIONS[reduction], chunk, *needs)
    return loss


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                   bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                   label_smoothing: float = 0.0, reduction: str = "mean",
                   chunk_size: Optional[int] = None,
                   num_items_in_batch: Optional[torch.Tensor | int] = None) -> torch.Tensor:
    """The causal-LM loss of Hugging Face's ``ForCausalLMLoss``, without full logits.

    Labels are shifted left inside (position t predicts ``labels[:, t + 1]``; the
    last position gets ``ignore_index``), exactly like HF, so pass the same
    ``labels`` you would pass to ``model(input_ids, labels=labels)``.

    Args:
        hidden: [B, T, H] final hidden states (after the model's final norm).
        weight: [V, H] ``lm_head.weight``.
        labels: [B, T] unshifted labels (``ignore_index`` where no loss is wanted).
        bias: optional [V] lm_head bias.
        ignore_index, label_smoothing: as in ``torch.nn.functional.cross_entropy``.
        reduction: "mean" (HF's default), "sum", or "none" ([B, T] fp32 per position).
        chunk_size: rows per chunk (None: automatic).
        num_items_in_batch: if given, HF's gradient-accumulation form: the sum of the
            losses divided by this count (``reduction`` must then be "mean").

    Returns:
        The fp32 loss (scalar, or [B, T] for ``reduction="none"``).

    Raises:
        ModelError / DataError / ConfigError: as :func:`linear_cross_entropy`, and when
        ``hidden`` is not [B, T, H] matching ``labels`` [B, T].
    """
    if hidden.dim() != 3:
        raise ModelError(f"hidden has shape {tuple(hidden.shape)}; causal_lm_loss needs [B, T, H]")
    if labels.shape != hidden.shape[:2]:
        raise DataError(f"labels shape {tuple(labels.shape)} must equal hidden's [B, T] = "
                        f"{tuple(hidden.shape[:2])}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ConfigError(f"num_items_in_batch is set, so reduction={reduction!r} must be 'mean'")
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # [B, T]: tokens < t predict t
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = shift.reshape(-1)
    red = "sum" if num_items_in_batch is not None else reduction
    loss = linear_cross_entropy(h2, weight, t1, bias=bias, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction=red,
                                chunk_size=chunk_size)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    if reduction == "none":
        loss = loss.view(labels.shape)
    return loss


#: config attributes that change a causal LM's loss beyond ``cross_entropy(lm_head(hidden))``,
#: with the value that leaves it unchanged: final-logit soft-capping (Gemma2), logit scaling
#: (Cohere, Granite), the routers' auxiliary loss (mixture-of-experts families)
_LOSS_CHANGES = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                 "output_router_logits": False}


def head_loss_covers(config: object) -> bool:
    """Whether :class:`CausalLMHeadLoss` computes exactly the model's own loss.

    The chunked loss is ``cross_entropy(hidden @ lm_head.weight.T)``; a model whose
    forward does more (soft-caps or scales the logits, adds a router auxiliary loss)
    must compute its loss itself, or the difference would be silently dropped.

    Args:
        config: the model's Hugging Face config (its ``text_config`` is read too).

    Returns:
        True when no attribute of the config changes the loss.
    """
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    return all(getattr(c, name, neutral) in (None, False, neutral)
               for c in configs for name, neutral in _LOSS_CHANGES.items())


class CausalLMHeadLoss(torch.nn.Module):
    """``lm_head`` + the causal-LM loss as one module: ``(hidden [B,T,H], labels [B,T]) -> loss``
    (a scalar, or with ``reduction="none"`` the ``[B, T]`` per-position losses); with ``labels``
    None, the logits (GRPO samples its completions through it out of core).

    Calling the head through a module (rather than reading ``lm_head.weight`` in
    a loss function) keeps module hooks working: the out-of-core engine brings
    the head's (possibly tied) weight in on this module's pre-forward hook.

    Args:
        lm_head: the model's output projection (``nn.Linear``; its weight may be tied).
    """

    def __init__(self, lm_head: torch.nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None, reduction: str = "mean") -> torch.Tensor:
        if labels is None:  # the logits, for sampling through the same module (and its hooks)
            return self.lm_head(hidden)
        return causal_lm_loss(hidden, self.lm_head.weight, labels, bias=getattr(self.lm_head, "bias", None),
                              reduction=reduction)
