"""``simgloo``: the collectives of the simulated accelerator (``offload/simdevice.py``), over gloo.

torch's device backends bring their collective library with them (CUDA: NCCL, HPU: HCCL,
XPU: XCCL), registered with ``torch.distributed.Backend.register_backend``, so that
``init_process_group`` gives the device's tensors to it. gloo carries CPU (and CUDA) tensors
only, so on ``sim`` every collective on a device tensor would fail; this is the sim device's
backend::

    simdevice.enable()                                      # registers "simgloo" too
    dist.init_process_group("simgloo", ...)                 # device.distributed_backend(sim)
    dist.all_reduce(torch.ones(4, device="sim"))

Each collective copies its sim tensors to the CPU (a blocking copy on the calling thread's
current stream, which orders it after the kernels that wrote them, as NCCL's stream waits on
the current one), runs gloo on the copies, and copies the results back on the same stream
before it returns: the result is ready on the stream, as NCCL's is once ``wait()`` returned.
CPU tensors go to gloo as they are. Where NCCL would refuse a call, so does this backend: a
collective mixing CPU and device tensors (NCCL: "Tensors must be CUDA and dense"), a
non-contiguous device tensor ("Tensors must be contiguous").

A backend implemented in Python is a ``torch.distributed.ProcessGroup`` subclass (torch's own
``threaded`` test backend is one); torch makes it the whole group (``_new_process_group_helper``:
a creator returning a ProcessGroup replaces the group), so this one carries the CPU tensors too
(registered for ``cpu`` and ``sim``: ``"simgloo"`` alone is the group, as ``"gloo"`` is).
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

NAME = "simgloo"
DEVICE = "sim"
_registered = False


def register() -> None:
    """Register the ``simgloo`` backend with ``torch.distributed`` (idempotent; nothing is
    connected until a process group is made with it)."""
    global _registered
    if _registered:
        return
    if not dist.is_available():
        return
    dist.Backend.register_backend(NAME, _create, devices=["cpu", DEVICE])
    _registered = True


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> "SimGlooGroup":
    return SimGlooGroup(store, rank, size, timeout)


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def _to_host(arg: Any, read: bool) -> Any:
    """``arg`` (a tensor or nested lists of them) with its sim tensors replaced by CPU ones:
    copies when gloo reads them (``read``), fresh buffers when it only writes them."""
    if isinstance(arg, torch.Tensor):
        if arg.device.type != DEVICE:
            return arg
        return arg.to("cpu") if read else torch.empty_like(arg, device="cpu")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_to_host(a, read) for a in arg)
    return arg


def _copy_back(device_arg: Any, host_arg: Any) -> None:
    if isinstance(device_arg, torch.Tensor):
        if device_arg is not host_arg:
            device_arg.copy_(host_arg)
        return
    if isinstance(device_arg, (list, tuple)):
        for d, h in zip(device_arg, host_arg):
            _copy_back(d, h)


def _done(result: Any) -> Any:
    from torch._C._distributed_c10d import _create_work_from_future

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _collective(name: str, *, in_place: bool = False, outputs: bool = True):
    """A ProcessGroup method that runs ``name`` of the inner gloo group on CPU stand-ins of its
    sim tensors. Argument 0 holds the outputs (``outputs``), and the inputs too (``in_place``:
    all_reduce, broadcast, reduce); the other tensor arguments are inputs."""

    def method(self: "SimGlooGroup", *args: Any) -> Any:
        every = _tensors(args)
        kinds = {t.device.type for t in every}
        if len(kinds) > 1:
            raise RuntimeError(f"{NAME} {name}: tensors on {' and '.join(sorted(kinds))} in one collective; "
                               "every tensor of a collective must be on one device (NCCL: Tensors must be CUDA "
                               "and dense)")
        if kinds - {"cpu", DEVICE}:
            raise RuntimeError(f"{NAME} {name}: tensors on {kinds.pop()}; {NAME} carries cpu and {DEVICE} tensors")
        if DEVICE not in kinds:  # CPU tensors: gloo's own (waited here: a gloo send's work waited
            getattr(self._gloo, name)(*args).wait()  # twice waits for a second send)
            return _done(args[0] if outputs else None)
        if any(not t.is_contiguous() for t in every):
            raise ValueError(f"{NAME} {name}: Tensors must be contiguous")
        host = [_to_host(a, read=(i > 0 or in_place or not outputs)) for i, a in enumerate(args)]
        getattr(self._gloo, name)(*host).wait()
        if outputs:
            _copy_back(args[0], host[0])
        return _done(args[0] if outputs else None)

    method.__name__ = name
    method.__doc__ = f"``{name}`` over gloo, sim tensors through CPU copies."
    return method


class SimGlooGroup(dist.ProcessGroup if dist.is_available() else object):
    """The process group ``init_process_group("simgloo")`` makes: a gloo group underneath
    (``self._gloo``, a ProcessGroup with gloo for the CPU), the sim tensors staged through CPU
    copies around each of its collectives."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # (torch 2.13 has no Python subclass constructor with the store)
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._gloo = dist.ProcessGroup(store, rank, size)
        self._gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._gloo._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        # CPU tensors are gloo's: torch's object collectives and DCP ask the group's devices
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

    def getBackendName(self) -> str:  # torch's name
        return NAME

    def __repr__(self) -> str:
        return f"SimGlooGroup(rank={self.rank()}, size={self.size()})"

    allreduce = _collective("allreduce", in_place=True)
    allreduce_coalesced = _collective("allreduce_coalesced", in_place=True)
    broadcast = _collective("broadcast", in_place=True)
    reduce = _collective("reduce", in_place=True)
    allgather = _collective("allgather")
    allgather_coalesced = _collective("allgather_coalesced")
    allgather_into_tensor_coalesced = _collective("allgather_into_tensor_coalesced")
    _allgather_base = _collective("_allgather_base")
    reduce_scatter = _collective("reduce_scatter")
    _reduce_scatter_base = _collective("_reduce_scatter_base")
    reduce_scatter_tensor_coalesced = _collective("reduce_scatter_tensor_coalesced")
    gather = _collective("gather")
    scatter = _collective("scatter")
    alltoall = _collective("alltoall")
    alltoall_base = _collective("alltoall_base")
    send = _collective("send", outputs=False)
    recv = _collective("recv")  # (not recv_anysource: its work must name the sender)
    # torch 2.13's names (2.11: dist.all_gather_into_tensor -> _allgather_base, ...)
    all_gather_single = _collective("all_gather_single")
    reduce_scatter_single = _collective("reduce_scatter_single")
    all_gather_single_coalesced = _collective("all_gather_single_coalesced")
    reduce_scatter_single_coalesced = _collective("reduce_scatter_single_coalesced")
    all_to_all_single = _collective("all_to_all_single")

    def barrier(self, opts: Any = None) -> Any:
        self._gloo.barrier(opts if opts is not None else dist.BarrierOptions()).wait()
        return _done(None)

    def shutdown(self) -> None:
        self._gloo.shutdown()

    def abort(self) -> None:
        self._gloo.abort()
