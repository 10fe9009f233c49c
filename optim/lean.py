"""The write-lean precision mode (``precision=bf16-lean``): bf16 weights, no fp32 master.

Mixed precision keeps an fp32 master of every weight (4 bytes read and written per
parameter per step on top of the state); round-to-nearest into bf16 without one would lose
every update smaller than half a bf16 ulp. :class:`LeanOptimizer` wraps any outcore
optimizer and updates the bf16 weights themselves: per chunk of a tensor it widens the
weights and the gradient to fp32 (exact), runs the wrapped optimizer's ``update`` on them with
that chunk's state, and rounds the result back *stochastically*
(``kernels/stochastic_round.py``), so every update moves a weight by its exact value on
average. Where the wrapped optimizer has one fused pass for this
(:meth:`~outcore.optim.OutcoreOptimizer.update_lean`: AdamW8bit's 8-bit tensors on CPU, which
widen, update and round a block at a time in the C++ kernel) it takes the tensor instead,
with the same bits and no fp32 chunk buffers. With :class:`~outcore.optim.AdamW8bit` the bytes
written per parameter per step are the bf16 weight (2) and the two 8-bit moments (2): their
block absmax stays in RAM (``offload.engine.unit_sizes.ram_kinds``).

The rounding's random bits are a hash of (run seed, parameter position, the tensor's update
count, element index), never a generator stream: the position and count are two int64
scalars of the state (``sr_key``, ``sr_step``), so a checkpoint carries them, a piece of a
tensor rounds with the whole's bits (the engine passes each piece's offset in the group,
``PIECE_OFFSETS``), and in memory, out of core and resumed runs give the same weights bit for
bit.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..kernels.stochastic_round import stochastic_round_
from ..kernels.zo_perturb import zo_seed
from ._base import PIECE_OFFSETS, OutcoreOptimizer, StateSpec

#: Elements per fp32 chunk: 4 MiB of widened weights and 4 MiB of widened gradient whatever
#: the tensor (a 1 GiB unit never has an fp32 copy), a multiple of every quantization block and
#: of ``PIECE_ALIGN`` (4096) so a chunk never splits a block, and a million elements per call
#: to the wrapped optimizer, so its per-call cost (Python, a step-count sync on CUDA) is noise.
CHUNK = 1 << 20
#: the state this mode adds per tensor: the rounding key of (seed, position), the update count
KEY, STEP = "sr_key", "sr_step"
LEAN_KINDS = (KEY, STEP)


class LeanOptimizer(OutcoreOptimizer):
    """Train bf16 parameters with ``inner``'s update and stochastic rounding, no fp32 master.

    Args:
        inner: an ``OutcoreOptimizer`` over the same bf16 parameters (its hyper-parameters and
            param groups are taken over; its state is sized as for fp32 parameters).
        seed: the run's seed (part of every rounding key).

    Raises:
        ConfigError: a parameter that is not bfloat16, or a negative seed.
    """

    wants_master = False  # the bf16 weights are updated themselves

    def __init__(self, inner: OutcoreOptimizer, seed: int) -> None:
        if seed < 0:
            raise ConfigError(f"seed={seed} must be >= 0")
        for group in inner.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ConfigError(f"precision=bf16-lean trains bfloat16 weights, got {p.dtype} for a "
                                      f"tensor of shape {tuple(p.shape)}; load the model with dtype=bfloat16")
        self.inner, self.seed = inner, seed
        self._scratch: dict[tuple[int, torch.device], Tensor] = {}  # see _widened
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """The wrapped optimizer's state of an fp32 ``p``, and the two rounding scalars."""
        scalar = torch.Size([])
        return {KEY: (scalar, torch.int64), STEP: (scalar, torch.int64),
                **self.inner.state_spec(_fp32(p), group)}

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """The wrapped optimizer's initial state (seen as an fp32 ``p``, same identity), the key
        of (seed, ``p``'s position) and a zero update count."""
        with _as_fp32(p):
            state = self.inner.init_state(p, group)
        key = zo_seed(self.seed, self.param_index(p))
        return {KEY: torch.tensor(key, dtype=torch.int64, device=p.device),
                STEP: torch.zeros((), dtype=torch.int64, device=p.device), **state}

    def elementwise_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, int] | None:
        """The wrapped optimizer's ratios (None when it mixes elements); the scalars are whole."""
        ratios = self.inner.elementwise_state(_fp32(p), group)
        return None if ratios is None else {KEY: 0, STEP: 0, **ratios}

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """Update the bf16 ``params`` in place: the wrapped optimizer's fused pass where it has
        one (``update_lean``), else a chunk at a time (see the module docstring).

        ``group[PIECE_OFFSETS]`` (set by the out-of-core engine for pieces): per parameter,
        the index of its first element in its whole tensor; absent, every one starts at 0.
        """
        offsets = group.get(PIECE_OFFSETS) or [0] * len(params)
        keys, inner = [], []
        for state in states:
            state[STEP].add_(1)
            # .item() is a sync point on CUDA, once per tensor: the key reaches the kernel as a scalar
            keys.append(zo_seed(int(state[KEY].item()), int(state[STEP].item())))
            inner.append({kind: t for kind, t in state.items() if kind not in LEAN_KINDS})
        done = self.inner.update_lean(params, grads, inner, group, list(zip(keys, offsets)))
        for p, g, state, key, offset, fused in zip(params, grads, inner, keys, offsets, done):
            if fused:
                continue
            ratios = self.inner.elementwise_state(_fp32(p), group)
            if ratios is None or any(r and CHUNK % r for r in ratios.values()):
                ratios, size = {}, max(p.numel(), 1)  # the update mixes elements: the tensor at once
            else:
                size = CHUNK
            self._update_chunks(p, g, state, ratios, size, key, offset, group)

    def _update_chunks(self, p: Tensor, g: Tensor, state: dict[str, Tensor], ratios: dict[str, int],
                       size: int, key: int, offset: int, group: dict[str, Any]) -> None:
        """``p``'s update in chunks of ``size`` elements; a chunk's state is its range of each
        element-wise kind (``ratios``), the whole of each kind kept whole (the step count), which
        is set back before every chunk after the first so it advances once, as for the whole."""
        flat_p, flat_g, n = p.view(-1), g.reshape(-1), p.numel()
        whole = {kind: t for kind, t in state.items() if not ratios.get(kind)}
        start = {kind: t.clone() for kind, t in whole.items()} if n > size else {}
        for a in range(0, n, size):
            b = min(a + size, n)
            if a:
                for kind, t in whole.items():
                    t.copy_(start[kind])
            if b - a == n:  # one chunk: the tensor in its own shape (a projection needs its matrix)
                w, wg, chunk = p.float(), g.float(), state
            else:
                w, wg = self._widened(0, flat_p[a:b]), self._widened(1, flat_g[a:b])
                chunk = {kind: t if kind in whole else t.view(-1)[a // ratios[kind]:-(-b // ratios[kind])]
                         for kind, t in state.items()}
            self.inner.update([w], [wg], [chunk], group)
            stochastic_round_(flat_p[a:b], w.view(-1), key, offset + a)


    def _widened(self, slot: int, src: Tensor) -> Tensor:
        """``src`` (a chunk, at most ``CHUNK`` elements) in fp32, in one of two buffers reused
        across chunks and steps: a fresh 4 MiB tensor per chunk is mapped anew by the allocator
        and pays its page faults every time (measured: half the time of the widening)."""
        buf = self._scratch.get((slot, src.device))
        if buf is None:
            buf = self._scratch[(slot, src.device)] = torch.empty(CHUNK, dtype=torch.float32, device=src.device)
        return buf[: src.numel()].copy_(src)


def _fp32(p: Tensor) -> Tensor:
    """A meta fp32 tensor of ``p``'s shape: what the wrapped optimizer sizes its state for."""
    return torch.empty(p.shape, dtype=torch.float32, device="meta")


@contextlib.contextmanager
def _as_fp32(p: Tensor) -> Iterator[None]:
    """``p`` seen as an fp32 tensor of its shape (no memory: a broadcast scalar) for the block,
    keeping its identity (some optimizers seed their state by the parameter's position)."""
    data = p.data
    p.data = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
    try:
        yield
    finally:
        p.data = data


def with_precision(optimizer: OutcoreOptimizer, precision: str, seed: int) -> OutcoreOptimizer:
    """``optimizer`` as a run of ``precision`` trains with it.

    Args:
        optimizer: an outcore optimizer over the run's trainable parameters.
        precision: one of ``dtypes.PRECISIONS``.
        seed: the run's seed (the rounding keys of ``bf16-lean``).

    Returns:
        ``optimizer`` itself (``exact``), or a :class:`LeanOptimizer` around it (``bf16-lean``).
    """
    from ..dtypes import BF16_LEAN

    return LeanOptimizer(optimizer, seed) if precision == BF16_LEAN else optimizer
