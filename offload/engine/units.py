"""Units of transfer: a model cut into the pieces that move between tiers together.

A causal LM becomes ``[embed, block 0, ..., block L-1, head]``. Each unit owns
its parameters laid out back to back in one *flat* buffer per tensor class
(weights, each optimizer-state tensor, gradients), so one unit moves as one
extent with one I/O request. Offsets are padded to 64 bytes: the views handed to
compute kernels keep the alignment torch's allocator would give them, so
out-of-core matmuls take the same code paths — and give the same bits — as
in-memory ones.

A :class:`Unit` is the one object that knows everything about its piece of the model
(docs/architecture.md §4), in parts that each have one writer:

- what it is (modules, parameter slots, borrowed tied weights): :func:`causal_lm_units`;
  its ``shard`` of the state across ranks: ``sharding.shard_units``, before layout;
- where its buffers live in the store (``Unit.layout``, a :class:`UnitLayout`: a handle per
  :class:`Part`, its home tiers, the optimizer state's layout, its pieces (:class:`Piece`),
  NF4 layout): made once by ``unit_layout.store_unit`` and fixed from then on;
- where it stands in the step (``Unit.step``, a :class:`UnitStep`): its weights bound to the
  parameters and the gradients still to come, by the engine (engine.py); the norms of its
  spilled gradients, by the updater (update.py);
- its copies on the move (``Unit.memory``, a :class:`UnitMemoryState`: prefetched, kept,
  decoded, its spilled gradient's handles): by ``StoreUnitMemory`` (unit_memory.py).

The store's own pin count of the weights' DEVICE copy is how many phases hold the unit:
there is no second count.

A weight shared by two units (tied input embedding and LM head) is owned by the
first unit that uses it; later units list its owner in ``borrows``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import ModelError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..store import TensorHandle, Tier
    from .nf4 import NF4Layout
    from .sharding import Shard

PARAM_ALIGN = 64  # bytes: each parameter's offset in a unit's flat buffer is a multiple of it

WEIGHTS = "w"  # a unit's weights
GRADS = "g"  # a unit's spilled gradients (same layout as its weights)


@dataclass(frozen=True)
class Part:
    """Which buffer of a unit: a kind (``WEIGHTS``, ``GRADS`` or an optimizer-state name such
    as ``"exp_avg"``) and, for a unit whose state streams in pieces, the piece's index."""

    kind: str
    piece: int | None = None

    def __str__(self) -> str:  # the handle's name in the store: "block.3:exp_avg@2"
        return self.kind if self.piece is None else f"{self.kind}@{self.piece}"

    @classmethod
    def of(cls, part: "Part | str") -> "Part":
        """``Part`` itself, or a whole kind given by name."""
        return part if isinstance(part, Part) else cls(part)


@dataclass
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str  # qualified name in the model
    param: nn.Parameter
    offset: int  # in elements of the flat buffer
    shape: torch.Size
    position: int = -1  # index among the model's trainable parameters in model order (-1: frozen)

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class StateSlot:
    """Where one parameter's optimizer-state tensor of one kind lives in the kind's flat buffer."""

    kind: str
    offset: int  # elements into the flat buffer
    shape: torch.Size


@dataclass(frozen=True, eq=False)
class Piece:
    """One piece of a unit whose optimizer state streams in pieces (``unit_sizes.state_pieces``)."""

    lo: int  # elements [lo, hi) of the unit's trainable elements, its trainable slots in order
    hi: int
    segments: tuple[tuple[int, int, int], ...]  # (slot, lo, hi): the elements of each slot it covers
    spans: dict[str, tuple[int, int]]  # pieced kind -> its range of the kind's flat buffer (lo == hi: none)


