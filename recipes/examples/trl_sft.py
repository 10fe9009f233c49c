"""TRL's SFTTrainer, trained out of core: the usual script, one line changed.

Fine-tunes the embedded default model (SmolLM2-135M-Instruct) on the embedded default data
(Shakespeare) with TRL's ``SFTTrainer``; ``out_of_core(SFTTrainer)`` in place of ``SFTTrainer``
streams its weights and AdamW state through the tiers (``--offload cpu|nvme``)::

    python -m outcore.recipes.examples.trl_sft --steps 20 --output runs/trl
    python -m outcore.recipes.examples.trl_sft --offload nvme --swap-dir /mnt/nvme/swap

Needs ``pip install 'outcore[trl]'`` (TRL and ``datasets``).
"""
from __future__ import annotations

import argparse
from typing import Sequence

from outcore.data import read_text_files, resolve_data_spec
from outcore.integrations import out_of_core
from outcore.models import load_model


def shakespeare_rows(max_rows: int, chars: int = 600) -> list[dict[str, str]]:
    """The default corpus cut into ``{"text": ...}`` rows of about ``chars`` characters (at line ends)."""
    rows, piece = [], ""
    for text in read_text_files(resolve_data_spec("default").files):
        for line in text.splitlines(keepends=True):
            piece += line
            if len(piece) >= chars:
                rows.append({"text": piece})
                piece = ""
                if len(rows) == max_rows:
                    return rows
    return rows


def main(argv: Sequence[str] | None = None):
    """Run the example; returns the trainer (trained, its model saved to ``--output``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output", default="runs/trl_sft")
    ap.add_argument("--offload", default="cpu", choices=["cpu", "nvme"])
    ap.add_argument("--swap-dir", default=None)
    ap.add_argument("--max-length", type=int, default=128)
    a = ap.parse_args(argv)

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = load_model("default")  # SmolLM2-135M-Instruct, fp32
    dataset = Dataset.from_list(shakespeare_rows(max_rows=8 * a.steps))
    config = SFTConfig(output_dir=a.output, max_steps=a.steps, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, learning_rate=1e-4, max_length=a.max_length,
                       logging_steps=1, save_steps=max(1, a.steps // 2), report_to="none",
                       # SFTConfig turns on bf16 autocast and gradient checkpointing; out of core the
                       # model computes in its own dtype and streams its blocks instead
                       bf16=False, gradient_checkpointing=False)
    trainer = out_of_core(SFTTrainer)(model=model, args=config, train_dataset=dataset,  # was: SFTTrainer(
                                      processing_class=tokenizer, offload=a.offload, swap_dir=a.swap_dir)
    trainer.train()
    trainer.save_model(a.output)
    trainer.close()
    return trainer


if __name__ == "__main__":
    main()
