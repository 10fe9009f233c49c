"""Placements, byte accounting and the step-time model behind :mod:`outcore.planner.plan`.

A :class:`Layout` says, per unit of transfer, where its weights, gradients and
optimizer state live; :func:`account` adds up what each tier then holds
(authoritative copies + the prefetch window + staging buffers + activations)
and :func:`step_time` what one step moves over each link and how long that
takes next to the compute. The planner in ``plan.py`` searches layouts with
these two functions; nothing here decides policy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..activations.policy import CHECKPOINT_OFFLOADS, OFFLOAD, ActivationPolicy, compressed_ratio
from ..dtypes import DTYPE_BYTES
from ..methods import MethodTraits
from ..offload.engine.unit_sizes import step_window, window_bytes
from ..offload.engine.units import PARAM_ALIGN
from ..offload.modes import CPU, NONE, NVME
from ..offload.store import Tier
from ..offload.store.directio import ALIGN  # the store aligns every arena block and NVMe extent to it
from .budget import Budgets
from .compute import ComputeRates
from .sizes import (ModelSpec, UnitBytes, block_activation_bytes, checkpoint_bytes, chunked_head_bytes,
                    forward_flops_per_token, head_activation_bytes, mlp_tile_bytes, tiled_block_bytes)

LINKS = ("nvme_read", "nvme_write", "h2d", "d2h")
KEEP, RECOMPUTE = ActivationPolicy.KEEP.value, ActivationPolicy.RECOMPUTE.value
RECOMPUTE_HOST, RECOMPUTE_NVME = CHECKPOINT_OFFLOADS
#: the run-level policies that recompute every block in the backward
RECOMPUTED = (RECOMPUTE, *CHECKPOINT_OFFLOADS)


def _slack(u: UnitBytes, allocations: int = 1) -> int:
    """Upper bound of the padding the store adds to ``allocations`` flat buffers of unit ``u``."""
    return allocations * (ALIGN + PARAM_ALIGN * u.tensors)


@dataclass(frozen=True)
class Workload:
    """Everything about the job that sizes a layout, except the layout itself."""

    spec: ModelSpec
    units: tuple[UnitBytes, ...]
    method: MethodTraits
    dtype: str
    seq_len: int
    grads_kept: bool  # clipping / accumulation: gradients are stored until every unit has one
    budgets: Budgets
    activations_compress: str = "none"  # how offloaded activations are stored (activations.policy)
    rates: ComputeRates | None = None  # measured per unit kind (compute.py); None: budgets.flops
    seq_tile: int = 0  # tokens per MLP tile (activations/tiling.py); 0: untiled
    padding_free: bool = False  # packed documents: a [batch, 1, seq, seq] attention mask per step
    masters: bool = True  # a 16-bit dtype keeps fp32 masters (precision exact); bf16-lean keeps none
    #: a CPU full fine-tune's update, timed here (compute.measure_update_rate): the model's
    #: parameters it covers per second (a rank of ``world`` updates 1/world of them); 0: the
    #: update is costed by the bytes it moves (a GPU's, adapters', ZO's)
    update_params_per_s: float = 0.0
    #: on a GPU, the update runs on the CPU where the state lives (``update_on=host``)
    update_on_host: bool = False

    @property
    def update_on_device(self) -> bool:  # the update runs on the GPU, its state streamed there
        return self.budgets.device_kind != "cpu" and not self.update_on_host

    def tiled(self, batch: int) -> bool:  # a micro-batch of ``batch`` sequences runs its MLPs tiled
        return self.spec.tileable_mlp and 0 < self.seq_tile < batch * self.seq_len

    @property
    def block_tiled(self) -> bool:  # a recomputed block runs over tiles of positions (tiled_block.py)
        return self.spec.tileable_block and 0 < self.seq_tile < self.seq_len and not self.padding_free

    @property
    def has_backward(self) -> bool:
        return self.method.backward

    def compute_s(self, unit: UnitBytes, tokens: int, activations: str) -> float:
        """Seconds of compute ``unit`` costs per step over ``tokens`` tokens (0 without a rate)."""
        rate = self.rates.of(unit.kind) if self.rates else self.budgets.flops
        passes = self.compute_passes(unit, activations, batch=max(1, tokens // self.seq_len))
        flops = tokens * forward_flops_per_token(self.spec, unit, self.seq_len) * passes
        return flops / rate if rate > 0 else 0.0

    def compute_passes(self, unit: UnitBytes, activations: str, batch: int = 1) -> float:
        """Forward-equivalents of compute ``unit`` costs per step: the method's passes, plus
        one more forward of a block whose activations are recomputed for its backward, plus
        one more of a tiled MLP (3 x hidden x intermediate of the block's matmuls per token:
        in a tiled block, only where its tile's rows, ``batch x seq_tile``, are more than one
        MLP tile), plus a tiled block's keys and values recomputed for every tile but the last
        (the q, k, v projections)."""
        block = unit.kind == "block" and self.has_backward
        share = 1 / max(unit.matmul_params, 1)
        mlp = min(1.0, 3 * self.spec.hidden * self.spec.intermediate * share)
        recomputed = activations in RECOMPUTED and block
        passes = self.method.compute_passes + (1.0 if recomputed else 0.0)
        if recomputed and self.block_tiled:
            tiles = -(-self.seq_len // self.seq_tile)
            qkv = self.spec.hidden * (self.spec.heads + 2 * self.spec.kv_heads) * self.spec.head_dim * share
            return passes + min(1.0, qkv) * (tiles - 1) / tiles + (mlp if batch > 1 else 0.0)
        return passes + (mlp if self.tiled(batch) and block else 0.0)


@dataclass(frozen=True)
class Layout:
    """Where each class of tensor of each unit lives.

    ``resident[i]``: unit *i* stays whole on DEVICE (weights, grads, state). For a
    streamed unit, ``weights[i]`` / ``grads[i]`` / ``state[i]`` are HOST or NVME:
    the authoritative copy's tier; DEVICE holds only the prefetch window.
    """

    resident: tuple[bool, ...]
    weights: tuple[Tier, ...]
    grads: tuple[Tier, ...]
    state: tuple[Tier, ...]
    activations: str  # a name of activations.policy.ACTIVATION_POLICIES but auto
    prefetch: int = 2  # k: units in flight ahead of the one computing (0 when nothing streams)

    @classmethod
    def uniform(cls, n: int, tier: Tier, activations: str, prefetch: int = 2) -> "Layout":
        if tier == Tier.DEVICE:
            return cls((True,) * n, (Tier.DEVICE,) * n, (Tier.DEVICE,) * n, (Tier.DEVICE,) * n, activations, 0)
        return cls((False,) * n, (tier,) * n, (tier,) * n, (tier,) * n, activations, prefetch)

    def with_unit(self, i: int, **tiers: Tier | bool) -> "Layout":
        """A copy with unit ``i``'s ``resident`` / ``weights`` / ``grads`` / ``state`` changed."""
        changes = {}
        for name, value in tiers.items():
            seq = list(getattr(self, name))
            seq[i] = value
            changes[name] = tuple(seq)
        return replace(self, **changes)

    @property
    def streamed(self) -> list[int]:
        return [i for i, r in enumerate(self.resident) if not r]

    def name(self, grads_kept: bool = True) -> str:
        """``none`` (all on DEVICE), ``cpu`` (streamed from HOST), ``nvme`` or ``mixed``.
        ``nvme``: weights and state on NVMe, kept gradients there or in HOST (``plan._grads_in_ram``).

        Args:
            grads_kept: whether gradients are stored (else their tier does not count).
        """
        if all(self.resident):
            return NONE
        classes = (self.weights, self.grads, self.state) if grads_kept else (self.weights, self.state)
        tiers = {c[i] for i in self.streamed for c in classes}
        if not any(self.resident) and tiers == {Tier.HOST}:
            return CPU
        on_disk = {c[i] for i in self.streamed for c in (self.weights, self.state)} == {Tier.NVME}
        if not any(self.resident) and on_disk and tiers <= {Tier.NVME, Tier.HOST}:
            return NVME
        return "mixed"


