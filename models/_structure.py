"""Where the parts of a causal LM live, for the families outcore supports.

The out-of-core engine streams a model block by block, so it needs to find the
embedding, the decoder blocks, the final norm, the LM head and the rotary
embedding of every family without knowing its class. Llama, Qwen2, Mistral and
Gemma3 (text-only ``Gemma3ForCausalLM`` and the multimodal
``Gemma3ForConditionalGeneration``, whose text stack is ``model.language_model``)
all share the layout ``<decoder>.embed_tokens / .layers / .norm / .rotary_emb``;
this module is the one place that knows it.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError, ModelError

#: ``config.model_type`` of the families that train out of core exactly as in memory, as
#: tested (full, LoRA, lazy loading, export) by tests/models/test_families.py, which
#: checks that this list is its matrix
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2",
                         "mixtral", "qwen3_moe", "gpt_oss")


@dataclass
class ModelParts:
    """The pieces of a decoder-only LM, in the order a forward pass visits them.

    Attributes:
        embed: token embedding (``nn.Embedding`` or a subclass, e.g. Gemma's scaled one).
        layers: the transformer blocks, in order.
        final_norm: the norm applied after the last block.
        lm_head: the output projection (``nn.Linear``).
        rotary: the shared rotary-embedding module, or None when the family has none
            at model level.
        tied: True when ``lm_head.weight`` is the same tensor as ``embed.weight``.
    """

    embed: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None
    tied: bool


def _decoder(model: nn.Module) -> nn.Module:
    """The module that holds ``embed_tokens`` / ``layers`` / ``norm`` (the text decoder)."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise ModelError(
            f"{type(model).__name__} has no '.model' decoder; outcore supports causal LMs of the "
            f"families {', '.join(SUPPORTED_MODEL_TYPES)}")
    language_model = getattr(inner, "language_model", None)  # Gemma3ForConditionalGeneration
    if language_model is not None and hasattr(language_model, "layers"):
        inner = language_model
    for name in ("embed_tokens", "layers", "norm"):
        if not hasattr(inner, name):
            raise ModelError(
                f"{type(model).__name__} has no '{name}' in its decoder; outcore supports causal "
                f"LMs of the families {', '.join(SUPPORTED_MODEL_TYPES)}")
    return inner


#: where other layouts keep their list of blocks: enough for what only wraps the blocks
#: (activation policies), not for the out-of-core engine, which needs every part
OTHER_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                     "model.language_model.layers", "layers")


def decoder_layers(model: nn.Module, any_layout: bool = False) -> nn.ModuleList:
    """The transformer blocks of ``model``, in forward order.

    Args:
        model: a causal LM of a supported family (e.g. ``LlamaForCausalLM``).
        any_layout: also accept a model outside the supported families whose blocks sit
            at one of :data:`OTHER_LAYER_PATHS` (GPT-2's ``transformer.h``, a bare ``layers``).

    Returns:
        The ``nn.ModuleList`` of decoder blocks (the model's own list, not a copy).

    Raises:
        ModelError: the model does not have the expected layout.
    """
    try:
        layers = _decoder(model).layers
    except ModelError:
        if not any_layout:
            raise
        return _layers_at_known_path(model)
    if not isinstance(layers, nn.ModuleList):
        raise ModelError(f"{type(model).__name__}.layers is a {type(layers).__name__}, "
                         f"expected an nn.ModuleList of decoder blocks")
    return layers


def _layers_at_known_path(model: nn.Module) -> nn.ModuleList:
    """The first non-empty ``nn.ModuleList`` at one of :data:`OTHER_LAYER_PATHS`."""
    for path in OTHER_LAYER_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    raise ModelError(f"cannot find the decoder blocks of {type(model).__name__} (looked for "
                     f"{', '.join(OTHER_LAYER_PATHS)}); pass a model with one of those attributes")


