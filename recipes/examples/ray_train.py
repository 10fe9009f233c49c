"""Ray Train's ``TorchTrainer`` running ``outcore.finetune`` on N workers, data parallel.

Ray starts the workers (on one machine or a Ray cluster), sets their ranks and joins them in
one ``torch.distributed`` process group; ``outcore.finetune`` finds that group and runs as it
does under ``torchrun`` (``training/distributed/across_ranks.py``): every worker trains on its
share of each step's micro-batches, rank 0 writes ``config.yaml``, the checkpoints' commit and
``final/``, every rank its metrics file. The output directory must be one file system every worker sees
(an NFS mount, or one machine)::

    pip install 'ray[train]'
    python -m outcore.recipes.examples.ray_train --workers 2 --output /shared/runs/ray \\
        --model ./my-llama --data notes.jsonl max_steps=200 offload=none

Any ``key=value`` is a config key of ``outcore finetune``. Untested here: ray is not
installed on outcore's test machines (the same code path runs under ``torchrun`` there).
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from outcore.errors import ConfigError


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray worker: the outcore run (in Ray's process group), its result reported to Ray."""
    from ray import train

    import outcore

    result = outcore.finetune(**config)
    # every worker reports (Ray waits for all); the final eval loss is the same on each
    train.report({"steps": result.steps_done, "final_eval_loss": result.final_eval_loss})


def main(argv: Sequence[str] | None = None) -> Any:
    """Run the example; returns Ray's ``Result``.

    Raises:
        ConfigError: ray is not installed, or a bad ``key=value``.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="Ray workers (ranks)")
    ap.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL)")
    ap.add_argument("--output", default="runs/ray_train", help="output directory every worker can reach")
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", default="default")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="outcore finetune config keys")
    args = ap.parse_args(argv)
    try:
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        raise ConfigError("ray is not installed; pip install 'ray[train]' to run this example") from None
    from outcore.training.config import load_config

    cfg = load_config(overrides=[*args.overrides, f"model={args.model}", f"data={args.data}",
                                 f"output={args.output}", "ui=plain"])  # checked before Ray starts
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config=cfg.to_dict(),
                           scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu))
    return trainer.fit()


if __name__ == "__main__":
    main()