@dataclass
class Accounting:
    """Bytes per tier, split into named parts, for one layout and micro-batch."""

    parts: dict[Tier, dict[str, int]] = field(default_factory=lambda: {t: {} for t in Tier})

    def add(self, tier: Tier, part: str, nbytes: int) -> None:
        if nbytes:
            self.parts[tier][part] = self.parts[tier].get(part, 0) + int(nbytes)

    def total(self, tier: Tier) -> int:
        return sum(self.parts[tier].values())

    def over_budget(self, b: Budgets) -> tuple[str, int, int] | None:
        """The first violated budget as (name, budget, need), or None when everything fits."""
        for tier, budget in ((Tier.DEVICE, b.device_bytes), (Tier.HOST, b.host_bytes),
                             (Tier.NVME, b.nvme_bytes)):
            if self.total(tier) > budget:
                return tier.name, budget, self.total(tier)
        if b.shared_ram and self.total(Tier.DEVICE) + self.total(Tier.HOST) > b.ram_bytes:
            return "RAM (DEVICE + HOST)", b.ram_bytes, self.total(Tier.DEVICE) + self.total(Tier.HOST)
        return None


def _fetch_bytes(w: Workload, lay: Layout, i: int) -> int:
    """Bytes brought to DEVICE to compute unit ``i``: its weights and borrowed streamed ones (tied head)."""
    u = w.units[i]
    return u.weights + sum(w.units[j].weights for j in u.borrows if not lay.resident[j])


