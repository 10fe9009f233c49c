"""Sizes the memory plan works from: bytes per unit and tensor class, activations, FLOPs.

Everything here is arithmetic on shapes. A model is described by a
:class:`ModelSpec` — its units of transfer (``embed, block.0 … block.L-1,
head``, cut exactly as the out-of-core engine cuts them, by
:func:`outcore.offload.units.causal_lm_units`) and the dimensions that size
activations. A spec is built from a live model or from its Hugging Face config
alone: the config is instantiated on the ``meta`` device, so a 70B plan
allocates no weights and takes well under a second.

Byte counts per parameter (``state_bytes``) follow each optimizer's design;
for those still being built in ``optim/`` they are the papers' layouts and
are marked as estimates in the plan's notes.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ..errors import ConfigError, ModelError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
Q8_BLOCK = 256  # outcore's 8-bit AdamW: one fp32 absmax per 256 elements per moment
NF4_BLOCK = 64  # QLoRA NF4: 4-bit codes, one fp32 absmax per 64 weights (no double quantization)
DEFAULT_RANK = {"galore": 128, "apollo": 256, "apollo-mini": 1}
DEFAULT_FRUGAL_DENSITY = 0.25  # share of each matrix with full Adam state (FRUGAL's rho)
ZO_OPTIMIZERS = ("mezo", "sparse-mezo")
#: Flat state buffers per unit for each optimizer (each one a separately aligned allocation).
STATE_KINDS = {"adamw": 2, "adamw8bit": 4, "galore": 3, "apollo": 2, "apollo-mini": 2, "frugal": 2,
               "mezo": 0, "sparse-mezo": 0}
OPTIMIZERS = ("adamw", "adamw8bit", "galore", "apollo", "apollo-mini", "frugal") + ZO_OPTIMIZERS


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a unit: its qualified name and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitSpec:
    """A unit of transfer and the parameters it owns (tied weights belong to the first user)."""

    index: int
    name: str  # "embed", "block.3", "head"
    kind: str  # "embed" | "block" | "head"
    params: tuple[ParamInfo, ...]
    borrows: tuple[int, ...] = ()  # units whose weights this one also needs (tied LM head)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a causal LM."""

    model_type: str
    units: tuple[UnitSpec, ...]
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    tied: bool

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)


# ---------------------------------------------------------------------------------
# Building a spec
# ---------------------------------------------------------------------------------
def _dims(cfg: Any) -> dict[str, int]:
    cfg = getattr(cfg, "text_config", None) or cfg  # multimodal wrappers (Gemma3) keep the LM here
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    return dict(hidden=hidden, intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
                heads=heads, kv_heads=kv, head_dim=head_dim, vocab=int(cfg.vocab_size),
                layers=int(cfg.num_hidden_layers))


def model_spec_from_model(model: Any) -> ModelSpec:
    """Describe a live (or meta-device) Hugging Face causal LM.

    Args:
        model: a ``*ForCausalLM`` of a supported family, or a peft wrapper of one
            (adapter parameters are left out: the plan sizes them itself).

    Returns:
        The :class:`ModelSpec` (units cut exactly as the out-of-core engine cuts them).

    Raises:
        ModelError: the model's layout is not one outcore can split into units.
    """
    from .units import causal_lm_units

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    units = []
    for u in causal_lm_units(base):
        # peft wraps a targeted linear: "q_proj.base_layer.weight" is q_proj's frozen weight.
        params = tuple(ParamInfo(s.name.replace(".base_layer.", "."), tuple(int(d) for d in s.shape))
                       for s in u.slots if "lora_" not in s.name)
        kind = "block" if u.name.startswith("block.") else u.name
        units.append(UnitSpec(u.index, u.name, kind, params, tuple(u.borrows)))
    dims = _dims(base.config)
    return ModelSpec(model_type=str(getattr(base.config, "model_type", "unknown")), units=tuple(units),
                     tied=any(u.borrows for u in units), **dims)


