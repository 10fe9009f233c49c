"""A causal LM as the blocks the ZO schedule visits once per step, and their block-wise forward.

:class:`CausalLMBlocks` cuts a Hugging Face decoder-only LM with
:func:`outcore.offload.units.causal_lm_units` — the same units first-order
training streams, ``[embed, layer 0, ..., layer L-1, head]`` (head = final norm +
LM head + loss) — and runs one block at a time on a hidden state, so the ZO
schedule (:mod:`outcore.offload.zo_engine`) can hold one block's weights and
carry several hidden states (one per perturbation sign and sample) through it.

Each block lists every parameter it computes with as a :class:`ZOParam`: where
its weights sit (its owner unit's flat buffer) and, when it trains, its index
among the model's trainable parameters (tied weights once), which selects z. A
tied embedding / LM head is owned by the embed unit and borrowed by the head, with
the same index in both, so both see the same perturbation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .units import ParamSlot, Unit, causal_lm_units


@dataclass
class ZOParam:
    """One parameter a block computes with."""

    param: torch.nn.Parameter
    unit: int  # the unit whose flat weights hold it (the block's own, or a borrowed one)
    slot: ParamSlot  # where in that unit's flat buffer
    index: int | None  # position among the trainable parameters (selects z); None: frozen


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every trainable parameter, tied ones once, in index order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class CausalLMBlocks:
    """Block-wise forward of a decoder-only causal LM (the families :func:`outcore.models.model_parts` knows).

    Args:
        model: a Hugging Face causal LM with at least one trainable parameter.

    Raises:
        ModelError: the model does not have the expected layout.
        ConfigError: no parameter requires grad.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from ..models import model_parts

        self.model, self.parts = model, model_parts(model)
        self.units: list[Unit] = causal_lm_units(model)
        trainable = trainable_parameters(model)
        if not trainable:
            raise ConfigError(f"{type(model).__name__} has no parameter with requires_grad=True; "
                              "unfreeze what ZO should train")
        self.names = [n for n, _ in trainable]
        index = {id(p): j for j, (_, p) in enumerate(trainable)}  # transient: built once, then dropped
        owner = {id(s.param): (u.index, s) for u in self.units for s in u.slots}
        self.blocks: list[list[ZOParam]] = []
        for unit in self.units:
            seen, params = set(), []
            for m in unit.modules:
                for p in m.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(ZOParam(p, *owner[id(p)], index.get(id(p))))
            self.blocks.append(params)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        """Where the blocks compute: the parameters' device (CPU for a meta-device model)."""
        device = next(iter(self.model.parameters())).device
        return torch.device("cpu") if device.type == "meta" else device

    def trainable(self, b: int) -> list[ZOParam]:
        """The parameters of block ``b`` that ZO perturbs and updates."""
        return [q for q in self.blocks[b] if q.index is not None]

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
        out = p.layers[b - 1](h, **self._layer_extras(h, ctx))
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unperturbed loss through all blocks with the weights the parameters hold now."""
        ctx, h = self.start(batch), None
        for b in range(len(self.blocks)):
            h = self.run(b, h, ctx)
        return h