def _grad_window(w: Workload, streamed: list[UnitBytes]) -> int:
    """Gradient bytes beside the weights on DEVICE. On a GPU, one unit's being produced and
    one being updated (or spilled). On a CPU the update runs in the backward's hook (or the
    spill does), so one unit's gradients at a time (the head's, computed in the forward with
    the loss, live until its update) plus the update's fp32 copy of what it updates at once —
    a piece, or a whole unit — when it steps fp32 masters from 16-bit gradients."""
    grads = max(u.grads for u in streamed)
    if w.budgets.device_kind != "cpu":
        return 2 * grads
    if w.dtype == "float32" or not any(u.state for u in streamed):
        return grads
    at_once = [u.trainable * u.state_piece // u.state if u.state_piece else u.trainable for u in streamed if u.state]
    return grads + 4 * max(at_once)


def activations_read_ahead(window: int) -> int:
    """Offloaded blocks' activations (or checkpoints) read ahead in the backward at prefetch depth
    ``window``: at least one, as the weights' window (the runtime's ``prefetch_depth``)."""
    return max(window, 1)


def activation_bytes(w: Workload, policy: str, batch: int, window: int) -> tuple[int, int, int]:
    """(DEVICE, HOST, NVME) bytes of activations for ``batch`` sequences under ``policy``.

    A recomputed block holds its saved tensors (and a tiled MLP one tile's) while its
    backward runs, one block at a time — tiled whole where ``seq_tile`` is shorter than the
    sequence (``tiled_block_bytes``: one tile's, and its keys and values over the sequence);
    its checkpoint, the block's input, waits on DEVICE (``recompute``) or, but for the
    ``window + 1`` blocks read ahead and the last kept, on HOST / NVME (``recompute_host`` /
    ``recompute_nvme``). The head is the chunked loss's where the model's loss is it
    (``ModelSpec.chunked_loss``).

    A step holds the blocks' share, RoPE's tables and the larger of two phases: the loss (the
    head's kept rows and, for the chunked loss, whose gradients are taken in the forward, its
    weight gradient and logits chunk), then the blocks' backward (the gradient w.r.t. the last
    hidden state, the head's other rows freed by the final norm's backward, and one block's
    recompute or MLP tile). Sampled through a step of the default model at 8K tokens, tiled, the
    checkpoints in RAM (``scripts/trace_step_phases.py 8192 recompute``, 2026-11-27): the forward
    1302 MiB, the loss 1399, the blocks' backward 1612.
    """
    s, spec = w.seq_len, w.spec
    if not w.has_backward:  # ZO: two forward passes in flight, nothing saved for a backward
        c = DTYPE_BYTES[w.dtype]
        return batch * 2 * (s * c * (2 * spec.hidden + 2 * spec.intermediate) + s * 4 * spec.vocab), 0, 0
    head, loss = (chunked_head_bytes(spec, w.dtype, batch * s, w.method.trains_weights) if spec.chunked_loss
                  else (batch * head_activation_bytes(spec, w.dtype, s), 0))  # (kept, while the loss runs)
    saved = batch * block_activation_bytes(spec, w.dtype, s, tiled=w.tiled(batch))  # one block's
    # packed documents: the model's boolean [batch, 1, s, s] mask for the step, and SDPA's copy of
    # it in the compute dtype that every block saves (quadratic in the length)
    mask = batch * s * s if w.padding_free else 0
    saved += mask * DTYPE_BYTES[w.dtype]
    # RoPE's cos / sin tables in the compute dtype, made once per forward and held by every block's
    # graph or recompute all step: one row of positions, one per sequence with packed documents
    rope = (batch if w.padding_free else 1) * s * 2 * spec.head_dim * DTYPE_BYTES[w.dtype]
    tile = mlp_tile_bytes(spec, w.dtype, w.seq_tile) if w.tiled(batch) else 0  # one tile's, one block at a time
    L = spec.layers
    ckpt = batch * checkpoint_bytes(spec, w.dtype, s)
    grad = batch * s * spec.hidden * DTYPE_BYTES[w.dtype]  # d loss / d the last block's output

    def phases(blocks: int) -> int:  # the loss's phase, or the blocks' backward, whichever holds more
        return mask + rope + max(head + loss, grad + blocks)
    if policy == KEEP:
        return L * saved + phases(tile), 0, 0
    recompute = tiled_block_bytes(spec, w.dtype, s, w.seq_tile, batch) if w.block_tiled else saved + tile
    if policy == RECOMPUTE:
        return L * ckpt + phases(recompute), 0, 0
    if policy in CHECKPOINT_OFFLOADS:
        near = min(L, activations_read_ahead(window) + 1)  # read ahead, and the last block's (kept)
        away = (L - near) * ckpt
        dev = near * ckpt + phases(recompute + ckpt)  # (the block in flight's checkpoint, read back)
        return (dev, away, 0) if policy == RECOMPUTE_HOST else (dev, 0, away)
    if policy == OFFLOAD:  # the offloaded bytes shrink by the codec's ratio
        offloaded = int(L * saved * compressed_ratio(w.activations_compress, DTYPE_BYTES[w.dtype]))
        return min(L, activations_read_ahead(window) + 1) * saved + phases(tile), offloaded, 0
    raise ValueError(f"unknown activation policy {policy!r}")


def account(w: Workload, lay: Layout, batch: int) -> Accounting:
    """What each tier holds for ``lay`` at micro-batch ``batch`` (see the module doc)."""
    acc = Accounting()
    us = w.units
    for i, u in enumerate(us):
        acc.add(Tier.DEVICE, "adapters", u.adapter_bytes)  # LoRA adapters + their state stay resident
        if lay.resident[i]:
            acc.add(Tier.DEVICE, "weights", u.weights)
            acc.add(Tier.DEVICE, "grads", u.grads)
            acc.add(Tier.DEVICE, "optimizer state", u.state)
            continue
        acc.add(lay.weights[i], "weights", u.weights)
        acc.add(lay.weights[i], "alignment", _slack(u))
        if w.grads_kept and u.grads:
            acc.add(lay.grads[i], "grads", u.grads)
            acc.add(lay.grads[i], "alignment", _slack(u))
        if u.state:
            ram = u.ram_state if lay.state[i] == Tier.NVME else 0  # scales stay in RAM (unit_sizes.ram_kinds)
            acc.add(lay.state[i], "optimizer state", u.state - ram)
            acc.add(lay.state[i], "alignment", _slack(u, u.state_kinds))
            acc.add(Tier.HOST, "optimizer scales", ram)
    streamed = lay.streamed
    if streamed:
        k = max(lay.prefetch, 1)
        slack = max(_slack(us[i]) for i in streamed)
        # As the engine sizes its arenas (unit_sizes.working_set): on DEVICE the unit computing,
        # what it borrows, k prefetched and k + 1 kept for the next phase, consecutive in the
        # step's order; gradients: one being produced, one being handed off.
        weights = [0 if lay.resident[i] else u.weights for i, u in enumerate(us)]
        acc.add(Tier.DEVICE, "prefetch window", step_window(weights, 2 * k + 2, [u.borrows for u in us]))
        acc.add(Tier.DEVICE, "grad window", _grad_window(w, [us[i] for i in streamed]))
        # QLoRA: the unit computing is dequantized beside its NF4 bytes; one at a time (a
        # frozen unit is let go before the one before it binds, engine._backward_begin)
        acc.add(Tier.DEVICE, "dequantized unit", max(us[i].decoded for i in streamed))
        acc.add(Tier.DEVICE, "alignment", (k + 3) * slack)
        nvme_w = [us[i].weights for i in streamed if lay.weights[i] == Tier.NVME]
        # a unit whose state streams in pieces stages a piece at a time, its spilled gradient too
        nvme_s = [_streamed_state(us[i], us[i].state_piece or us[i].state) for i in streamed
                  if lay.state[i] == Tier.NVME]
        nvme_g = [us[i].grads * us[i].state_piece // us[i].state if us[i].state_piece else us[i].grads
                  for i in streamed if lay.grads[i] == Tier.NVME and w.grads_kept]
        kinds = max(us[i].state_kinds for i in streamed)
        if nvme_w and w.budgets.device_kind == "cuda":  # disk -> GPU goes through pinned HOST memory
            acc.add(Tier.HOST, "NVMe staging", k * max(nvme_w))
            acc.add(Tier.HOST, "alignment", k * slack)
        if nvme_s:  # the unit updating and k read ahead
            acc.add(Tier.HOST, "NVMe staging", window_bytes(nvme_s, k + 1))
            acc.add(Tier.HOST, "alignment", (k + 2) * kinds * slack)
        if nvme_g:
            acc.add(Tier.HOST, "NVMe staging", 2 * max(nvme_g))
            acc.add(Tier.HOST, "alignment", 2 * slack)
        state = [us[i].state_piece or us[i].state for i in streamed if us[i].state]
        if w.update_on_device and state:  # the update runs on the GPU: its state streams there
            acc.add(Tier.DEVICE, "state window", window_bytes(state, k + 1))
            acc.add(Tier.DEVICE, "alignment", (k + 2) * kinds * slack)
    dev, host, nvme = activation_bytes(w, lay.activations, batch, lay.prefetch)
    acc.add(Tier.DEVICE, "activations", dev)
    acc.add(Tier.HOST, "activations", host)
    acc.add(Tier.NVME, "activations", nvme)
    return acc


@dataclass
class StepTime:
    """The expected cost of one step."""

    io_bytes: dict[str, int]  # bytes per link per step
    io_s: dict[str, float]  # seconds per link (NVMe read + write share one disk)
    compute_s: float  # forward + backward (+ recompute) time
    update_s: float  # optimizer update (on the CPU-only machine's cores, or on the GPU)
    step_s: float  # prologue + the slowest overlapped lane + epilogue
    exposed_io_s: float  # step_s - compute - update on the same cores

    @property
    def disk_s(self) -> float:
        return self.io_s["nvme_read"] + self.io_s["nvme_write"]


def step_time(w: Workload, lay: Layout, batch: int) -> StepTime:
    """Bytes moved per link and the expected step time, I/O hidden where the schedule overlaps it.

    Weights of a streamed unit are read once per pass that uses them (forward and
    backward; ZO: once) but where the engine keeps them resident between passes
    (:func:`weight_reads`). Dirty state goes back once per step; frozen (LoRA) weights
    are never written. On a GPU the update runs there (``StoreUnitMemory.tier``): a streamed
    unit's state crosses to the device and back, its updated weights go back to their home,
    and gradients never leave the device unless they are spilled. Updated on the host
    (``update_on_host``), the state stays put: the gradients come down once, the updated
    weights go up (and, without masters, come down first), and the CPU's update, timed, runs
    beside the backward: a unit's while the GPU computes the one before it (``UnitUpdater._start``;
    after the backward, with gradients kept for clipping or accumulation, it stalls the GPU).
    """
    b, us = w.budgets, w.units
    io = dict.fromkeys(LINKS, 0)
    trains_weights = w.method.trains_weights
    streamed = lay.streamed
    cuda = b.device_kind == "cuda"
    for i in streamed:
        u = us[i]
        reads = weight_reads(w, lay, i) * u.weights
        # CPU-only: the disk reads straight into the DEVICE arena (transfers.py); a copy
        # crosses HOST -> DEVICE only from a HOST home, or on CUDA (disk -> pinned HOST -> GPU)
        io["h2d"] += reads if cuda or lay.weights[i] == Tier.HOST else 0
        if lay.weights[i] == Tier.NVME:
            io["nvme_read"] += reads
            if trains_weights:
                io["nvme_write"] += u.weights  # the updated weights (compute dtype) go back once
        if cuda and trains_weights:
            io["d2h"] += u.weights  # the updated weights, to their home
        if cuda and trains_weights and w.update_on_host and u.grads:
            io["h2d"] += u.weights  # the update's new weights, up
            io["d2h"] += u.weights if not _has_masters(w) else 0  # the weights the update steps, down
        if w.has_backward and u.grads:
            if cuda and w.update_on_host:
                io["d2h"] += u.grads  # spilled or not, down once to the update
            elif w.grads_kept and lay.grads[i] != Tier.DEVICE:  # spilled home, read back by the update
                io["d2h"] += u.grads if cuda else 0
                io["h2d"] += u.grads if cuda else 0
            if w.grads_kept and lay.grads[i] == Tier.NVME:
                io["nvme_write"] += u.grads
                io["nvme_read"] += u.grads
        if cuda and u.state and not w.update_on_host:  # the update's state, to the GPU and back
            io["h2d"] += u.state
            io["d2h"] += u.state
        if lay.state[i] == Tier.NVME and u.state:
            io["nvme_read"] += u.state - u.ram_state
            io["nvme_write"] += u.state - u.ram_state
    _, host_acts, nvme_acts = activation_bytes(w, lay.activations, batch, lay.prefetch)
    if lay.activations in CHECKPOINT_OFFLOADS:  # block checkpoints out in the forward, back in the backward
        io["nvme_write"] += nvme_acts
        io["nvme_read"] += nvme_acts
        io["d2h"] += host_acts if cuda else 0
        io["h2d"] += host_acts if cuda else 0
    gb = 1e9
    io_s = {"nvme_read": io["nvme_read"] / (b.disk_read_gbps * gb),
            "nvme_write": io["nvme_write"] / (b.disk_write_gbps * gb),
            "h2d": io["h2d"] / (b.h2d_gbps * gb), "d2h": io["d2h"] / (b.d2h_gbps * gb)}

    unit_compute_s = [w.compute_s(u, batch * w.seq_len, lay.activations) for u in us]
    compute_s = sum(unit_compute_s)
    mem = (b.device_mem_gbps if w.update_on_device else b.host_mem_gbps) * gb
    update_s = _update_bytes(w) / mem
    if w.update_params_per_s > 0:  # the optimizer timed; a master's widening and rounding moved bytes
        trained = sum(u.trainable for u in us if u.grads)
        update_s = trained / w.update_params_per_s + _master_pass_bytes(w) / mem
    disk = io_s["nvme_read"] + io_s["nvme_write"]  # one disk: reads and writes share it
    copy = io_s["h2d"] + io_s["d2h"]  # one copy engine (a DMA engine / one copy thread)
    # every NVMe byte is hashed on an I/O thread (nvme.py): CPU time, not disk time
    hashing = (io["nvme_read"] + io["nvme_write"]) / (b.checksum_gbps * gb)
    if b.device_kind == "cpu":
        # One set of cores computes, updates, copies into the DEVICE arena and hashes: a
        # thread taken from the compute's parallel regions stalls all of them, so these add up.
        lanes = [compute_s + update_s + copy + hashing, disk]
        busy = compute_s + update_s
    elif w.update_on_host and not w.grads_kept:  # the CPU updates a unit while the GPU computes the next
        computing = _overlapped_backward(w, lay, batch, unit_compute_s, update_s)
        lanes = [computing, disk, copy, hashing]
        busy = computing
    else:  # every update runs on the GPU between the backward's kernels, or on the CPU while it waits
        lanes = [compute_s + update_s, disk, copy, hashing]
        busy = compute_s + update_s
    # Write-behind runs on into the next step (nothing waits for it at the turn), and the
    # units the backward ends with are kept for the forward: only a first unit read in the
    # forward (nothing kept: ZO, inference) is fetched before anything can compute.
    prologue = 0.0
    if streamed and _read_in_forward(w, lay, streamed[0]):
        first = _fetch_bytes(w, lay, streamed[0])
        prologue = first / (b.h2d_gbps * gb)
        if lay.weights[streamed[0]] == Tier.NVME:
            prologue += first / (b.disk_read_gbps * gb)
    step = prologue + max(lanes)
    return StepTime(io_bytes=io, io_s=io_s, compute_s=compute_s, update_s=update_s, step_s=step,
                    exposed_io_s=max(0.0, step - busy))


def _overlapped_backward(w: Workload, lay: Layout, batch: int, total: list[float], update_s: float) -> float:
    """Seconds of the step's compute (``total``: each unit's) with each unit's CPU update beside
    the next unit's backward: the forwards, the last unit's backward alone, then per unit the longer
    of its update and the backward of the unit before it, and the first unit's update alone
    (``update_s`` shared out by trained parameters)."""
    us = w.units
    trained = sum(u.trainable for u in us if u.grads) or 1
    fwd = [t / max(w.compute_passes(u, lay.activations, batch), 1.0) for t, u in zip(total, us)]
    bwd = [t - f for t, f in zip(total, fwd)]
    upd = [update_s * u.trainable / trained if u.grads else 0.0 for u in us]
    return (sum(fwd) + bwd[-1] + sum(max(upd[i], bwd[i - 1]) for i in range(len(us) - 1, 0, -1))
            + upd[0])


def _streamed_state(u: UnitBytes, nbytes: int) -> int:
    """Of ``nbytes`` of ``u``'s state (the whole, or a piece), what streams from NVMe: all but
    the small kinds kept in RAM."""
    return nbytes - u.ram_state * nbytes // u.state if u.state else 0


def _update_bytes(w: Workload) -> int:
    """RAM bytes the optimizer updates of a step touch (memory-bound): read w, g, state and write
    w, state (ZO: 4 in-place passes over w), and a master's widening and rounding
    (:func:`_master_pass_bytes`)."""
    us = w.units
    if not w.has_backward:
        return sum(8 * u.weights for u in us)
    return (sum(2 * u.weights + u.grads + 2 * u.state for u in us if u.grads) + _master_pass_bytes(w)
            + sum(2 * u.adapter_bytes for u in us))


def _has_masters(w: Workload) -> bool:
    """Does the update step fp32 masters of 16-bit weights (precision exact)?"""
    return w.has_backward and DTYPE_BYTES[w.dtype] != 4 and w.method.trains_weights and w.masters


def _master_pass_bytes(w: Workload) -> int:
    """Mixed precision with fp32 masters (update.py) widens each gradient to fp32 (read it, write
    4 bytes, which the update then reads instead) and rounds the fp32 master into the 16-bit
    weight (read 4 bytes, write the weight). bf16-lean widens and rounds in cache-sized chunks
    (or block by block in the 8-bit kernel): no more RAM traffic than the weights' and
    gradients' own."""
    if not _has_masters(w):
        return 0
    return sum((12 + DTYPE_BYTES[w.dtype]) * u.trainable for u in w.units if u.grads)


def _read_in_forward(w: Workload, lay: Layout, i: int) -> bool:
    """Is streamed unit ``i`` read from its home in the forward (not kept from the step before)?"""
    if any(i in u.borrows for u in w.units):
        return False
    return not w.has_backward or i > max(lay.prefetch, 1)


def weight_reads(w: Workload, lay: Layout, i: int) -> int:
    """How many times a step reads streamed unit ``i``'s weights from their home, in a steady loop.

    As the engine keeps them (``OutOfCoreEngine._needed_soon``): the forward keeps its last
    ``k + 1`` units for the backward, which starts with them; the backward keeps its last
    ``k + 1`` — the first units — for the next step's forward; a unit another borrows (a
    tied embedding, used by the head at the turn of the step; ZO holds it for the run) stays
    resident. ZO: one forward per step, nothing else kept.
    """
    if not w.has_backward:
        return int(_read_in_forward(w, lay, i))
    k, n = max(lay.prefetch, 1), len(w.units)
    return int(_read_in_forward(w, lay, i)) + int(i < n - 1 - k and not any(i in u.borrows for u in w.units))


def prefetch_depth(w: Workload, lay: Layout, batch: int, max_depth: int = 4) -> int:
    """Units to keep in flight so a unit's fetch hides behind the previous units' compute.

    A unit fetched ``k`` units ahead has ``k`` units' compute to land in, so ``k`` is
    ``ceil(fetch time / compute time)`` of a typical streamed unit — a block: the window
    runs over the blocks, while the embedding is sized and fetched apart (the largest unit,
    kept resident through the step when tied) — at least 1 (the next unit loads while
    this one computes), at most ``max_depth``: when I/O is slower than compute a deeper
    queue cannot raise the rate, it only absorbs jitter. Every unit of depth costs DEVICE
    (and HOST) room for two more units, so no deeper than the I/O needs (measured on
    SmolLM2-135M from NVMe: depth 1 and 2 step equally fast, depth 1 peaks ~50 MiB lower).
    """
    streamed = lay.streamed
    if not streamed:
        return 0
    blocks = [i for i in streamed if w.units[i].kind == "block"] or streamed
    ratios = sorted(_unit_io_s(w, lay, i) / max(_unit_compute_s(w, lay, i, batch), 1e-12) for i in blocks)
    return int(min(max_depth, max(1, math.ceil(ratios[len(ratios) // 2]))))


def _unit_io_s(w: Workload, lay: Layout, i: int) -> float:
    """Seconds of transfer per visit of streamed unit ``i`` (as ``step_time`` counts its bytes):
    the disk, or the copy engine, whichever is longer. A unit's write-backs run on the I/O
    threads while the next units are read, and an NVMe queue serves both at once, so a unit's
    disk time is the longer of its reads and its writes (``step_time`` adds them for the
    whole step: the disk's total work)."""
    b, u = w.budgets, w.units[i]
    passes = 2 if w.has_backward else 1
    fetch = _fetch_bytes(w, lay, i)
    read = write = 0
    if lay.weights[i] == Tier.NVME:
        read += passes * fetch
        write += u.weights if w.method.trains_weights else 0
    if lay.state[i] == Tier.NVME and u.state:
        read, write = read + u.state - u.ram_state, write + u.state - u.ram_state
    if w.has_backward and u.grads and w.grads_kept and lay.grads[i] == Tier.NVME:
        read, write = read + u.grads, write + u.grads
    disk = max(read / (b.disk_read_gbps * 1e9), write / (b.disk_write_gbps * 1e9))
    copy = passes * fetch / (b.h2d_gbps * 1e9) + (u.grads if w.has_backward else 0) / (b.d2h_gbps * 1e9)
    return max(disk, copy) / passes


def _unit_compute_s(w: Workload, lay: Layout, i: int, batch: int) -> float:
    """Seconds of compute per visit of unit ``i`` (forward, or backward at twice the forward)."""
    return w.compute_s(w.units[i], batch * w.seq_len, lay.activations) / (2 if w.has_backward else 1)