def model_spec_from_config(config: Any) -> ModelSpec:
    """Describe a causal LM from its Hugging Face config without allocating weights.

    The model is instantiated on the ``meta`` device (shapes only), so a 70B
    config is as quick as a 135M one.

    Args:
        config: a ``transformers.PretrainedConfig`` (or a mapping with ``model_type``).

    Returns:
        The :class:`ModelSpec`.

    Raises:
        ModelError: transformers cannot build a causal LM from the config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, Mapping):
        d = dict(config)
        if "model_type" not in d:
            raise ModelError(f"a model config mapping needs a 'model_type' key (got keys {sorted(d)})")
        config = AutoConfig.for_model(d.pop("model_type"), **d)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot build a causal LM from config of type "
                         f"{getattr(config, 'model_type', '?')!r}: {e}") from None
    return model_spec_from_model(model)


def model_spec(model_or_config: Any) -> ModelSpec:
    """:func:`model_spec_from_model` or :func:`model_spec_from_config`, whichever fits the argument."""
    if isinstance(model_or_config, ModelSpec):
        return model_or_config
    if hasattr(model_or_config, "parameters") and hasattr(model_or_config, "config"):
        return model_spec_from_model(model_or_config)
    return model_spec_from_config(model_or_config)


# ---------------------------------------------------------------------------------
# Bytes per parameter
# ---------------------------------------------------------------------------------
def _matrix(p: ParamInfo, unit: UnitSpec) -> tuple[int, int] | None:
    """(rows, cols) when ``p`` is a block's 2-D weight (what low-rank optimizers project)."""
    return (p.shape[0], p.shape[1]) if unit.kind == "block" and len(p.shape) == 2 else None


def state_bytes(optim: str, p: ParamInfo, unit: UnitSpec, optim_args: Mapping[str, Any] | None = None) -> int:
    """Optimizer-state bytes of one trainable parameter (fp32 master weights not included).

    Args:
        optim: an optimizer name (``OPTIMIZERS``).
        p: the parameter.
        unit: the unit that owns it (low-rank optimizers project only block matrices;
            embeddings, norms and the head keep full AdamW state, as in the papers).
        optim_args: ``rank`` (galore / apollo), ``density`` (frugal).

    Returns:
        Bytes of state.

    Raises:
        ConfigError: an unknown optimizer or a bad rank / density.
    """
    args = dict(optim_args or {})
    n = p.numel
    if optim in ZO_OPTIMIZERS:
        return 0  # MeZO regenerates z from a seed: no state at all
    if optim == "adamw":
        return 8 * n  # exp_avg + exp_avg_sq, fp32
    if optim == "adamw8bit":
        return 2 * n + 2 * 4 * math.ceil(n / Q8_BLOCK)  # two uint8 moments + fp32 absmax per block
    mat = _matrix(p, unit)
    if optim in ("galore", "apollo", "apollo-mini"):
        rank = 1 if optim == "apollo-mini" else int(args.get("rank", DEFAULT_RANK[optim]))
        if rank < 1:
            raise ConfigError(f"optim_args.rank={rank!r} must be >= 1")
        if mat is None or rank >= min(mat):
            return 8 * n
        big, small = max(mat), min(mat)
        projector = 4 * rank * small if optim == "galore" else 0  # APOLLO keeps a seed, not P
        return 8 * rank * big + projector
    if optim == "frugal":
        rho = float(args.get("density", DEFAULT_FRUGAL_DENSITY))
        if not 0.0 < rho <= 1.0:
            raise ConfigError(f"optim_args.density={rho!r} must be in (0, 1]")
        return 8 * n if mat is None else int(math.ceil(8 * rho * n))
    raise ConfigError(f"optim={optim!r} is not one of: {', '.join(OPTIMIZERS)}")


