"""Offloaded activations inside the out-of-core recipe (weights streamed from NVMe, the
engine's own saved-tensor hooks outside ours) give the in-memory run's losses bit for bit."""
from __future__ import annotations

import functools

import outcore.activations
import pytest
from outcore.training.config import load_config
from outcore.recipes.full_finetune import finetune
from tests._helpers import RecordingSink


def _cfg(inputs, out, **kw):
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=3, eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, offload="none")
    return load_config(overrides={**base, **kw})


@pytest.mark.slow(ci=True)
def test_offloaded_activations_in_out_of_core_run_equal_in_memory(tiny_run_inputs, tmp_path, monkeypatch,
                                                                   compute_device):
    on = compute_device.type  # every run computes there
    mem = finetune(_cfg(tiny_run_inputs, tmp_path / "mem", device=on), sink=RecordingSink())
    applied, stats = [], []
    real = outcore.activations.apply_activation_policy

    @functools.wraps(real)
    def tiny_threshold(*a, **kw):  # the tiny model's activations are all below the default size
        handle = real(*a, **{**kw, "min_bytes": 0})
        remove = handle.remove

        def remove_and_note():  # the recipe removes the policy at the end of the run
            stats.append(dict(handle.offloader.stats) if handle.offloader is not None else None)
            remove()
        handle.remove = remove_and_note
        applied.append(handle)
        return handle
    monkeypatch.setattr(outcore.activations, "apply_activation_policy", tiny_threshold)
    ooc = finetune(_cfg(tiny_run_inputs, tmp_path / "ooc", offload="nvme", activations="offload", device=on),
                   sink=RecordingSink())
    assert len(applied) == 1 and applied[0].offloader is None  # stopped by the recipe
    assert stats[0]["blocks"] > 0  # something really went to NVMe
    assert mem.losses == ooc.losses
    # activations_compress reaches the offloader: 8-bit bytes stored, the first step's loss
    # (its forward) unchanged, the later ones close (the backward saw 8-bit activations)
    int8 = finetune(_cfg(tiny_run_inputs, tmp_path / "int8", offload="nvme", activations="offload",
                         activations_compress="int8", device=on), sink=RecordingSink())
    assert 0 < stats[1]["offloaded_bytes"] < 0.4 * stats[1]["raw_bytes"]  # fp32: ~0.3
    assert int8.losses[0] == mem.losses[0] and int8.losses != mem.losses
    assert int8.losses == pytest.approx(mem.losses, rel=1e-3)
