"""Per-block activation policies and the SSDTrain-style choice between them.

In the forward pass each decoder block saves tensors for its backward (its
*activations*). Per block, outcore can

- ``KEEP``: leave them in device memory (fastest, most memory);
- ``RECOMPUTE``: save only the block's inputs and run its forward again in the
  backward (``torch.utils.checkpoint``; costs one block forward);
- ``OFFLOAD_HOST`` / ``OFFLOAD_NVME``: move the large saved tensors to the HOST
  or NVME tier of the ``TieredStore`` as soon as they are saved, and prefetch
  them back ahead of the backward in reverse block order (costs bandwidth; free
  when the transfer hides behind compute).
- ``RECOMPUTE_HOST`` / ``RECOMPUTE_NVME``: recompute, with the block's checkpoint
  (its input hidden state, ``c x hidden`` bytes per token) moved to the HOST or NVME
  tier the same way and fetched ahead of its recompute: the device then holds no
  activation that grows with the number of blocks (long context).

:func:`choose_policy` picks one per block from the budgets, the measured
activation sizes and compute times, and the measured bandwidths, the way
SSDTrain adapts offloading: an offload is free while its transfer fits behind
the compute between the save and the use; early blocks have the most slack.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from ..errors import BudgetError, ConfigError


class ActivationPolicy(enum.Enum):
    """What happens to one block's saved activations."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD_HOST = "offload_host"
    OFFLOAD_NVME = "offload_nvme"
    RECOMPUTE_HOST = "recompute_host"
    RECOMPUTE_NVME = "recompute_nvme"

    @classmethod
    def parse(cls, value: "ActivationPolicy | str") -> "ActivationPolicy":
        """``ActivationPolicy.KEEP``, ``"keep"`` or ``"KEEP"`` -> the policy.

        Raises:
            ConfigError: an unknown name.
        """
        if isinstance(value, ActivationPolicy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ConfigError(f"activation policy {value!r} is not one of: {names}") from None

    @property
    def offloads(self) -> bool:
        """Whether the block's saved tensors (or its checkpoint) go through the offloader."""
        return self in (ActivationPolicy.OFFLOAD_HOST, ActivationPolicy.OFFLOAD_NVME,
                        ActivationPolicy.RECOMPUTE_HOST, ActivationPolicy.RECOMPUTE_NVME)

    @property
    def recomputes(self) -> bool:
        """Whether the block runs again in the backward (its checkpoint kept, or offloaded)."""
        return self in (ActivationPolicy.RECOMPUTE, ActivationPolicy.RECOMPUTE_HOST, ActivationPolicy.RECOMPUTE_NVME)

    @property
    def to_host(self) -> bool:
        """Whether what it offloads goes to the HOST tier (else NVME)."""
        return self in (ActivationPolicy.OFFLOAD_HOST, ActivationPolicy.RECOMPUTE_HOST)


#: ``auto``: measure the first training forward, then :func:`choose_policy` per block
#: (out of core, the planner's rule instead: ``planner/choice.py``).
AUTO = "auto"
#: ``offload``: OFFLOAD_NVME for every block but the last ``keep_last`` (:func:`expand_policy`).
OFFLOAD = "offload"
#: ``recompute_host`` / ``recompute_nvme``: every block recomputed, the checkpoints of all but
#: the last ``keep_last`` on that tier (:func:`expand_policy`)
CHECKPOINT_OFFLOADS = (ActivationPolicy.RECOMPUTE_HOST.value, ActivationPolicy.RECOMPUTE_NVME.value)
#: The run-level names (``--activations``, ``FinetuneConfig.activations``, the planner):
#: one policy for every block, ``offload``, recompute with offloaded checkpoints, or ``auto``.
ACTIVATION_POLICIES = (AUTO, ActivationPolicy.KEEP.value, ActivationPolicy.RECOMPUTE.value, OFFLOAD,
                       *CHECKPOINT_OFFLOADS)
#: where a step under each run-level policy keeps what its blocks need for their backward (the
#: plan's longest context, the dashboard, the log's header and the run's summary say it)
ACTIVATION_HOMES = {ActivationPolicy.KEEP.value: "activations kept on DEVICE",
                    ActivationPolicy.RECOMPUTE.value: "block checkpoints on DEVICE",
                    CHECKPOINT_OFFLOADS[0]: "block checkpoints on HOST",
                    CHECKPOINT_OFFLOADS[1]: "block checkpoints on NVME",
                    OFFLOAD: "activations offloaded to NVME"}


def activation_home(policy: str) -> str:
    """Where the activations of a run under run-level ``policy`` live, in a few words (the
    dashboard, the log's header and the summary): ``"block checkpoints on NVME (recompute_nvme)"``."""
    if policy == AUTO:
        return "auto: chosen at the first training step"
    return f"{ACTIVATION_HOMES[policy]} ({policy})"

#: How offloaded activations are stored (``--activations-compress``,
#: ``FinetuneConfig.activations_compress``, the planner): ``none`` moves the bytes as
#: they are (bit-identical backward); ``int8`` / ``fp8`` (COAT-style, opt-in) store each
#: floating-point saved tensor as 8-bit codes with one fp32 scale per block of
#: ``COMPRESS_BLOCK`` elements (``activations/compress.py``).
ACTIVATION_COMPRESSION = ("none", "int8", "fp8")
COMPRESS_BLOCK = 256  # elements per scale: (256 + 4) / 512 = 0.51x the bytes of bf16, 0.25x of fp32


#: ``seq_tile`` (``FinetuneConfig.seq_tile``, ``apply_activation_policy``, the planner): each
#: block's MLP runs over tiles of that many tokens (``activations/tiling.py``); ``auto`` sizes
#: the tile from the model's shape, 0 leaves the MLP untiled.
SEQ_TILE_AUTO = "auto"


def parse_seq_tile(value: "int | str") -> "int | str":
    """``auto`` or a tile of tokens >= 0 (0: untiled) from a config value (``"4096"`` -> 4096).

    Raises:
        ConfigError: anything else.
    """
    if isinstance(value, str) and value.strip().lower() == SEQ_TILE_AUTO:
        return SEQ_TILE_AUTO
    try:
        n = int(value)
        ok = n >= 0 and not isinstance(value, bool) and float(value) == n
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ConfigError(f"seq_tile={value!r} must be '{SEQ_TILE_AUTO}', 0 (untiled) or tokens per tile, e.g. 4096")
    return n


def compressed_ratio(compress: str, dtype_bytes: int) -> float:
    """Stored bytes per raw byte of an offloaded floating-point activation of ``dtype_bytes``
    bytes per element under ``compress`` (what the planner sizes offloaded activations by).

    Raises:
        ConfigError: ``compress`` is not one of :data:`ACTIVATION_COMPRESSION`.
    """
    if compress not in ACTIVATION_COMPRESSION:
        raise ConfigError(f"activations_compress={compress!r} is not one of: {', '.join(ACTIVATION_COMPRESSION)}")
    if compress == "none":
        return 1.0
    return (COMPRESS_BLOCK + 4) / (COMPRESS_BLOCK * dtype_bytes)  # 1-byte codes + one fp32 scale per block


@dataclass(frozen=True)
class BlockProfile:
    """What one block's activations cost (measured in a forward pass)."""

    saved_bytes: int  # bytes saved for backward with KEEP (parameters excluded)
    input_bytes: int  # bytes of its input hidden states (what RECOMPUTE keeps)
    forward_s: float  # seconds of its forward compute
    offload_bytes: int | None = None  # bytes an offload stores and moves (compressed); None: saved_bytes

    @property
    def moved_bytes(self) -> int:
        return self.saved_bytes if self.offload_bytes is None else self.offload_bytes


def _per_block(value, n: int, name: str) -> list:
    if isinstance(value, (int, float)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ConfigError(f"{name} has {len(value)} entries for {n} blocks")
    return value


def choose_policy(profiles: Sequence[BlockProfile], device_budget: int, *,
                  host_budget: int = 0, host_bps: float = 0.0,
                  nvme_budget: int | None = 0, nvme_read_bps: float = 0.0,
                  nvme_write_bps: float = 0.0, keep_last: int = 1,
                  backward_factor: float = 2.0, copy_bps: float = 0.0) -> list[ActivationPolicy]:
    """Choose a policy per block so the activations fit ``device_budget`` at least cost.

    Start from KEEP everywhere. While the kept bytes exceed the budget, change the
    block whose change costs the least time per byte freed (ties: the earliest
    block, whose activations are needed last). Costs, with ``f`` the block's
    forward time and ``b = backward_factor * f``:

    - RECOMPUTE: ``f`` (one more forward); keeps ``input_bytes``.
    - OFFLOAD to a tier with bandwidth ``bw``, moving ``s`` bytes (the block's
      ``moved_bytes``: fewer than it saves when compressed): the stall
      ``max(0, s/bw_write - f) + max(0, s/bw_read - b)`` (the write hides behind the
      next block's forward, the read behind a later block's backward), plus
      ``s/copy_bps`` when packing the block into its transfer buffer takes the
      compute's own cores (a CPU device; 0 on CUDA, where a DMA engine copies);
      keeps 0. Only while that tier's budget still holds the bytes.

    The last ``keep_last`` blocks stay KEEP: their backward comes first, so there
    is nothing to hide an offload behind.

    Args:
        profiles: one :class:`BlockProfile` per block, in forward order.
        device_budget: bytes the activations may hold on the device.
        host_budget: HOST bytes available for activations (0: no HOST offload).
        host_bps: device<->host bandwidth in bytes/s (0: no HOST offload).
        nvme_budget: NVME bytes for activations (None: unbounded; 0: no NVMe offload).
        nvme_read_bps, nvme_write_bps: measured NVMe bandwidth in bytes/s.
        keep_last: blocks at the end that always KEEP.
        backward_factor: backward time as a multiple of forward time.
        copy_bps: bytes/s of the copy into the transfer buffer when it competes with
            compute (CPU devices); 0: the copy is free (DMA).

    Returns:
        One :class:`ActivationPolicy` per block.

    Raises:
        ConfigError: negative budgets or ``keep_last``.
        BudgetError: even recomputing every other block does not fit the budget.
    """
    if device_budget < 0 or host_budget < 0 or (nvme_budget is not None and nvme_budget < 0):
        raise ConfigError(f"budgets must be >= 0 (device={device_budget}, host={host_budget}, "
                          f"nvme={nvme_budget})")
    if keep_last < 0 or copy_bps < 0:
        raise ConfigError(f"keep_last={keep_last} and copy_bps={copy_bps} must be >= 0")
    n = len(profiles)
    policy = [ActivationPolicy.KEEP] * n
    held = [int(p.saved_bytes) for p in profiles]
    room = {ActivationPolicy.OFFLOAD_HOST: host_budget if host_bps > 0 else 0,
            ActivationPolicy.OFFLOAD_NVME: (0 if nvme_read_bps <= 0 or nvme_write_bps <= 0
                                            else (float("inf") if nvme_budget is None else nvme_budget))}
    bw = {ActivationPolicy.OFFLOAD_HOST: (host_bps, host_bps),
          ActivationPolicy.OFFLOAD_NVME: (nvme_read_bps, nvme_write_bps)}
    while sum(held) > device_budget:
        best = None
        for i in range(max(0, n - keep_last)):
            if policy[i] is not ActivationPolicy.KEEP:
                continue
            for cost, freed, choice in _changes(profiles[i], held[i], room, bw, backward_factor, copy_bps):
                key = (cost / max(freed, 1), i)
                if freed > 0 and (best is None or key < best[0]):
                    best = (key, i, choice)
        if best is None:
            raise BudgetError(
                f"activations need {sum(held)} bytes on the device even with every block but the "
                f"last {keep_last} recomputed or offloaded; the budget is {device_budget} bytes: "
                f"lower the batch size or sequence length, or raise the device budget")
        _, i, choice = best
        policy[i] = choice
        if choice is ActivationPolicy.RECOMPUTE:
            held[i] = profiles[i].input_bytes
        else:
            room[choice] -= profiles[i].moved_bytes
            held[i] = 0
    return policy


def _changes(p: BlockProfile, held: int, room: dict[ActivationPolicy, float],
             bw: dict[ActivationPolicy, tuple[float, float]], backward_factor: float,
             copy_bps: float) -> list[tuple[float, int, ActivationPolicy]]:
    """What one KEEP block (profile ``p``, holding ``held`` bytes) could change to, as
    ``(seconds it costs, bytes it frees, policy)`` (the costs of :func:`choose_policy`).

    Args:
        room: per offload tier, the bytes it can still take.
        bw: per offload tier, its (read, write) bandwidth in bytes/s.
    """
    out = []
    if p.input_bytes < held:
        out.append((p.forward_s, held - p.input_bytes, ActivationPolicy.RECOMPUTE))
    moved = p.moved_bytes
    for tier, (rd, wr) in bw.items():
        if room[tier] >= moved and rd > 0 and wr > 0:
            stall = (max(0.0, moved / wr - p.forward_s)
                     + max(0.0, moved / rd - backward_factor * p.forward_s)
                     + (moved / copy_bps if copy_bps > 0 else 0.0))
            out.append((stall, held, tier))
    return out


def expand_policy(policy: "ActivationPolicy | str | Sequence[ActivationPolicy | str]",
                  n_blocks: int, keep_last: int = 1) -> list[ActivationPolicy]:
    """One policy per block from a single policy, a name, or a list.

    ``"offload"`` means OFFLOAD_NVME for every block but the last ``keep_last``
    (their backward comes first, so their transfers could not be hidden).
    ``"recompute_host"`` / ``"recompute_nvme"``: that policy for every block but the last
    ``keep_last``, which recompute from a checkpoint kept on the device.

    Raises:
        ConfigError: an unknown name, a list of the wrong length, or ``keep_last < 0``.
    """
    if keep_last < 0:
        raise ConfigError(f"keep_last={keep_last} must be >= 0")
    if isinstance(policy, str) and policy.lower() == OFFLOAD:
        kept = min(keep_last, n_blocks)
        return [ActivationPolicy.OFFLOAD_NVME] * (n_blocks - kept) + [ActivationPolicy.KEEP] * kept
    if isinstance(policy, str) and policy.lower() in CHECKPOINT_OFFLOADS:
        kept = min(keep_last, n_blocks)  # their recompute comes first: nothing to hide a read behind
        return [ActivationPolicy(policy.lower())] * (n_blocks - kept) + [ActivationPolicy.RECOMPUTE] * kept
    if isinstance(policy, (str, ActivationPolicy)):
        return [ActivationPolicy.parse(policy)] * n_blocks
    out = [ActivationPolicy.parse(p) for p in _per_block(policy, n_blocks, "policy")]
    return out
