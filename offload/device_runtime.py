"""The devices as a run asks about them, beside computing and copying (``device.py``): the
machine's GPUs and their memory, the compute device's RNG state (checkpoints), and under
torchrun the process-group backend and each rank's GPU.

Each has a branch per backend (docs/architecture.md §12); nothing here does device work at
import time.
"""
from __future__ import annotations

from typing import Any

import torch

from .device import cuda_available


def list_devices() -> list[dict]:
    """The CUDA devices: ``[{"name", "total_bytes", "free_bytes"}]``; ``[]`` on CPU."""
    if not cuda_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append({"name": torch.cuda.get_device_name(i), "total_bytes": int(total),
                    "free_bytes": int(free)})
    return out


def device_memory(device: torch.device | None = None) -> dict[str, int]:
    """``{"device_bytes", "device_total_bytes"}`` of the CUDA ``device`` (default: the current
    one, this rank's under torchrun) for StepEvent; ``{}`` elsewhere."""
    if not cuda_available() or (device is not None and device.type != "cuda"):
        return {}
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return {"device_bytes": int(torch.cuda.memory_allocated(index)),
            "device_total_bytes": int(torch.cuda.get_device_properties(index).total_memory)}


def free_device_bytes(device: torch.device) -> int:
    """Free bytes on an accelerator ``device`` (a host sync point: call it rarely)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free, _ = torch.accelerator.get_memory_info(device)
    return int(free)


def rng_state(device: torch.device | None) -> torch.Tensor | None:
    """The RNG state of the compute ``device`` alone (for checkpoints); None on the CPU (whose
    state is saved apart). One device's only: a run resumed on a machine with another number
    of GPUs restores it all the same."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def set_rng_state(device: torch.device | None, state: Any) -> None:
    """Restore what :func:`rng_state` captured. A checkpoint of an older layout holds a list
    (every GPU's state): its entry for this device is taken, when there is one."""
    if state is None or device is None or device.type != "cuda":
        return
    if isinstance(state, (list, tuple)):
        index = device.index or 0
        if index >= len(state):
            return
        state = state[index]
    torch.cuda.set_rng_state(state, device)


def distributed_backend(device: torch.device | str | None = None) -> str:
    """The torch.distributed backend for ``device`` (a device or a ``--device`` kind; default:
    this machine's): nccl on CUDA, ``simgloo`` on the simulated accelerator (``simdist.py``:
    its tensors through CPU copies over gloo, CPU tensors over gloo; registered now), else gloo."""
    kind = device.type if isinstance(device, torch.device) else (device or "auto")
    if kind == "sim":
        from .simdist import NAME, register

        register()
        return NAME
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    return "nccl" if kind == "cuda" else "gloo"


def use_local_device(local_rank: int) -> None:
    """Make GPU ``local_rank`` this process's current CUDA device (nothing without CUDA).

    Every rank on a machine otherwise lands on GPU 0: NCCL needs one GPU per rank, and the
    store's DEVICE tier (``Device()``) takes the current device. Called before the process
    group is made, so NCCL's communicator binds to the same GPU.

    Raises:
        RuntimeError: more ranks on this machine than GPUs.
    """
    if not cuda_available():
        return
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this machine has {count} GPU(s): "
                           f"launch at most {count} processes per node (torchrun --nproc-per-node {count})")
    torch.cuda.set_device(local_rank)
