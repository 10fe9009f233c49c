"""Plain helpers the tests of several folders share (fixtures live in ``tests/conftest.py``).

Import them as ``from tests._helpers import ...`` from any test folder: pytest
(``--import-mode=importlib``, rootdir = the repository root) registers ``tests`` as a package,
so the import does not depend on where the importing file sits.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

#: the repository root, which is the package ``outcore`` (scripts/, pyproject.toml, tests/ ...)
ROOT = Path(__file__).resolve().parents[1]


def needs_cpu_extension(isa: str | None = None):
    """The CPU kernels' C++ extension at ``isa`` (default: the CPU's level); the calling test is
    skipped where it cannot be built (no compiler, ``OUTCORE_NO_CPP_EXT=1``)."""
    import pytest

    from outcore.kernels.cpu_ext import cpu_extension

    ext = cpu_extension(isa)
    if ext is None:
        pytest.skip("the C++ extension cannot be built here")
    return ext


def load_module(path, name: str | None = None):
    """The Python file at ``path`` executed as a new module named ``name`` (default: the file's
    stem), not entered in ``sys.modules``: for files outside any package (``scripts/``) or
    another folder's helpers."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def causal_lm_loss(model, ids):
    """The causal LM's mean next-token loss on ``ids`` (labels = the inputs), as the engine's
    ``train_step(loss_fn, ...)`` calls it: ``loss_fn(model, batch)``."""
    return model(input_ids=ids, labels=ids).loss


def reference_step(model, opt, micro, clip):
    """One in-memory training step, the reference the out-of-core engine must equal bit for bit.

    On the model's device (the batches are moved there, as the engine moves them): each
    micro-batch's loss divided by their number and backpropagated, the gradients clipped to
    ``clip`` by their global norm (0: not clipped), one optimizer step. Returns the summed
    (scaled) losses, detached — what ``train_step`` returns.
    """
    import torch

    device, total = next(model.parameters()).device, None
    for ids in micro:
        loss = causal_lm_loss(model, ids.to(device)) / len(micro)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


class RecordingSink:
    """An event sink that keeps every event (``events``) and notes ``close`` (``closed``); with
    ``interrupt_at`` it raises Ctrl-C (KeyboardInterrupt) after that step's StepEvent."""

    def __init__(self, interrupt_at: int | None = None):
        self.events, self.interrupt_at, self.closed = [], interrupt_at, False

    def emit(self, event):
        self.events.append(event)
        if self.interrupt_at is not None and type(event).__name__ == "StepEvent" \
                and event.step == self.interrupt_at:
            raise KeyboardInterrupt

    def close(self):
        self.closed = True


def exported_weights(folder) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (an exported model: one file
    in memory, one shard per unit out of core), by name."""
    from safetensors.torch import load_file

    return {k: t for f in sorted(Path(folder).glob("*.safetensors")) for k, t in load_file(str(f)).items()}


def assert_runs_equal(mem, ooc, sink, method: str) -> None:
    """An out-of-core run equals its in-memory twin: step losses, final eval loss and exported
    weights (bit for bit; LoRA's within 1e-6, its adapters merged into the base in another
    order), and its last step read from NVMe (``sink``: the out-of-core run's RecordingSink)."""
    import torch

    assert mem.losses == ooc.losses and mem.final_eval_loss == ooc.final_eval_loss
    a, b = exported_weights(mem.output_dir / "final"), exported_weights(ooc.output_dir / "final")
    assert a.keys() == b.keys()
    for k, t in a.items():
        if method == "full":
            assert torch.equal(t, b[k]), k
        else:
            torch.testing.assert_close(b[k], t, rtol=0, atol=1e-6, msg=k)
    assert [e for e in sink.events if type(e).__name__ == "StepEvent"][-1].tiers["NVME"].read_bytes > 0


def preference_config(inputs: Path, data: Path, out: Path, objective: str, **kw):
    """The preference recipes' tests' run: the tiny model of ``tiny_run_inputs`` (``inputs``) on
    a JSONL of 48 rows (``data``), 3 steps of 4 rows in memory; ``kw`` overrides any key."""
    from outcore.training.config import load_config

    base = dict(model=str(inputs / "model"), data=str(data), objective=objective, seq_len=24, batch_size=4,
                max_steps=3, eval_every=0, eval_batches=2, lr=1e-3, warmup_steps=1, output=str(out), ui="none",
                val_fraction=0.25, offload="none")
    return load_config(overrides={**base, **kw})


def assert_resume_reads_the_stored_reference(config, tmp_path: Path) -> Path:
    """A run out of core cut at step 3 and resumed equals the uninterrupted one (last losses,
    exported weights), its stored reference read back, not recomputed from trained weights.

    Args:
        config: ``config(out, **kw)``, the run's config writing to ``out``.

    Returns:
        the cut run's output folder.
    """
    import pytest
    import torch

    import outcore
    from outcore.recipes.preference import REFERENCE_FILE
    from outcore.training.config import load_config

    kw = dict(offload="nvme", max_steps=4, save_every=2)
    whole = outcore.finetune(config(tmp_path / "whole", **kw), sink=RecordingSink())
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        outcore.finetune(config(cut, **kw), sink=RecordingSink(interrupt_at=3))
    stored = (cut / REFERENCE_FILE).read_bytes()
    resumed = outcore.finetune(load_config(overrides={"resume": str(cut), "ui": "none"}), sink=RecordingSink())
    assert resumed.losses[-2:] == whole.losses[-2:]
    assert (cut / REFERENCE_FILE).read_bytes() == stored
    a, b = exported_weights(whole.output_dir / "final"), exported_weights(resumed.output_dir / "final")
    assert all(torch.equal(t, b[k]) for k, t in a.items())
    return cut


def policy_and_reference(vocab: int):
    """A tiny Llama reference and a policy that differs from it by seeded noise (equal models
    would make every preference loss its constant, e.g. DPO's log 2)."""
    import copy

    import torch

    from tests.conftest import make_tiny_llama

    ref = make_tiny_llama(vocab=vocab, seed=1)
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy, ref
