"""Offload modes: where a run keeps the authoritative copy of its weights, gradients and
optimizer state (``--offload``, ``FinetuneConfig.offload``, :func:`~outcore.planner.plan.make_plan`).

The one list of their names; torch-free, so the config and the command line can name
them without importing torch.
"""
from __future__ import annotations

NONE = "none"  # everything on DEVICE (in memory); an error if it does not fit
AUTO = "auto"  # of the layouts that fit, the fastest, or within 10% of it the one writing least (planner/choice.py)
CPU = "cpu"  # streamed from HOST; DEVICE holds the prefetch window
NVME = "nvme"  # streamed from NVMe; HOST and DEVICE hold windows

OFFLOAD_MODES = (NONE, AUTO, CPU, NVME)
#: the modes that always stream units from an authoritative copy off DEVICE (``offload_model``)
STREAMED_MODES = (CPU, NVME)

#: the compute devices (``--device``, ``FinetuneConfig.device``; resolved by
#: ``device.resolve_device``): auto is the GPU when there is one; sim, the simulated
#: accelerator (``simdevice.py``), is for tests and dry runs
DEVICE_CHOICES = ("auto", "cuda", "cpu", "sim")

#: where an accelerator's out-of-core update runs (``--update-on``, ``FinetuneConfig.update_on``,
#: ``offload_model``): device (the state streams to it) or host (the state stays in HOST RAM
#: and the CPU updates it; gradients come down, updated weights go up). One path on a CPU.
UPDATE_ON = ("device", "host")
