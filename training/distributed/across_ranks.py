"""A recipe run across the ranks ``torchrun`` (or ``accelerate launch``) started: one place for
everything a recipe does differently when it is one of several processes.

``torchrun --nproc-per-node N -m outcore finetune ...`` starts N copies of the same command;
each joins the process group here (:func:`join_run`, ``offload.distributed.join`` with the run's
``dist_timeout_s``) and then:

* **data** — step *s* takes ``grad_accum × world`` micro-batches from the one shuffled order
  every rank draws alike, and rank *r* keeps micro-batches r, r + world, … (:func:`my_micro_batches`);
  each loss is scaled by ``1 / (world · grad_accum)`` and the gradients are *summed*
  (:func:`all_reduce_grads`), so the reduced gradient is the one-rank accumulated one (bit for
  bit with two operands: a + b is b + a);
* **LoRA / QLoRA out of core** — each rank streams the frozen base read-only from its own swap
  directory (:func:`rank_swap_dir`) and the adapters' gradients are summed the same way
  (:class:`DataParallelAdapters`); a full fine-tune out of core shards its optimizer state
  across the ranks inside the engine (``offload/engine/sharding.py``: reduce-scatter, update, all-gather);
* **what is written once** — rank 0 holds the output directory's lock, writes ``config.yaml``,
  ``final/`` and commits checkpoints (:func:`prepare_run_dir`; ``checkpoint/dcp.py``); every
  rank writes its own metrics file (``tui.sinks.make_sink(rank=)``), rank 0's with every rank's
  stats (:func:`with_ranks`);
* **ZO** — the ``samples`` split of ``offload/zo/distributed.py`` (:func:`zo_split`);
* **a rank that dies** — every collective here waits at most ``dist_timeout_s``; gloo/NCCL fail
  at once when a peer's socket closes, and :func:`peer_guard` turns that into one
  :class:`~outcore.errors.RankLostError` line (exit 5) naming the run to ``--resume``.

The transport is ``torch.distributed`` (gloo on CPUs, NCCL on GPUs); nothing here sends
bytes of its own.
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..._faults import fault_point
from ...errors import CheckpointError, OutcoreError, RankLostError
from ...offload.device import distributed_backend
from ...offload.distributed import Ranks, from_env, join, leave
from ..output_dir import prepare_output_dir
from ..signals import StopOnSignal
from ..trainer import LossFn, Trainer
from .elastic import continue_after_restart, mark_launch

if TYPE_CHECKING:  # pragma: no cover
    from ...offload.engine import OutOfCoreEngine

SINGLE = Ranks()  # one process: what every recipe is when not launched distributed


def join_run(cfg: Any) -> tuple[Ranks, bool]:
    """Join the process group the launcher describes (nothing for one process).

    Args:
        cfg: the run's ``FinetuneConfig`` (``dist_timeout_s``).

    Returns:
        ``(ranks, joined)``: this process's :class:`~outcore.offload.distributed.Ranks`, and whether
        this call joined the group (then the run leaves it at its end: :func:`leave_run`).

    Raises:
        ConfigError: a bad environment.
    """
    import torch.distributed as tdist

    ranks = from_env()
    joined = tdist.is_available() and tdist.is_initialized()  # the caller's group (Ray Train, a notebook)
    if joined:
        ranks = Ranks(tdist.get_rank(), tdist.get_world_size(), ranks.local_rank)
    if not ranks.distributed:
        return ranks, False
    if joined:
        return ranks, False
    # CPU tensors (the in-memory replicas, the small exchanges) over gloo, CUDA ones over NCCL
    # (sim's: simgloo, which carries CPU tensors over gloo itself)
    backend = distributed_backend(cfg.device)
    backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    return join(timeout_s=cfg.dist_timeout_s, backend=backend), True


def plan_note(cfg: Any, world: int) -> str:
    """What the plan of one rank means among ``world`` (``outcore plan`` under torchrun or ``--ranks``)."""
    share = f"trains on {cfg.grad_accum} of the step's {step_size(cfg, Ranks(0, world))} micro-batches"
    if cfg.zeroth_order:
        what = "every rank holds the whole model and evaluates its share of the samples"
    elif cfg.offload != "none" and not cfg.uses_adapters:
        what = f"every rank holds the weights and 1/{world} of the optimizer state, and {share}"
    else:
        what = f"every rank holds a replica of the model and optimizer state and {share}"

    return f"plan per rank ({world} ranks, data parallel: {what})"


def rank_threads(threads: int, ranks: Ranks) -> int:
    """CPU threads for this rank: ``threads``, or (0) the cores shared among the ranks of this machine."""
    if threads or not ranks.distributed:
        return threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world) or ranks.world)
    return max(1, (os.cpu_count() or 1) // local)


@contextmanager
def peer_guard(ranks: Ranks, what: str, output: str | Path | None = None) -> Iterator[None]:
    """Turn a failed collective (a rank died or stopped answering) into one clear error.

    Args:
        ranks: this process's ranks.
        what: the collective, for the message (``"the gradient all-reduce"``).
        output: the run's output directory, which ``--resume`` continues (None: say OUTPUT).

    Raises:
        RankLostError: the collective failed (gloo/NCCL closed, timed out or aborted).
    """
    try:
        yield
    except OutcoreError:
        raise
    except (RuntimeError, ConnectionError) as e:  # DistBackendError and gloo's errors are RuntimeErrors
        if not ranks.distributed:
            raise
        peer = f"rank {1 - ranks.rank}" if ranks.world == 2 else "another rank"
        # gloo's message, without its source location: "Read error [127.0.0.1]:52618: Connection reset by peer"
        first = re.sub(r"\[[^\]]*\.(cc|cpp):\d+\]\s*", "", " ".join(str(e).split())).split(". ")[0][:160]
        raise RankLostError(f"rank {ranks.rank} of {ranks.world}: {peer} died or stopped answering during "
                            f"{what} ({first}); the newest complete checkpoint is intact: launch again with "
                            f"--resume {output or 'OUTPUT'}") from None


def my_micro_batches(loader: Any, grad_accum: int, ranks: Ranks) -> list[Any]:
    """This rank's micro-batches of the next step.

    Every rank draws the step's ``grad_accum × world`` micro-batches from the same order (the
    loader's position stays equal on every rank, so a checkpoint's is everyone's) and keeps
    those at r, r + world, …: two ranks with ``grad_accum`` 1 train on the sequences one rank
    with ``grad_accum`` 2 does.
    """
    step = [loader.next_batch() for _ in range(grad_accum * ranks.world)]
    return step[ranks.rank::ranks.world]


def all_reduce_grads(params: list[torch.nn.Parameter], loss: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Sum the gradients of ``params`` and the step's ``loss`` over the ranks (gradients in place).

    One flat buffer per dtype and device, one ``all_reduce(SUM)`` each: the bucketing DDP does, without
    its ``forward`` wrapper (the recipe's loss calls the decoder and a chunked head, not the
    model's ``forward``). Summed, not averaged: each loss was already scaled by
    ``1 / (world · grad_accum)``.

    Returns:
        ``loss`` summed over the ranks (the step's mean loss).
    """
    import torch.distributed as dist

    # one buffer per (dtype, device): the loss rides in its own (fp32 on the CPU: gloo)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {(loss.dtype, loss.device): []}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    fault_point("grad_all_reduce")
    total = loss
    for key, grads in buckets.items():
        tail = [loss.reshape(1)] if key == (loss.dtype, loss.device) else []
        flat = torch.cat([g.reshape(-1) for g in grads] + tail)
        # sync point: every rank waits here for every other rank's backward
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if tail:
            total = flat[offset].reshape(loss.shape)
    return total


