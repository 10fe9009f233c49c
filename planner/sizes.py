"""Sizes the memory plan works from: bytes per unit and tensor class, activations, FLOPs.

Everything here is arithmetic on shapes. A model is described by a
:class:`ModelSpec` — its units of transfer (``embed, block.0 … block.L-1,
head``, cut exactly as the out-of-core engine cuts them, by
:func:`outcore.offload.engine.units.causal_lm_units`) and the dimensions that size
activations. A spec is built from a live model or from its Hugging Face config
alone: the config is instantiated on the ``meta`` device, so a 70B plan
allocates no weights and takes well under a second.

Optimizer state is asked of the optimizer itself (:class:`OptimizerState`): the planner
builds it over ``meta`` parameters and sizes its ``state_spec``, so an optimizer added to
``outcore.optim.OPTIMIZERS`` is planned without a change here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ..dtypes import DTYPE_BYTES, EXACT
from ..errors import ConfigError, ModelError
from ..methods import MethodTraits, method_traits
from ..offload.engine.unit_sizes import piece_size, ram_kinds

NF4_BLOCK = 64  # QLoRA NF4: 4-bit codes, one fp32 absmax per 64 weights (no double quantization)


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
    #: of a mixture-of-experts block's expert weights, the share one token multiplies by
    #: (experts per token / experts); 1.0 for a dense model
    expert_share: float = 1.0
    #: the run's loss is the chunked head (``kernels/linear_cross_entropy.py:head_loss_covers``):
    #: no [tokens, vocab] logits are held
    chunked_loss: bool = False
    #: a dense gated MLP per block, which ``seq_tile`` tiles (``activations/tiling.py``)
    tileable_mlp: bool = False
    #: a recomputed block runs ``seq_tile`` positions at a time (``activations/tiled_block.py``)
    tileable_block: bool = False
    #: the length the model was trained at (``max_position_embeddings``; 0: unknown)
    trained_len: int = 0
    #: the RoPE scaling its config sets (``rope_parameters`` / ``rope_scaling``: "yarn x4.0"), "" for none
    rope_scaling: str = ""

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
    from ..offload.engine import causal_lm_units

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    units = []
    for u in causal_lm_units(base):
        # peft wraps a targeted linear: "q_proj.base_layer.weight" is q_proj's frozen weight.
        params = tuple(ParamInfo(s.name.replace(".base_layer.", "."), tuple(int(d) for d in s.shape))
                       for s in u.slots if "lora_" not in s.name)
        kind = "block" if u.name.startswith("block.") else u.name
        units.append(UnitSpec(u.index, u.name, kind, params, tuple(u.borrows)))
    from ..activations.apply import find_decoder_layers
    from ..activations.tiled_block import tileable_layer
    from ..activations.tiling import is_tileable
    from ..kernels.linear_cross_entropy import head_loss_covers

    dims = _dims(base.config)
    layers = find_decoder_layers(base)
    text = getattr(base.config, "text_config", None) or base.config
    return ModelSpec(model_type=str(getattr(base.config, "model_type", "unknown")), units=tuple(units),
                     tied=any(u.borrows for u in units), expert_share=_expert_share(base.config),
                     chunked_loss=head_loss_covers(base.config),
                     tileable_mlp=bool(len(layers)) and is_tileable(getattr(layers[0], "mlp", None)),
                     tileable_block=bool(len(layers)) and tileable_layer(layers[0]),
                     trained_len=int(getattr(text, "max_position_embeddings", 0) or 0),
                     rope_scaling=_rope_scaling(text), **dims)


def _rope_scaling(cfg: Any) -> str:
    """The RoPE scaling a config sets, as transformers reads it ("yarn x4.0"); "" for none."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
    return "" if kind == "default" else f"{kind} x{rope.get('factor', '?')}"