@dataclass(frozen=True, eq=False)
class UnitLayout:
    """A unit's buffers in the store: made by ``unit_layout.store_unit``, fixed afterwards."""

    homes: "tuple[Tier, Tier, Tier]"  # home tiers of (weights, optimizer state, spilled gradients)
    handles: "dict[Part, TensorHandle]"  # the weights', each state part's (a spilled gradient's: Unit.memory)
    states: tuple[dict[str, StateSlot], ...]  # per slot: where its state of each kind lies
    flat: dict[str, tuple[int, torch.dtype]]  # kind (WEIGHTS too) -> (numel, dtype) of its flat buffer
    pieces: tuple[Piece, ...] = ()  # a pieced state's pieces (none: every kind whole)
    ratios: dict[str, int] = field(default_factory=dict)  # kind -> param elements per element (0: whole)
    nf4: "NF4Layout | None" = None  # frozen weights stored in NF4 (QLoRA)

    @property
    def whole_kinds(self) -> list[str]:
        """The optimizer-state kinds fetched whole (a pieced unit's other kinds stream in pieces)."""
        return [kind for kind in self.flat if kind not in (WEIGHTS, GRADS) and not self.ratios.get(kind)]

    def kinds(self) -> list[str]:
        """Every optimizer-state kind (pieced or not), in ``state_spec`` order."""
        return list(dict.fromkeys(kind for entry in self.states for kind in entry))

    def kind_parts(self, kind: str) -> list[tuple[Part, int, int]]:
        """(part, first, end) of the elements of ``kind``'s flat buffer: one part, or one per piece."""
        if not self.ratios.get(kind):
            return [(Part(kind), 0, self.flat[kind][0])]
        return [(Part(kind, i), *p.spans[kind]) for i, p in enumerate(self.pieces)
                if p.spans[kind][0] < p.spans[kind][1]]

    def state_views(self, flats: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """Optimizer state of the ``k``-th parameter as views into the fetched flats (by kind)."""
        return {kind: flats[kind][s.offset:s.offset + s.shape.numel()].view(s.shape)
                for kind, s in self.states[k].items()}

    def segment_state(self, piece: int, k: int, lo: int, hi: int, whole: dict[str, torch.Tensor],
                      part: dict[Part, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The optimizer state of elements [lo, hi) of slot ``k``, a segment of piece ``piece``:
        slices of the piece's parts (``part``) and views into the kinds kept whole (``whole``)."""
        state = {}
        for kind, s in self.states[k].items():
            ratio = self.ratios.get(kind)
            if ratio:
                first = s.offset + lo // ratio - self.pieces[piece].spans[kind][0]
                state[kind] = part[Part(kind, piece)][first:first + -(-(hi - lo) // ratio)]
            else:
                state[kind] = whole[kind][s.offset:s.offset + s.shape.numel()].view(s.shape)
        return state


@dataclass(eq=False)
class UnitStep:
    """Where a unit stands in the step: the engine's (engine.py), but ``norms``, the updater's."""

    bound: torch.Tensor | None = None  # the resident flat weights the parameters point into
    trainable: int = 0  # gradients that end this unit's backward
    pending: int | None = None  # gradients still to come this backward (None: not started)
    norms: list[Any] = field(default_factory=list)  # update.py: its spilled gradients' 2-norms, per trainable slot


@dataclass(eq=False)
class UnitMemoryState:
    """A unit's copies on the move between tiers, written by ``StoreUnitMemory`` (unit_memory.py) alone."""

    prefetched: "dict[Part, Future]" = field(default_factory=dict)  # fetched ahead, no consumer yet
    kept: dict[Part, int] = field(default_factory=dict)  # released but kept resident: part -> LRU tick
    decoded: torch.Tensor | None = None  # the NF4 weights dequantized, while fetched
    spilled: "dict[Part, TensorHandle]" = field(default_factory=dict)  # its spilled gradient, this step


@dataclass(eq=False)
class Unit:
    """A group of modules whose parameters move together, and everything about them."""

    # -- what it is (``causal_lm_units``) -------------------------------------------------
    index: int
    name: str
    modules: list[nn.Module]
    slots: list[ParamSlot] = field(default_factory=list)  # parameters this unit owns
    numel: int = 0  # elements of the flat buffer (with alignment padding)
    borrows: list[int] = field(default_factory=list)  # units whose weights this one also needs
    # data parallel: the range of its state this rank owns (``sharding.shard_units``, before layout)
    shard: "Shard | None" = None

    # -- in the store: set once by ``unit_layout.store_unit`` (None before) -------------------
    layout: UnitLayout | None = None
    # -- in the step: the engine's (the norms: the updater's), and the unit memory's ---------
    step: UnitStep = field(default_factory=UnitStep)
    memory: UnitMemoryState = field(default_factory=UnitMemoryState)

    def view(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The parameter ``slot`` as a view into ``flat`` [numel] (no copy)."""
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    @property
    def train_slots(self) -> list[int]:
        """Indices of the slots whose parameters train."""
        return [k for k, s in enumerate(self.slots) if s.param.requires_grad]

    def piece_parts(self, piece: int) -> list[Part]:
        """The parts of piece ``piece`` of a pieced state (and of its spilled gradient, while
        one is registered)."""
        parts = [Part(kind, piece) for kind, (lo, hi) in self.layout.pieces[piece].spans.items() if lo < hi]
        grad = Part(GRADS, piece)
        return parts + ([grad] if grad in self.memory.spilled else [])


def _pad(n: int, itemsize: int) -> int:
    per = max(1, PARAM_ALIGN // itemsize)
    return (n + per - 1) // per * per


def causal_lm_units(model: nn.Module, resident_trainable: bool = False,
                    head_modules: list[nn.Module] | tuple[nn.Module, ...] = ()) -> list[Unit]:
    """Cut a Hugging Face causal LM into ``[embed, blocks..., head]`` units.

    Args:
        model: a causal LM whose parts ``models.model_parts`` finds (the families of
            ``models.SUPPORTED_MODEL_TYPES``), or a peft wrapper of one.
        resident_trainable: lay out only the frozen parameters; those that train
            stay where they are, resident (LoRA: the base streams, the adapters stay).
        head_modules: modules that compute with the head after ``lm_head`` (or instead
            of calling it, like a chunked loss holding ``lm_head``); the head unit ends
            when the last of them returns.

    Returns:
        The units in forward order; every parameter of the model is owned by
        exactly one unit.

    Raises:
        ModelError: the model has no recognizable embed / blocks / head.
    """
    from ...models import model_parts

    parts = model_parts(model)
    groups: list[tuple[str, list[nn.Module]]] = [("embed", [parts.embed])]
    groups += [(f"block.{i}", [layer]) for i, layer in enumerate(parts.layers)]
    head = [m for m in (parts.final_norm, parts.lm_head, *head_modules) if m is not None]
    groups.append(("head", head))

    # local lookups, gone on return: a parameter's name, and its place among the trainable ones
    names = {id(p): n for n, p in model.named_parameters()}
    position = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    owner: dict[int, int] = {}
    units: list[Unit] = []
    for index, (name, modules) in enumerate(groups):
        unit = Unit(index=index, name=name, modules=modules)
        offset = 0
        for module in modules:
            for p in module.parameters():
                if id(p) in owner:
                    if owner[id(p)] != index and owner[id(p)] not in unit.borrows:
                        unit.borrows.append(owner[id(p)])
                    continue
                owner[id(p)] = index
                if resident_trainable and p.requires_grad:
                    continue
                unit.slots.append(ParamSlot(names[id(p)], p, offset, p.shape, position.get(id(p), -1)))
                offset += _pad(p.numel(), p.element_size())
        unit.numel = offset
        units.append(unit)

    missing = [n for n, p in model.named_parameters() if id(p) not in owner]
    if missing:
        raise ModelError(f"parameter {missing[0]!r} belongs to no embed/block/head unit; "
                         "only such models stream out of core (`outcore doctor --model M` tells)")
    return units


def place_rest(model: nn.Module, units: list[Unit], device: torch.device) -> None:
    """Move what no unit streams onto the compute ``device``: buffers (RoPE's frequencies,
    computed at load) and resident trainable parameters (LoRA adapters). ``.data`` is
    reassigned, so hooks and an optimizer built over the parameters keep them."""
    streamed = {s.param for u in units for s in u.slots}
    for p in model.parameters():
        if p not in streamed and p.device != device and p.device.type != "meta":
            p.data = p.data.to(device)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                setattr(module, name, buf.to(device))
