"""The peer for scripts/bench_step.py: DeepSpeed ZeRO-3 with NVMe / CPU offload on one process.

Run exactly as BENCHMARKING.md records it: ``DS_ACCELERATOR=cpu``, a one-rank
gloo process group, ``deepspeed.initialize`` with ZeRO stage 3,
``offload_param`` and ``offload_optimizer`` on ``nvme`` (or ``cpu``),
``pin_memory`` off, parameter buffers 5 x 1e8 with ``max_in_cpu`` 1e9,
persistence threshold 0, sub-group size 1e8, aio 1 MiB blocks / queue depth 8 /
one thread / overlapped events, its CPU AdamW, fp32. Its first use JIT-compiles
the aio and CPU-Adam ops (minutes); the benchmark's warm-up steps come after that.

Install: ``apt-get install -y libaio-dev`` and ``DS_BUILD_OPS=0 pip install deepspeed``
(keep torch pinned: ``--no-deps`` plus hjson, msgpack, ninja, einops, py-cpuinfo, pydantic).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_config(device: str, nvme_path: str, batch: int, lr: float, betas: tuple[float, float],
                     eps: float, weight_decay: float) -> dict[str, Any]:
    """The peer's config (ZeRO-3, fp32, DeepSpeed's CPU AdamW).

    Args:
        device: ``"nvme"`` or ``"cpu"`` for both offloads.
        nvme_path: the swap directory (used when ``device == "nvme"``).
        batch: micro-batch size.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (the same as the other modes).

    Returns:
        The DeepSpeed config dict.
    """
    if device not in ("nvme", "cpu"):
        raise ValueError(f"device={device!r} must be 'nvme' or 'cpu'")
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_param": {"device": device, "pin_memory": False},
        "offload_optimizer": {"device": device, "pin_memory": False},
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": int(1e8),
    }
    if device == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, buffer_count=5, buffer_size=int(1e8),
                                     max_in_cpu=int(1e9))
        zero["offload_optimizer"].update(nvme_path=nvme_path)
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                   "weight_decay": weight_decay}},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(model, device: str, *, batch: int, swap_dir: str, hyper: dict[str, Any]
                    ) -> str | tuple[Callable[[Any], float], Callable[[], None]]:
    """Wrap ``model`` in DeepSpeed ZeRO-3 with both offloads on ``device``.

    Args:
        model: the fp32 HF model (DeepSpeed partitions it in ``initialize``).
        device: ``"nvme"`` or ``"cpu"``.
        batch: micro-batch size.
        swap_dir: where the NVMe swap directory is created (removed by ``close``).
        hyper: ``lr``, ``betas``, ``eps``, ``weight_decay``.

    Returns:
        ``(step, close)``: ``step(ids [batch, seq]) -> loss`` runs one optimizer step;
        ``close()`` removes the swap directory. Or a string saying why DeepSpeed cannot run.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return ("deepspeed is not installed "
                "(DS_BUILD_OPS=0 pip install deepspeed; apt-get install libaio-dev)")
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    import deepspeed

    swap = tempfile.mkdtemp(prefix=f"bench_ds_{device}_", dir=swap_dir)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=deepspeed_config(device, swap, batch, **hyper))
    except BaseException:
        shutil.rmtree(swap, ignore_errors=True)
        raise

    def step(ids):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        return float(out.loss.detach())  # a host read: the step is finished when it returns

    return step, lambda: shutil.rmtree(swap, ignore_errors=True)
