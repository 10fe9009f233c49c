"""A causal LM as the blocks the ZO schedule visits once per step, and their block-wise forward.

:class:`CausalLMBlocks` cuts a Hugging Face decoder-only LM with
:func:`outcore.offload.engine.units.causal_lm_units` — the same units first-order
training streams, ``[embed, layer 0, ..., layer L-1, head]`` (head = final norm +
LM head + loss) — and runs one block at a time on a hidden state, so the ZO
schedule (:mod:`outcore.offload.zo.engine`) can hold one block's weights and
carry several hidden states (one per perturbation sign and sample) through it.

Each block lists every parameter it computes with as a :class:`ZOParam`: where
its weights sit (its owner unit's flat buffer) and, when it trains, its index
among the model's trainable parameters (tied weights once), which selects z. A
tied embedding / LM head is owned by the embed unit and borrowed by the head, with
the same index in both, so both see the same perturbation.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...errors import ConfigError
from ..engine import ParamSlot, Unit, causal_lm_units


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


def _layer_types(config, n_layers: int) -> list[str]:
    """Each decoder layer's attention type, as the model's own forward reads it.

    Raises:
        ConfigError: a model whose loss the block-wise forward would not reproduce (the
            routers' auxiliary loss, bidirectional attention).
    """
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise ConfigError(
            f"{config.model_type}: zeroth-order training does not add the routers' auxiliary loss "
            f"(output_router_logits=True, router_aux_loss_coef={config.router_aux_loss_coef}); "
            "set output_router_logits=False in the model's config.json, or use --method full or lora")
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(f"{config.model_type} with use_bidirectional_attention=True: zeroth-order "
                          "training runs causal LMs only; use --method full or lora")
    types = getattr(config, "layer_types", None)
    if types:
        return list(types[:n_layers])
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * n_layers


class CausalLMBlocks:
    """Block-wise forward of a decoder-only causal LM (the families :func:`outcore.models.model_parts` knows).

    Args:
        model: a Hugging Face causal LM with at least one trainable parameter.

    Raises:
        ModelError: the model does not have the expected layout.
        ConfigError: no parameter requires grad.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from ...models import model_parts

        self.model, self.parts = model, model_parts(model)
        self.units: list[Unit] = causal_lm_units(model)
        trainable = trainable_parameters(model)
        if not trainable:
            raise ConfigError(f"{type(model).__name__} has no parameter with requires_grad=True; "
                              "unfreeze what ZO should train")
        self.names = [n for n, _ in trainable]
        #: what the head block returns from its fp32 logits ``[B, T, V]`` and the batch's
        #: context (:meth:`start`: ``labels`` and the batch's other tensors under ``batch``);
        #: None: the model's own mean next-token loss. A ZO step needs a 0-d loss from it.
        self.head: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
        self.layer_types = _layer_types(model.config, len(self.parts.layers))
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
                input ids; -100 = ignored), ``attention_mask`` [B, T] (optional), or
                ``position_ids`` [B, T] restarting at each document of a packed row
                (no mask: transformers' masks then keep the documents apart).

        Returns:
            The context dict passed to :meth:`run`.
        """
        ids = batch["input_ids"]
        labels = batch.get("labels")
        return {"input_ids": ids, "labels": ids if labels is None else labels, "batch": batch,
                "attention_mask": batch.get("attention_mask"),
                "position_ids": batch["position_ids"] if "position_ids" in batch
                else torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)}

    def _layer_extras(self, layer: int, h: torch.Tensor, ctx: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments decoder layer ``layer`` takes, as the model's own forward builds
        them: the mask and rotary table of the layer's attention type (full, or sliding-window:
        ``config.layer_types``, else every layer sliding when ``config.sliding_window`` is set)."""
        if "extras" not in ctx:  # built once per batch from the first hidden state
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            config, pos = self.model.config, ctx["position_ids"]
            kw = {"config": config, "inputs_embeds": h, "attention_mask": ctx["attention_mask"],
                  "past_key_values": None, "position_ids": pos}
            by_type = {}
            for kind in set(self.layer_types):
                make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                rotary = self.parts.rotary
                if rotary is None:
                    pe = None
                elif "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: a table per type
                    pe = rotary(h, pos, kind)
                else:
                    pe = rotary(h, position_ids=pos)
                by_type[kind] = {"attention_mask": make(**kw), "position_ids": pos, "position_embeddings": pe}
            ctx["extras"] = [by_type[kind] for kind in self.layer_types]
        return ctx["extras"][layer]

    @torch.no_grad()
    def run(self, b: int, h: torch.Tensor | None, ctx: dict[str, Any]) -> torch.Tensor:
        """Run block ``b`` with the weights its parameters hold right now.

        Args:
            b: block index (0 = embed, last = head).
            h: hidden state [B, T, H] from block ``b - 1`` (None for the embed block).
            ctx: from :meth:`start`.

        Returns:
            The next hidden state [B, T, H], or for the head block the mean
            next-token cross-entropy as a 0-d tensor (or what :attr:`head` returns).
        """
        p = self.parts
        if b == 0:
            return p.embed(ctx["input_ids"])
        if b == len(self.blocks) - 1:
            logits = p.lm_head(p.final_norm(h)).float()  # [B, T, V]
            cap = getattr(self.model.config, "final_logit_softcapping", None)
            if cap:  # Gemma 2 / 3: the model's logits are soft-capped before its loss
                logits = torch.tanh(logits / cap) * cap
            if self.head is not None:
                return self.head(logits, ctx)
            # the model's own loss (transformers' ForCausalLMLoss): the same shift and
            # reduction order, so the loss is the model's to the bit
            return self.model.loss_function(logits, ctx["labels"], vocab_size=logits.shape[-1])
        out = p.layers[b - 1](h, **self._layer_extras(b - 1, h, ctx))
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Unperturbed loss through all blocks with the weights the parameters hold now."""
        ctx, h = self.start(batch), None
        for b in range(len(self.blocks)):
            h = self.run(b, h, ctx)
        return h
