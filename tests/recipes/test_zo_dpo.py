"""DPO with zeroth-order training: in memory == streamed from NVMe bit for bit, the head's DPO
loss == the first-order DPO loss of the exported model against the stored reference, a resumed
run == the uninterrupted one with the reference read back, and the held-out loss going down."""
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
from tests._helpers import RecordingSink, exported_weights


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(40):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": f"{a} plus {b} is", "chosen": f" {a + b}, thank you.",
                     "rejected": f" {a + b + rng.randint(1, 5)}!"})
    path = tmp_path_factory.mktemp("zo_dpo") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(inputs: Path, pairs: Path, out: Path, **kw):
    base = dict(model=str(inputs / "model"), data=str(pairs), objective="dpo", method="zo", optim="mezo",
                seq_len=24, batch_size=4, max_steps=4, eval_every=0, eval_batches=0, lr=1e-3, warmup_steps=1,
                output=str(out), ui="none", val_fraction=0.2, offload="none", beta=0.5, threads=1,
                optim_args={"eps": 1e-2, "n_samples": 2})
    return load_config(overrides={**base, **kw})


def test_out_of_core_equals_in_memory_and_the_loss_is_dpo(tiny_run_inputs, pairs, tmp_path):
    from outcore.data import build_preference_datasets, eval_batches
    from outcore.models import load_model
    from outcore.training.loss import CausalLMScorer, dpo_loss, sequence_logps

    mem = outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "mem"), sink=RecordingSink())
    ooc = outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "ooc", offload="nvme"), sink=RecordingSink())
    assert mem.steps_done == ooc.steps_done == 4
    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    a, b = exported_weights(mem.final_dir), exported_weights(ooc.final_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "mem" / REFERENCE_FILE).read_bytes() == (tmp_path / "ooc" / REFERENCE_FILE).read_bytes()

    # the final held-out loss, by the first-order path: the exported model's log-probabilities
    # (CausalLMScorer) against the stored reference, through dpo_loss
    model, tok = load_model(str(mem.final_dir))
    _, val = build_preference_datasets(pairs, tok, seq_len=24, val_fraction=0.2)
    ref = torch.load(tmp_path / "mem" / REFERENCE_FILE, weights_only=True)["val"]
    with torch.no_grad():
        batch = next(eval_batches(val, len(val)))
        logps = sequence_logps(CausalLMScorer(model).token_nll(batch), batch["labels"])
    chosen, rejected = logps.chunk(2)
    by_hand = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=0.5)[0]
    assert abs(float(by_hand) - mem.final_eval_loss) < 1e-6
    assert abs(mem.final_eval_loss - 0.6931) > 1e-4  # the weights moved off the reference


def test_resume_equals_uninterrupted_and_reads_the_reference_back(tiny_run_inputs, pairs, tmp_path):
    whole = outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "whole"), sink=RecordingSink())
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        outcore.finetune(_cfg(tiny_run_inputs, pairs, cut), sink=RecordingSink(interrupt_at=3))
    stored = (cut / REFERENCE_FILE).read_bytes()
    resumed = outcore.finetune(load_config(overrides={"resume": str(cut), "ui": "none"}), sink=RecordingSink())
    assert resumed.steps_done == 4 and resumed.losses[-1] == whole.losses[-1]
    assert (cut / REFERENCE_FILE).read_bytes() == stored
    a, b = exported_weights(whole.final_dir), exported_weights(resumed.final_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_zo_dpo_lowers_the_held_out_loss(tiny_run_inputs, pairs, tmp_path):
    sink = RecordingSink()
    outcore.finetune(_cfg(tiny_run_inputs, pairs, tmp_path / "run", max_steps=30, eval_every=30, lr=5e-3,
                          optim_args={"eps": 1e-3, "n_samples": 4}), sink=sink)
    scores = [e for e in sink.events if isinstance(e, PreferenceEvalEvent)]
    losses = [e.eval_loss for e in sink.events if type(e).__name__ == "EvalEvent"]
    assert scores[0].step == 0 and scores[-1].step == 30 and scores[0].n == 8
    assert losses[-1] < losses[0] and scores[-1].margin > scores[0].margin
    assert scores[-1].accuracy > scores[0].accuracy
