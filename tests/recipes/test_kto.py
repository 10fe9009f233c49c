"""KTO end to end: out of core == in memory bit for bit (full and LoRA), its reference (both
rows of every example) stored once and read back on resume, a resumed run == the uninterrupted
one, the held-out reward accuracy, margin and KL reported, and the batches fixed in order."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import outcore
from outcore.events import PreferenceEvalEvent
from outcore.recipes.preference import REFERENCE_FILE
from outcore.training.config import load_config
from tests._helpers import (RecordingSink, assert_resume_reads_the_stored_reference, assert_runs_equal,
                           preference_config)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """Arithmetic prompts, each with one completion: the right sum, politely (desirable), or a
    wrong one, curtly (undesirable)."""
    rng = random.Random(0)
    rows = []
    for i in range(48):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        good = i % 3 != 0
        rows.append({"prompt": f"{a} plus {b} is", "label": good,
                     "completion": f" {a + b}, thank you." if good else f" {a + b + rng.randint(1, 5)}!"})
    path = tmp_path_factory.mktemp("kto") / "examples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(inputs: Path, data: Path, out: Path, **kw):
    return preference_config(inputs, data, out, **{"objective": "kto", **kw})


@pytest.mark.parametrize("method", ["full", "lora"])
def test_out_of_core_equals_in_memory(tiny_run_inputs, examples, tmp_path, method):
    kw = dict(method=method, desirable_weight=1.5)
    mem = outcore.finetune(_cfg(tiny_run_inputs, examples, tmp_path / "mem", **kw), sink=RecordingSink())
    sink = RecordingSink()
    ooc = outcore.finetune(_cfg(tiny_run_inputs, examples, tmp_path / "ooc", offload="nvme", **kw), sink=sink)
    assert_runs_equal(mem, ooc, sink, method)


def test_reference_is_stored_once_and_resume_is_exact(tiny_run_inputs, examples, tmp_path):
    cut = assert_resume_reads_the_stored_reference(
        lambda out, **kw: _cfg(tiny_run_inputs, examples, out, **kw), tmp_path)
    assert torch.load(cut / REFERENCE_FILE, weights_only=True)["train"].shape == (36, 2)  # completion and KL rows


def test_batches_are_the_runs_the_kl_rows_were_made_in(tiny_run_inputs, examples, tmp_path):
    """The loader visits the examples in order, so each batch's KL rows are its own completions
    rotated by one (TRL's sequential sampler), epoch after epoch."""
    from outcore.recipes.kto import KTOFinetune
    from outcore.training.lifecycle import Run

    run = Run(_cfg(tiny_run_inputs, examples, tmp_path / "run"), RecordingSink())
    recipe = KTOFinetune(run)
    recipe.setup()
    try:
        for _ in range(2 * recipe.loader.batches_per_epoch):
            batch = recipe.loader.next_batch()
            completions = [row[label != -100] for row, label in zip(batch["input_ids"], batch["labels"])]
            main, kl = completions[:4], completions[4:]
            assert all(torch.equal(kl[i], main[i - 1]) for i in range(4))
    finally:
        recipe.close(completed=False)


def test_kto_raises_held_out_reward_accuracy_and_margin(tiny_run_inputs, examples, tmp_path):
    sink = RecordingSink()
    outcore.finetune(_cfg(tiny_run_inputs, examples, tmp_path / "run", max_steps=24, lr=3e-3, eval_every=24,
                          eval_batches=0, beta=0.5), sink=sink)
    scores = [e for e in sink.events if isinstance(e, PreferenceEvalEvent)]
    first, last = scores[0], scores[-1]
    assert first.step == 0 and last.step == 24 and first.n == last.n == 12
    assert first.kl is not None and last.kl is not None and last.kl >= 0
    assert last.margin > first.margin and last.accuracy > first.accuracy


def test_bad_kto_settings_are_one_line_errors():
    from outcore.errors import ConfigError

    with pytest.raises(ConfigError, match="batch_size=1 has none; use batch_size >= 2"):
        load_config(overrides={"objective": "kto", "batch_size": 1})
    with pytest.raises(ConfigError, match="undesirable_weight=-1.0 must be a positive finite number"):
        load_config(overrides={"objective": "kto", "undesirable_weight": -1.0})