def accumulate(model: torch.nn.Module, loss_fn: LossFn,
               micro_batches: list[Any], params: list[torch.nn.Parameter], ranks: Ranks,
               output: str | Path | None = None,
               around: Callable[[], AbstractContextManager[Any]] = nullcontext) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches, the gradients summed over the ranks.

    Each loss is scaled by ``1 / (len(micro_batches) · world)`` (one rank: ``1 / len``, the
    reference accumulation), so the sum over ranks is the one-rank accumulated gradient.

    Args:
        model: what ``loss_fn`` runs.
        loss_fn: ``(model, batch) -> mean loss``.
        micro_batches: this rank's micro-batches of the step.
        params: the trainable parameters whose gradients are summed.
        ranks: this process's ranks.
        output: the run's output directory (named if a rank is lost).
        around: a context around each micro-batch (the engine's ``micro_batch``).

    Returns:
        The step's loss summed over micro-batches and ranks, still a tensor.

    Raises:
        RankLostError: another rank died during the all-reduce.
    """
    total = None  # on the loss's device (a CPU zero would not take a device loss in place)
    for batch in micro_batches:
        with around():
            loss = loss_fn(model, batch) / (len(micro_batches) * ranks.world)
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    if ranks.distributed:
        with peer_guard(ranks, "the gradient all-reduce", output):
            total = all_reduce_grads(params, total, ranks)
    return total


class DataParallelAdapters:
    """An out-of-core engine training resident adapters (LoRA / QLoRA: the base streamed
    read-only on every rank), data parallel: a :class:`~outcore.training.trainer.Trainer` made of
    the engine's own ``begin_step`` / ``micro_batch`` / ``end_step``, the adapters' gradients
    summed over the ranks before ``end_step`` steps them. What else a caller needs of the engine
    (its store, units, model) it asks of :attr:`engine`.

    Args:
        engine: an ``OutOfCoreEngine`` with resident trainable parameters.
        ranks: this process's ranks.
        output: the run's output directory.
    """

    def __init__(self, engine: OutOfCoreEngine, ranks: Ranks, output: str | Path) -> None:
        self.engine, self.ranks, self.output = engine, ranks, output

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The adapters' global gradient norm of the last step (the engine clips them)."""
        return self.engine.last_grad_norm

    def train_step(self, loss_fn: LossFn, micro_batches: list[Any], lr: float) -> torch.Tensor:
        """One optimizer step (see ``OutOfCoreEngine.train_step``) over this rank's micro-batches."""
        e = self.engine
        e.begin_step(lr, len(micro_batches))
        total = accumulate(e.model, loss_fn, micro_batches, e.params, self.ranks, self.output, e.micro_batch)
        e.end_step()
        return total

    def close(self) -> None:
        """Close the engine (its store removes this rank's swap directory)."""
        self.engine.close()


def data_parallel(engine: OutOfCoreEngine, ranks: Ranks, output: str | Path) -> Trainer:
    """``engine`` as this run trains it: itself with one rank or sharded, :class:`DataParallelAdapters`
    for LoRA under torchrun."""
    # (a full fine-tune's engine is sharded: it sums the ranks' gradients itself)
    return DataParallelAdapters(engine, ranks, output) if ranks.distributed and engine.world == 1 else engine


def prepare_run_dir(cfg: Any, ranks: Ranks) -> tuple[Path, int | None]:
    """``output_dir.prepare_output_dir`` on rank 0; the other ranks wait for its verdict.

    Rank 0 alone holds the run lock and writes ``config.yaml``: the ranks of one run share
    its directory while a second run (another launch, whose rank 0 finds the lock held) is
    refused on every one of its ranks with rank 0's error. After a torchrun restart of the
    launch that wrote the directory, every rank continues that run (``elastic.py``: ``cfg``'s
    ``resume`` or ``overwrite`` set as rank 0 decided).

    Returns:
        ``(output directory, lock descriptor)``; the lock is None on ranks other than 0.

    Raises:
        OutcoreError: rank 0's error, on every rank.
    """
    def on_main() -> tuple[Path, int | None]:
        note = continue_after_restart(cfg, Path(cfg.output))
        if note:
            sys.stderr.write(note + "\n")
        out, lock = prepare_output_dir(cfg)
        mark_launch(out)
        return out, lock

    if not ranks.distributed:
        return on_main()
    result: tuple[Path, int | None] = (Path(cfg.output), None)
    verdict: Exception | None = None
    if ranks.is_main:
        try:
            result = on_main()
        except OutcoreError as e:
            verdict = e
    verdict, cfg.resume, cfg.overwrite = broadcast_from_main((verdict, cfg.resume, cfg.overwrite), ranks,
                                                             "the output directory check", cfg.output)
    if verdict is not None:
        raise verdict
    return result


def broadcast_from_main(obj: Any, ranks: Ranks, what: str, output: str | Path | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable object; ``obj`` itself with one rank)."""
    if not ranks.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if ranks.is_main else None]
    with peer_guard(ranks, what, output):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_rank_stats(stats: Any, ranks: Ranks, output: str | Path | None = None) -> list[Any]:
    """Every rank's small stats (a RankStats: tier bytes, bandwidth, stall) at a log step, in rank order.

    Only at log steps (every rank logs the same steps): an ``all_gather_object`` of a few
    hundred bytes. One rank: ``[stats]``.
    """
    if not ranks.distributed:
        return [stats]
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world
    with peer_guard(ranks, "the per-rank stats gather", output):
        dist.all_gather_object(out, stats)
    return out


def barrier(ranks: Ranks, what: str, output: str | Path | None = None) -> None:
    """Wait for every rank (no-op with one)."""
    if ranks.distributed:
        import torch.distributed as dist

        with peer_guard(ranks, what, output):
            dist.barrier()


def check_stop(stop: StopOnSignal, ranks: Ranks, output: str | Path | None = None) -> None:
    """``stop.check()`` agreed by every rank: a signal any rank got stops all at the same step.

    torchrun passes a Ctrl-C to every rank, but not at the same instant: without agreeing,
    one rank could stop (and start a checkpoint's collectives) while another begins the next
    step's all-reduce. One tiny ``all_reduce(MAX)`` per step.

    Raises:
        Interrupted: some rank got SIGINT / SIGTERM (the highest signal number wins).
    """
    if ranks.distributed:
        import torch.distributed as dist

        flag = torch.tensor([stop.signum or 0])
        with peer_guard(ranks, "the step boundary", output):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and stop.signum is None:
            stop.signum = int(flag)
    stop.check()


def with_ranks(ranks: Ranks, event: Any, output: str | Path | None = None) -> Any:
    """``event`` (a StepEvent), on rank 0 with every rank's :class:`~outcore.events.RankStats`.

    Every rank logs the same steps, so each sends its step time, stall, RSS and tiers there
    (an ``all_gather_object`` of a small dict); one rank: ``event`` unchanged.
    """
    if not ranks.distributed:
        return event
    from ...events import RankStats

    mine = RankStats(rank=ranks.rank, step_s=event.step_s, stall_s=event.stall_s, rss_bytes=event.rss_bytes,
                     tiers=dict(event.tiers))
    every = gather_rank_stats(mine, ranks, output)
    if ranks.is_main:  # the others' files hold their own rows only
        event.ranks = every
    return event


def leave_run(ranks: Ranks, joined: bool) -> None:
    """Leave the process group :func:`join_run` joined (``joined``), when the run ends.

    (Not after a lost rank — the caller's to decide: tearing down a group whose peer is gone
    can block, and the process is about to exit with the error anyway.)
    """
    if ranks.distributed and joined:
        leave()


def rank_swap_dir(swap: Path, ranks: Ranks) -> Path:
    """Each rank's own swap directory: ``swap/rankR`` under torchrun (a swap dir is locked by one
    process); their shared parent ``swap`` is created (0700) where it does not exist yet."""
    if not ranks.distributed:
        return swap
    swap.mkdir(mode=0o700, exist_ok=True)  # (every rank may race to it: exist_ok)
    return swap / f"rank{ranks.rank}"


def zo_split(ranks: Ranks, output: str | Path | None = None) -> dict[str, Any]:
    """``ZOBlockTrainer``'s distributed arguments: sample i runs on rank i mod world.

    The ``samples`` split (``offload/zo/distributed.py``): every rank on the same batch, the
    (seed, loss) pairs exchanged — bit-identical to one process with the same ``n_samples``,
    so the log rank 0 writes is the one-rank log, and ``--resume`` / ``outcore export`` replay it
    at any world size. (``data`` would average losses over different batches: a log that
    depends on the world size.) Give ``optim_args.n_samples`` a multiple of the ranks.
    """
    if not ranks.distributed:
        return {}
    from ...offload.zo import make_exchange

    exchange = make_exchange("samples")

    def guarded(*args: Any) -> Any:
        with peer_guard(ranks, "the ZO loss exchange", output):
            return exchange(*args)

    return {"rank": ranks.rank, "world": ranks.world, "exchange": guarded, "split": "samples"}


def step_size(cfg: Any, ranks: Ranks) -> int:
    """Micro-batches one optimizer step takes over every rank: ``grad_accum × world``."""
    return cfg.grad_accum * ranks.world


def restore_loader(loader: Any, trainer_state: dict[str, Any], cfg: Any, ranks: Ranks) -> None:
    """Continue the data order of a checkpoint, at this world size.

    A run may resume on another number of ranks when ``grad_accum × ranks`` stays the same
    (2 ranks × grad_accum 1 → 1 rank × grad_accum 2): each step then takes the same
    micro-batches, and the run goes on as if it had never changed.

    Raises:
        CheckpointError: the step would take another number of micro-batches.
    """
    saved = int(trainer_state.get("micro_batches", cfg.grad_accum))  # older checkpoints: one rank
    if saved != step_size(cfg, ranks):
        raise CheckpointError(f"--resume {cfg.resume!r}: the run's steps took {saved} micro-batches "
                              f"(grad_accum × ranks), this launch's take {step_size(cfg, ranks)} "
                              f"(grad_accum={cfg.grad_accum} × {ranks.world} rank(s)); "
                              f"pass grad_accum={max(1, saved // ranks.world)} with {ranks.world} rank(s) "
                              f"or launch {max(1, saved // cfg.grad_accum)} rank(s)")
    loader.load_state_dict(trainer_state["loader"])