def _lora_shapes(unit: UnitSpec, targets: tuple[str, ...], r: int) -> list[tuple[int, int]]:
    """(in, out) of every LoRA-targeted linear of ``unit``."""
    out = []
    for p in unit.params:
        m = re.search(r"(?:^|\.)([^.]+)\.weight$", p.name)
        if unit.kind == "block" and m and m.group(1) in targets and len(p.shape) == 2:
            out.append((p.shape[1], p.shape[0]))
    return out


@dataclass(frozen=True)
class UnitBytes:
    """Bytes per tensor class of one unit for one way of training."""

    name: str
    kind: str
    weights: int  # compute weights (frozen base + adapters for LoRA); NF4 codes for QLoRA's linears
    grads: int  # gradients of trainable parameters (compute dtype)
    state: int  # optimizer state + fp32 master weights (mixed precision)
    trainable: int  # trainable elements
    frozen_weights: int  # bytes of weights that are never written (LoRA base)
    adapter_bytes: int  # weights + grads + state of LoRA adapters (kept resident)
    matmul_params: int  # elements of matrices multiplied per token (FLOPs)
    borrows: tuple[int, ...] = ()
    tensors: int = 0  # parameters the unit owns (each is 64-byte aligned in the unit's flat buffer)
    state_kinds: int = 0  # flat state buffers per unit (exp_avg, exp_avg_sq, ..., fp32 master)
    state_piece: int = 0  # when its state streams in pieces (unit_sizes.state_pieces): a piece's bytes


