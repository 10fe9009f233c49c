"""A causal LM as a list of blocks the ZO schedule visits once per step.

:class:`CausalLMBlocks` cuts a Hugging Face decoder-only LM into
``[embed, layer 0, ..., layer L-1, head]`` (head = final norm + LM head + loss)
and runs one block at a time on a hidden state, so the ZO schedule
(:mod:`outcore.optim.zo_stream`) can hold a single block's weights and carry
several hidden states (one per perturbation sign and sample) through it.

Each block lists the trainable parameters it uses as ``(index, parameter)``;
the index (position among the model's trainable parameters, tied weights once)
selects z. A tied embedding / LM head appears in both the embed and head blocks
with the same index, so both see the same perturbation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelError


@dataclass
class ZOBlock:
    """One unit of the ZO schedule: a name and the trainable parameters it uses."""

    name: str
    params: list[tuple[int, torch.nn.Parameter]] = field(default_factory=list)  # (index, parameter)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every trainable parameter, tied ones once, in index order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _parts(model: torch.nn.Module):
    try:
        from ..models import model_parts

        return model_parts(model)
    except ImportError:  # models/ not installed: the usual HF layout
        inner = model.model
        from types import SimpleNamespace

        return SimpleNamespace(embed=inner.embed_tokens, layers=inner.layers, final_norm=inner.norm,
                               lm_head=model.lm_head, rotary=getattr(inner, "rotary_emb", None),
                               tied=model.lm_head.weight is inner.embed_tokens.weight)


class CausalLMBlocks:
    """Block-wise forward of a decoder-only causal LM (Llama-family layout).

    Args:
        model: a Hugging Face causal LM (``model.model.layers`` etc., or whatever
            :func:`outcore.models.model_parts` understands).

    Raises:
        ModelError: the model does not have the expected layout.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        try:
            self.parts = _parts(model)
        except AttributeError as e:
            raise ModelError(f"{type(model).__name__} is not a decoder-only causal LM with "
                             f"embed/layers/norm/lm_head ({e}); ZO streaming needs that layout") from None
        self.model = model
        index = {id(p): j for j, (_, p) in enumerate(trainable_parameters(model))}

        def block(name: str, *modules: torch.nn.Module) -> ZOBlock:
            seen, params = set(), []
            for m in modules:
                for p in m.parameters():
                    if id(p) in index and id(p) not in seen:
                        seen.add(id(p))
                        params.append((index[id(p)], p))
            return ZOBlock(name, params)

        p = self.parts
        self.blocks = [block("embed", p.embed)]
        self.blocks += [block(f"layer{i}", layer) for i, layer in enumerate(p.layers)]
        self.blocks.append(block("head", p.final_norm, p.lm_head))
        covered = {j for b in self.blocks for j, _ in b.params}
        if len(covered) != len(index):
            missing = [n for n, q in trainable_parameters(model) if index[id(q)] not in covered]
            raise ModelError(f"trainable parameters outside embed/layers/norm/lm_head: {missing[:3]}; "
                             "freeze them or use the MeZO optimizer directly")

    def __len__(self) -> int:
        return len(self.blocks)

    def start(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Per-batch context shared by every block and sample (positions, masks, labels).

        Args:
            batch: ``input_ids`` [B, T] (required), ``labels`` [B, T] (default: the
                input ids; -100 = ignored), ``attention_mask`` [B, T] (optional).

        Returns:
            The context dict passed to :meth:`run`.
        """
        ids = batch["input_ids"]
        labels = batch.get("labels")
        return {"input_ids": ids, "labels": ids if labels is None else labels,
                "attention_mask": batch.get("attention_mask"),
                "position_ids": torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)}

    def _layer_extras(self, h: torch.Tensor, ctx: dict[str, Any]) -> dict[str, Any]:
        if "extras" not in ctx:  # built once per batch from the first hidden state
            from transformers.masking_utils import create_causal_mask

            mask = ctx["attention_mask"]
            causal = create_causal_mask(config=self.model.config, inputs_embeds=h, attention_mask=mask,
                                        past_key_values=None, position_ids=ctx["position_ids"])
            pe = self.parts.rotary(h, position_ids=ctx["position_ids"]) if self.parts.rotary else None
            ctx["extras"] = {"attention_mask": causal, "position_ids": ctx["position_ids"],
                             "position_embeddings": pe}
        return ctx["extras"]

    @torch.no_grad()
    def run(self, b: int, h: torch.Tensor | None, ctx: dict[str, Any]) -> torch.Tensor:
        """Run block ``b`` with the weights its parameters hold right now.

        Args:
            b: block index (0 = embed, last = head).
            h: hidden state [B, T, H] from block ``b - 1`` (None for the embed block).
            ctx: from :meth:`start`.

        Returns:
            The next hidden state [B, T, H], or for the head block the mean
            next-token cross-entropy as a 0-d tensor.
        """
        p = self.parts
        if b == 0:
            return p.embed(ctx["input_ids"])
        if b == len(self.blocks) - 1:
            logits = p.lm_head(p.final_norm(h)).float()  # [B, T, V]
            labels = ctx["labels"]
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return p.layers[b - 1](h, **self._layer_extras(h, ctx))

    @torch.no_grad()
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unperturbed loss through all blocks with the weights the parameters hold now."""
        ctx, h = self.start(batch), None
        for b in range(len(self.blocks)):
            h = self.run(b, h, ctx)
        return h


def load_causal_lm(spec: str, dtype: str = "float32"):
    """Load ``(model, tokenizer)`` through :func:`outcore.models.load_model` (HF fallback).

    Args:
        spec: what ``load_model`` accepts (HF dir, .gguf file, hub id, "default").
        dtype: ``float32`` / ``bfloat16`` / ``float16``.

    Returns:
        ``(model, tokenizer)``; the tokenizer may be None with the plain HF fallback.
    """
    torch_dtype = getattr(torch, dtype)
    try:
        from ..models import load_model
    except ImportError:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
        return model, AutoTokenizer.from_pretrained(spec)
    return load_model(spec, dtype=torch_dtype)
