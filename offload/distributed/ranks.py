"""Which process this is among the ranks ``torchrun`` started, and the process group they share.

One definition of rank, world size and the process group for every distributed part of
outcore (first-order data parallelism, zeroth-order seed exchange, the per-rank UI and
checkpoints). The transport is ``torch.distributed`` (gloo on CPUs, NCCL on GPUs),
launched by ``torchrun`` or ``accelerate launch``, which describe the group in the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

A collective waits at most ``timeout_s`` for the other ranks: a rank that died makes the
others fail there (gloo raises) instead of hanging forever.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from ...errors import ConfigError
from ..device import distributed_backend, use_local_device

DEFAULT_TIMEOUT_S = 300.0  # a collective's longest wait: a step's slowest unit, with room


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks.

    Attributes:
        rank: global rank, 0..world-1.
        world: number of ranks (1 when not launched distributed).
        local_rank: rank on this machine (picks the GPU).
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        """More than one rank."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that shows the dashboard and writes what a run writes once."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} in the environment must be an integer (set by torchrun)") from None


def from_env() -> Ranks:
    """The ranks the launcher describes in the environment; one rank when there is none.

    Raises:
        ConfigError: malformed ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world}: a rank must be in [0, WORLD_SIZE); launch with torchrun")
    return Ranks(rank, world, local)


def elastic_attempt() -> int | None:
    """torchrun's attempt at this launch (0, then one more per restart), or None outside torchrun.

    Raises:
        ConfigError: a malformed ``TORCHELASTIC_RESTART_COUNT``.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def join(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> Ranks:
    """Join the process group the environment describes (nothing to join for one rank).

    Args:
        timeout_s: the longest a collective waits for the other ranks.
        backend: ``gloo`` / ``nccl``; None picks nccl when CUDA is available, else gloo.

    Returns:
        This process's :class:`Ranks`.
    """
    import torch.distributed as dist

    ranks = from_env()
    if ranks.distributed and not dist.is_initialized():
        use_local_device(ranks.local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        # torchrun's store outlives a failed attempt: the ranks it restarts would read the dead
        # ranks' addresses under the default keys (gloo: "connection refused"), so each attempt
        # keys its own rendezvous.
        store = dist.PrefixStore(f"outcore/attempt_{elastic_attempt() or 0}/default_pg", store)
        dist.init_process_group(backend or distributed_backend(), store=store, rank=rank, world_size=world,
                                timeout=timeout)
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), ranks.local_rank)
    return ranks


def leave() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
