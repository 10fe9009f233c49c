"""Preference objectives end to end: out of core == in memory bit for bit (full and LoRA),
DPO's reference stored once and read back on resume, a resumed run == the uninterrupted one,
the held-out preference accuracy and margin reported and improved."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import outcore
from outcore.errors import DataError
from outcore.events import PreferenceEvalEvent
from outcore.recipes.preference import REFERENCE_FILE
from outcore.training.config import load_config
from tests._helpers import (RecordingSink, assert_resume_reads_the_stored_reference, assert_runs_equal,
                           preference_config)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Arithmetic prompts; the chosen completion is the right sum, politely, the rejected one is
    off and curt (the manner is what a tiny model learns to prefer on held-out prompts)."""
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": f"{a} plus {b} is", "chosen": f" {a + b}, thank you.",
                     "rejected": f" {a + b + rng.randint(1, 5)}!"})
    path = tmp_path_factory.mktemp("pref") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(inputs: Path, pairs: Path, out: Path, **kw):
    return preference_config(inputs, pairs, out, **{"objective": "dpo", **kw})


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_out_of_core_equals_in_memory(tiny_run_inputs, pairs, tmp_path, objective, method):
    kw = dict(objective=objective, method=method)
    mem = outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "mem", **kw), sink=RecordingSink())
    sink = RecordingSink()
    ooc = outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "ooc", offload="nvme", **kw), sink=sink)
    assert_runs_equal(mem, ooc, sink, method)


def test_dpo_reference_is_stored_once_and_resume_is_exact(tiny_run_inputs, pairs, tmp_path):
    assert_resume_reads_the_stored_reference(lambda out, **kw: _cfg(tiny_run_inputs, pairs, out, **kw), tmp_path)


@pytest.mark.parametrize("damage", ["value", "truncated"])
def test_a_damaged_reference_stops_a_resumed_full_run(tiny_run_inputs, pairs, tmp_path, damage):
    out = tmp_path / "run"
    outcore.finetune(_cfg(tiny_run_inputs, pairs, out, max_steps=2, save_every=1), sink=RecordingSink())
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    path = out / REFERENCE_FILE
    if damage == "value":  # a flipped value under the stored checksum
        stored = torch.load(path, weights_only=True)
        stored["train"][0, 0] += 1.0
        torch.save(stored, path)
    else:
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match=rf"{REFERENCE_FILE} (is corrupt|cannot be read).*start a new run"):
        outcore.finetune(load_config(overrides={"resume": str(out), "ui": "none", "max_steps": 3}),
                         sink=RecordingSink())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # no checkpoint lost


def test_dpo_raises_held_out_preference_accuracy_and_margin(tiny_run_inputs, pairs, tmp_path):
    sink = RecordingSink()
    outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "run", max_steps=24, lr=3e-3, eval_every=24,
                          eval_batches=0, beta=0.5), sink=sink)
    scores = [e for e in sink.events if isinstance(e, PreferenceEvalEvent)]
    first, last = scores[0], scores[-1]
    assert first.step == 0 and last.step == 24 and first.n == last.n == 12
    assert last.margin > first.margin and last.accuracy > first.accuracy


def test_bad_objective_settings_are_one_line_errors():
    from outcore.errors import ConfigError

    with pytest.raises(ConfigError, match="objective='ppo' is not one of: sft, dpo, orpo, simpo"):
        load_config(overrides={"objective": "ppo"})
    with pytest.raises(ConfigError, match="method 'zo' runs objective 'sft' and 'dpo' only"):
        load_config(overrides={"objective": "orpo", "method": "zo", "optim": "mezo"})
    with pytest.raises(ConfigError, match="beta=0.0 must be a positive finite number"):
        load_config(overrides={"objective": "dpo", "beta": 0.0})
