"""Packed documents: which models keep a packed row's documents apart.

A row packed from several documents keeps them apart when its position ids restart at each
document and the batch has no attention mask: transformers' ``create_causal_mask`` then finds
the documents from the position ids (``find_packed_sequence_indices``) and masks attention per
document, block-diagonal and causal. ``sdpa`` and ``eager`` take it as a ``[B, 1, T, T]`` mask
built once per forward, and ``sdpa`` on the CPU saves a copy in the compute dtype per block for
the backward: ``B x T^2 x`` 4 bytes per block in fp32, quadratic in the length where the
unpacked causal batch saves none. The ``flash_attention_*`` kernels take the position ids as
variable-length sequences instead (TRL's ``padding_free``). A family whose attention does not
apply that mask does not: in ``gpt_oss``'s packed forward a document sees the one before it.
"""
from __future__ import annotations

from torch import nn

from ..errors import ModelError
from ._structure import SUPPORTED_MODEL_TYPES

#: the families whose forward masks a packed row per document, as
#: tests/models/test_packed_documents.py checks against each document run alone
PACKED_DOCUMENT_MODEL_TYPES = tuple(t for t in SUPPORTED_MODEL_TYPES if t != "gpt_oss")
#: transformers' attention implementations that take a packed row's documents from its
#: position ids (sdpa and eager are tested on the CPU; flash: transformers' varlen path)
PACKED_DOCUMENT_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def check_packed_documents(model: nn.Module) -> None:
    """Check that ``model`` keeps the documents of a packed row apart (works on the meta device).

    Raises:
        ModelError: one line naming the family or the attention implementation that does
            not, and what to do.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    family = getattr(config, "model_type", None) or type(base).__name__
    if family not in PACKED_DOCUMENT_MODEL_TYPES:
        raise ModelError(f"padding_free=true: {family} does not mask attention per document in a packed row "
                         f"(families that do: {', '.join(PACKED_DOCUMENT_MODEL_TYPES)}); set padding_free=false")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in PACKED_DOCUMENT_ATTENTION:
        raise ModelError(f"padding_free=true: attention {attention!r} of {family} does not take documents from "
                         f"position ids (those that do: {', '.join(PACKED_DOCUMENT_ATTENTION)}); "
                         f"set padding_free=false")