def _expert_share(cfg: Any) -> float:
    """Experts per token / experts of a mixture-of-experts config (1.0 without experts)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    per_token = getattr(cfg, "num_experts_per_tok", None)
    return per_token / experts if experts and per_token else 1.0


def _matmul_elements(p: ParamInfo, expert_share: float) -> float:
    """Elements of ``p`` each token multiplies by: a matrix, or a stack of experts' matrices
    (``experts.*``, fused 3-D or one per expert) of which a token uses ``expert_share``."""
    if ".experts." in p.name and len(p.shape) in (2, 3) and not p.name.endswith("bias"):
        return p.numel * expert_share
    return p.numel if len(p.shape) == 2 else 0


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
class OptimizerState:
    """An optimizer's state per parameter, as its own ``state_spec`` declares it.

    The optimizer is built (from ``outcore.optim``'s registry, with ``optim_args``) over
    one parameter on the ``meta`` device, so nothing is allocated. State is sized for
    fp32 parameters: what trains always is — the model in float32, the fp32 masters of
    mixed precision, LoRA adapters (peft's default).

    Args:
        optim: a gradient-based optimizer name (``outcore.optim.OPTIMIZERS``).
        optim_args: its hyper-parameters (``rank``, ``density``, ...).

    Raises:
        ConfigError: an unknown optimizer or hyper-parameter, or a value out of range.
    """

    def __init__(self, optim: str, optim_args: Mapping[str, Any] | None = None):
        import torch

        from ..optim import build_optimizer

        probe = torch.nn.Parameter(torch.empty(0, device="meta"))
        self.optimizer = build_optimizer(optim, [probe], **dict(optim_args or {}))
        self._group = self.optimizer.param_groups[0]

    def _param(self, shape: tuple[int, ...]) -> Any:
        import torch

        return torch.empty(shape, dtype=torch.float32, device="meta")

    def spec(self, shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
        """State kind -> (elements, bytes per element) of a parameter of ``shape``."""
        return {kind: (math.prod(s), dtype.itemsize)
                for kind, (s, dtype) in self.optimizer.state_spec(self._param(shape), self._group).items()}

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of state of a parameter of ``shape`` (no padding: the plan counts that apart)."""
        return sum(n * size for n, size in self.spec(shape).values())

    def ratios(self, shape: tuple[int, ...]) -> dict[str, int] | None:
        """How the state lines up with the elements (``elementwise_state``); None when the
        update mixes elements (the engine then never streams the state in pieces)."""
        return self.optimizer.elementwise_state(self._param(shape), self._group)


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
    ram_state: int = 0  # of ``state``, the small kinds kept in RAM when the rest is on NVMe (unit_sizes.ram_kinds)
    decoded: int = 0  # QLoRA: its NF4 weights dequantized into the compute dtype, where it computes


def unit_bytes(spec: ModelSpec, *, method: str, optim: str, dtype: str, precision: str = EXACT,
               optim_args: Mapping[str, Any] | None = None, lora_r: int = 8,
               lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), world: int = 1
               ) -> list[UnitBytes]:
    """Bytes of weights, gradients and optimizer state for every unit of ``spec``.

    Args:
        spec: the model.
        method: ``full``, ``lora``, ``qlora`` or ``zo``.
        optim: the optimizer name; its state is sized by :class:`OptimizerState`
            (zeroth-order optimizers keep none).
        dtype: compute dtype; ``bfloat16`` / ``float16`` add 4 bytes of fp32 master
            weight per trainable element (counted with the optimizer state).
        precision: ``exact``, or ``bf16-lean`` (``dtypes.PRECISIONS``): no fp32 master.
        optim_args, lora_r, lora_targets: as in ``FinetuneConfig``.
        world: data-parallel ranks of a full fine-tune: each stores 1/world of every unit's
            state (``offload/engine/sharding.py``); the sizes are one rank's.

    Returns:
        One :class:`UnitBytes` per unit, in forward order.

    Raises:
        ConfigError: an unknown method / dtype / optimizer, or a bad hyper-parameter.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r} is not one of: {', '.join(DTYPE_BYTES)}")
    traits = method_traits(method)
    c = DTYPE_BYTES[dtype]
    state = OptimizerState(optim, optim_args) if traits.backward else None  # ZO keeps no state
    # ZO updates in place in the compute dtype, and so does bf16-lean (optim/lean.py)
    master = 4 if (c != 4 and state is not None and precision == EXACT) else 0
    out = []
    for u in spec.units:
        matmul = 0 if u.kind == "embed" else round(sum(_matmul_elements(p, spec.expert_share) for p in u.params))
        if u.kind == "head" and spec.tied:
            matmul += spec.vocab * spec.hidden  # the tied head multiplies by the embedding matrix
        if traits.trains_weights:
            out.append(_trained_unit(u, c, state, master, matmul))
        else:
            out.append(_adapter_unit(u, c, traits, state, matmul, lora_r, tuple(lora_targets)))
    if not traits.trains_weights or state is None:
        return out
    piecable = []
    for u in spec.units:  # every parameter element-wise, alike (``unit_sizes.state_pieces``)
        ratios = [state.ratios(p.shape) for p in u.params]
        piecable.append(bool(ratios) and ratios[0] is not None and all(r == ratios[0] for r in ratios))
    return _with_state_pieces(out, piecable, world)


def _trained_unit(u: UnitSpec, c: int, state: OptimizerState | None, master: int, matmul: int) -> UnitBytes:
    """A unit whose every weight trains (``full``, ``zo``): its state per ``state_spec``,
    plus ``master`` bytes of fp32 master weight per element."""
    n = u.numel
    kinds: dict[str, int] = {"master": master * n} if master and u.params else {}
    for p in u.params if state is not None else ():
        for kind, (count, size) in state.spec(p.shape).items():
            kinds[kind] = kinds.get(kind, 0) + count * size
    st = sum(kinds.values())
    return UnitBytes(u.name, u.kind, weights=c * n, grads=0 if state is None else c * n, state=st,
                     trainable=n, frozen_weights=0, adapter_bytes=0, matmul_params=matmul,
                     borrows=u.borrows, tensors=len(u.params), state_kinds=len(kinds) if st else 0,
                     ram_state=sum(kinds[k] for k in ram_kinds(kinds)))


def _adapter_unit(u: UnitSpec, c: int, traits: MethodTraits, state: OptimizerState, matmul: int,
                  r: int, targets: tuple[str, ...]) -> UnitBytes:
    """A LoRA / QLoRA unit: a frozen base that streams read-only, plus small resident adapters."""
    shapes = _lora_shapes(u, targets, r)
    adapter_n = sum(r * (i + o) for i, o in shapes)
    # Per targeted linear, A [r, in] and B [out, r]: fp32 (peft's default), each with its state.
    adapter_state = sum(state.nbytes((r, i)) + state.nbytes((o, r)) for i, o in shapes)
    adapter = 4 * adapter_n * 2 + adapter_state  # weights + grads + state
    decoded = 0
    if traits.quantized_base:
        quant = {p.name for p in u.params if u.kind == "block" and len(p.shape) == 2}
        base = sum(p.numel // 2 + 4 * math.ceil(p.numel / NF4_BLOCK) if p.name in quant else c * p.numel
                   for p in u.params)
        decoded = c * u.numel if quant else 0  # (offload/engine/unit_memory.py: acquire decodes it whole)
    else:
        base = c * u.numel
    return UnitBytes(u.name, u.kind, weights=base, grads=0, state=0, trainable=adapter_n,
                     frozen_weights=base, adapter_bytes=adapter, matmul_params=matmul + adapter_n,
                     borrows=u.borrows, tensors=len(u.params), decoded=decoded)


def _with_state_pieces(units: list[UnitBytes], piecable: list[bool], world: int = 1) -> list[UnitBytes]:
    """Mark the units whose state the engine streams in block-sized pieces: updated
    element-wise (``OutcoreOptimizer.elementwise_state``), with a state over 1.5 x the
    piece size (``unit_sizes.piece_size``, ``unit_sizes.state_pieces``). With ``world`` ranks
    each unit's state is a rank's share, pieced the same way."""
    if world > 1:
        units = [replace(u, state=-(-u.state // world), ram_state=-(-u.ram_state // world)) for u in units]
    piece = piece_size([u.state for u in units], [u.kind == "block" for u in units])
    if piece is None:
        return units
    return [replace(u, state_piece=piece) if ok and u.state > 1.5 * piece else u
            for u, ok in zip(units, piecable)]


# ---------------------------------------------------------------------------------
# Activations and FLOPs
# ---------------------------------------------------------------------------------
def block_activation_bytes(spec: ModelSpec, dtype: str, seq_len: int, tiled: bool = False) -> int:
    """Bytes autograd saves for one decoder block per sequence (``seq_len`` tokens, SDPA attention).

    Counted from what a Llama-style block saves (checked against
    ``saved_tensors_hooks`` in the tests): per RMSNorm its fp32 input and
    normalized input and its output; q, k, v and the attention output; the
    MLP's gate, act(gate), up and their product (none when ``tiled``: the tiled MLP
    saves only its input, the norm's output, counted already); plus fp32 per-token
    scalars (two rsqrt, one log-sum-exp per head).
    """
    c = DTYPE_BYTES[dtype]
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    q = spec.heads * spec.head_dim
    # Per RMSNorm: fp32 input and normalized input, its output (and in bf16/fp16 the cast copy).
    norms = 2 * (4 * h + 4 * h + c * h + (c * h if c != 4 else 0))
    mlp = 0 if tiled else 4 * spec.intermediate
    per_token = norms + c * (2 * q + 2 * kv + mlp) + 4 * (2 + spec.heads)
    return seq_len * per_token


def mlp_tile_bytes(spec: ModelSpec, dtype: str, tile: int) -> int:
    """Bytes one tile of a tiled MLP holds in its backward: the tile recomputed (gate, act(gate),
    up, their product), their three gradients and the output's: eight ``[tile, intermediate]``."""
    return 8 * tile * spec.intermediate * DTYPE_BYTES[dtype]


def tiled_block_bytes(spec: ModelSpec, dtype: str, seq_len: int, tile: int, batch: int) -> int:
    """Bytes a tiled block's backward holds for ``batch`` sequences (``activations/tiled_block.py``)
    beyond the gradient w.r.t. its output, which the gradient w.r.t. its input overwrites.

    One tile's graph (its saved tensors, the MLP tile's) and one prefix chunk's key and value
    gradients, and over the whole sequence the keys and values (``c`` bytes) and their fp32
    gradient sums: ``(c + 4) x 2 x kv_heads x head_dim`` per token (the CPU's merged attention;
    an accelerator's concatenated prefix is not counted).
    """
    c, kv = DTYPE_BYTES[dtype], 2 * spec.kv_heads * spec.head_dim
    chunk = c * kv * tile  # one prefix chunk's key and value gradients
    return (batch * (block_activation_bytes(spec, dtype, tile, tiled=True) + seq_len * (c + 4) * kv + chunk)
            + mlp_tile_bytes(spec, dtype, tile))


def chunked_head_bytes(spec: ModelSpec, dtype: str, tokens: int, head_trained: bool = True) -> tuple[int, int]:
    """(kept, transient) bytes of the chunked head loss for ``tokens`` rows
    (``kernels/linear_cross_entropy.py``), which takes its gradients in the forward.

    Kept through the backward, per token: the final norm's saved tensors and the hidden
    state's gradient, the loss and target. Only while the loss runs: one chunk of fp32 logits
    (~32 MiB; in 16 bits its 16-bit copy too) and, where the head trains, the fp32
    ``[vocab, hidden]`` weight gradient and its copy in the weight's dtype that the op returns
    (4 GiB + 2 GiB at a 128K x 8192 head in bf16; a frozen head, as under LoRA, allocates none).
    """
    from ..kernels.linear_cross_entropy import default_chunk_size

    c, h = DTYPE_BYTES[dtype], spec.hidden
    cast = c if c != 4 else 0  # bytes per element of a 16-bit copy beside an fp32 tensor
    kept = tokens * (4 * 2 * h + c * h + cast * h + c * h + 4 + 8)
    weight_grad = (4 + cast) * spec.vocab * h if head_trained else 0
    chunk = (4 + cast) * spec.vocab * default_chunk_size(tokens, spec.vocab)
    return kept, weight_grad + chunk


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