def model_parts(model: nn.Module) -> ModelParts:
    """Split ``model`` into embed / layers / final norm / LM head / rotary embedding.

    Args:
        model: a causal LM of a supported family, or a peft wrapper of one.

    Returns:
        A :class:`ModelParts` whose modules are the model's own (no copies).

    Raises:
        ModelError: the model does not have the expected layout.
    """
    if hasattr(model, "get_base_model"):  # peft: the parts are the wrapped model's
        model = model.get_base_model()
    decoder = _decoder(model)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise ModelError(f"{type(model).__name__} has no 'lm_head' projection")
    embed = decoder.embed_tokens
    tied = lm_head.weight is embed.weight
    return ModelParts(embed=embed, layers=decoder_layers(model), final_norm=decoder.norm,
                      lm_head=lm_head, rotary=getattr(decoder, "rotary_emb", None), tied=tied)


def check_streamable(model: nn.Module, ram_available: int | None = None) -> ModelParts:
    """Check that the out-of-core engine can stream ``model``, before any work is done.

    Streaming needs every parameter in the embed, a decoder block, the final norm or the
    LM head (the units); a model with other parts (a vision tower, an audio encoder) or
    another layout cannot stream. Works on a meta-device model: no weight is read.

    Args:
        model: a causal LM (or a peft wrapper of one), possibly on the meta device.
        ram_available: bytes of RAM available; when given, the error advises
            ``--offload none`` only if the model's weights fit in it.

    Returns:
        The model's :class:`ModelParts`.

    Raises:
        ModelError: one line naming the family, the class and the part that cannot stream.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = getattr(getattr(base, "config", None), "model_type", None) or "?"
    what = f"{family} ({type(base).__name__}) cannot stream out of core"
    try:
        parts = model_parts(base)
    except ModelError as err:
        raise ModelError(f"{what}: {err}{_in_memory_advice(base, ram_available)}") from err
    streamed = {id(p) for m in (parts.embed, parts.layers, parts.final_norm, parts.lm_head)
                for p in m.parameters()}
    outside = [n for n, p in base.named_parameters() if id(p) not in streamed]
    if outside:
        part = _outermost_outside(base, outside[0], streamed)
        raise ModelError(f"{what}: its part {part!r} ({len(outside)} tensors outside the embed, blocks, final "
                         f"norm and head){_in_memory_advice(base, ram_available)}")
    return parts


def _outermost_outside(model: nn.Module, name: str, streamed: set[int]) -> str:
    """The largest module holding parameter ``name`` with nothing streamed in it
    (``model.vision_tower``, not its first patch embedding)."""
    path = name.split(".")[:-1]
    part = ".".join(path)
    for i in range(len(path) - 1, 0, -1):
        prefix = ".".join(path[:i])
        if any(id(p) in streamed for p in model.get_submodule(prefix).parameters()):
            break
        part = prefix
    return part


def _in_memory_advice(model: nn.Module, ram_available: int | None) -> str:
    """``--offload none`` where the weights fit in RAM; otherwise say that they do not."""
    if ram_available is None:
        return ""
    need = parameter_bytes(model)
    sizes = f"{need / 2**30:.2f} GiB of weights, {ram_available / 2**30:.1f} GiB of RAM available"
    if need < ram_available:
        return f"; train it in memory with --offload none ({sizes})"
    return f"; it does not fit in memory either ({sizes}): use a smaller model"


def max_positions(model: nn.Module) -> int:
    """The longest sequence (in tokens) the model's position encoding allows.

    Args:
        model: a Hugging Face model (its ``config`` is read).

    Returns:
        ``config.max_position_embeddings`` (of the text config for multimodal models).

    Raises:
        ModelError: the config does not say.
    """
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    value = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise ModelError(f"{type(model).__name__}'s config has no max_position_embeddings; "
                         f"cannot tell the longest sequence it allows")
    return value


def check_seq_len(model: nn.Module, seq_len: int) -> int:
    """Check that ``seq_len`` tokens fit the model's position encoding.

    Args:
        model: the model that will be trained.
        seq_len: tokens per training sequence.

    Returns:
        ``seq_len``, unchanged.

    Raises:
        ConfigError: ``seq_len`` is not an int >= 2 or exceeds :func:`max_positions`.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"seq_len={seq_len!r} must be an integer >= 2 (tokens per sequence)")
    limit = max_positions(model)
    if seq_len > limit:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"seq_len={seq_len} is longer than the model allows "
                          f"(max_position_embeddings={limit} for {model_type}); "
                          f"use seq_len <= {limit}")
    return seq_len


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates shared tensors


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the model's distinct parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