def unit_bytes(spec: ModelSpec, *, method: str, optim: str, dtype: str,
               optim_args: Mapping[str, Any] | None = None, lora_r: int = 8,
               lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> list[UnitBytes]:
    """Bytes of weights, gradients and optimizer state for every unit of ``spec``.

    Args:
        spec: the model.
        method: ``full``, ``lora``, ``qlora`` or ``zo``.
        optim: the optimizer name.
        dtype: compute dtype; ``bfloat16`` / ``float16`` add 4 bytes of fp32 master
            weight per trainable element (counted with the optimizer state).
        optim_args, lora_r, lora_targets: as in ``FinetuneConfig``.

    Returns:
        One :class:`UnitBytes` per unit, in forward order.

    Raises:
        ConfigError: an unknown method / dtype / optimizer.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r} is not one of: {', '.join(DTYPE_BYTES)}")
    if method not in ("full", "lora", "qlora", "zo"):
        raise ConfigError(f"method={method!r} is not one of: full, lora, qlora, zo")
    c = DTYPE_BYTES[dtype]
    master = 4 if (c != 4 and method != "zo") else 0  # ZO updates in place in the compute dtype
    kinds = STATE_KINDS.get(optim, 2) + (1 if master else 0)
    out = []
    for u in spec.units:
        matmul = sum(p.numel for p in u.params if len(p.shape) == 2 and u.kind != "embed")
        if u.kind == "head" and spec.tied:
            matmul += spec.vocab * spec.hidden  # the tied head multiplies by the embedding matrix
        if method in ("full", "zo"):
            n = u.numel
            st = sum(state_bytes(optim, p, u, optim_args) for p in u.params) + master * n
            out.append(UnitBytes(u.name, u.kind, weights=c * n, grads=0 if method == "zo" else c * n,
                                 state=st, trainable=n, frozen_weights=0, adapter_bytes=0,
                                 matmul_params=matmul, borrows=u.borrows, tensors=len(u.params),
                                 state_kinds=kinds if st else 0))
            continue
        # LoRA / QLoRA: a frozen base that streams read-only, plus small resident adapters.
        shapes = _lora_shapes(u, tuple(lora_targets), lora_r)
        adapter_n = sum(lora_r * (i + o) for i, o in shapes)
        adapter_params = [ParamInfo("lora", (lora_r, i + o)) for i, o in shapes]
        # Adapters are fp32 (peft's default) and get full AdamW-family state on their matrices.
        adapter_state = sum(state_bytes(optim, p, UnitSpec(u.index, u.name, "adapter", ()), optim_args)
                            for p in adapter_params)
        adapter = 4 * adapter_n * 2 + adapter_state  # weights + grads + state
        if method == "qlora":
            quant = {p.name for p in u.params if u.kind == "block" and len(p.shape) == 2}
            base = sum(p.numel // 2 + 4 * math.ceil(p.numel / NF4_BLOCK) if p.name in quant else c * p.numel
                       for p in u.params)
        else:
            base = c * u.numel
        out.append(UnitBytes(u.name, u.kind, weights=base, grads=0, state=0, trainable=adapter_n,
                             frozen_weights=base, adapter_bytes=adapter,
                             matmul_params=matmul + adapter_n, borrows=u.borrows, tensors=len(u.params)))
    return _with_state_pieces(out) if method == "full" and optim in ELEMENTWISE_OPTIMIZERS else out


#: optimizers whose update is element-wise (``OutcoreOptimizer.elementwise_state``)
ELEMENTWISE_OPTIMIZERS = ("adamw", "adamw8bit")


def _with_state_pieces(units: list[UnitBytes]) -> list[UnitBytes]:
    """Mark the units whose state the engine streams in block-sized pieces: a single tensor
    (the embedding) whose state is over 1.5 x the second-largest unit's (``state_pieces``)."""
    sizes = sorted(u.state for u in units)
    if len(sizes) < 2:
        return units
    piece = sizes[-2]
    return [replace(u, state_piece=piece) if u.tensors == 1 and u.state > 1.5 * piece else u for u in units]


# ---------------------------------------------------------------------------------
# Activations and FLOPs
# ---------------------------------------------------------------------------------
def block_activation_bytes(spec: ModelSpec, dtype: str, seq_len: int) -> int:
    """Bytes autograd saves for one decoder block per sequence (``seq_len`` tokens, SDPA attention).

    Counted from what a Llama-style block saves (checked against
    ``saved_tensors_hooks`` in the tests): per RMSNorm its fp32 input and
    normalized input and its output; q, k, v and the attention output; the
    MLP's gate, act(gate), up and their product; plus fp32 per-token scalars
    (two rsqrt, one log-sum-exp per head).
    """
    c = DTYPE_BYTES[dtype]
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    q = spec.heads * spec.head_dim
    # Per RMSNorm: fp32 input and normalized input, its output (and in bf16/fp16 the cast copy).
    norms = 2 * (4 * h + 4 * h + c * h + (c * h if c != 4 else 0))
    per_token = norms + c * (2 * q + 2 * kv + 4 * spec.intermediate) + 4 * (2 + spec.heads)
    return seq_len * per_token


def head_activation_bytes(spec: ModelSpec, dtype: str, seq_len: int) -> int:
    """Bytes per sequence held for the final norm, logits and loss (fp32 log-softmax and its gradient)."""
    c = DTYPE_BYTES[dtype]
    upcast = 4 * spec.vocab if c != 4 else 0  # the loss runs on logits.float()
    return seq_len * (4 * 2 * spec.hidden + c * spec.hidden + c * spec.vocab + upcast + 4 * 2 * spec.vocab)


def checkpoint_bytes(spec: ModelSpec, dtype: str, seq_len: int) -> int:
    """Bytes per sequence kept per block under activation recomputation (the block's input)."""
    return seq_len * DTYPE_BYTES[dtype] * spec.hidden


def forward_flops_per_token(spec: ModelSpec, ub: UnitBytes, seq_len: int) -> float:
    """Forward FLOPs per token of one unit: 2 per matrix element, plus causal attention."""
    flops = 2.0 * ub.matmul_params
    if ub.kind == "block":
        flops += 2.0 * seq_len * spec.heads * spec.head_dim  # QK^T and AV over ~seq/2 keys, 2 FLOPs each
    return flops
