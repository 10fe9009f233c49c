"""A new training method is one recipe and one entry in ``outcore.methods.METHODS``
(docs/architecture.md §12, "A training method"): a toy method registered here is checked
by the config, sized by the planner and run end to end by ``outcore.finetune``, in the run
lifecycle every method gets (events, metrics, checkpoints, export, resume)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import outcore
from outcore import methods
from outcore.methods import Method, MethodTraits
from outcore.recipes.export import export_hf
from outcore.training import checkpoint as ckpt
from outcore.training.config import load_config
from outcore.training.lifecycle import Built, Evaluation, Run, Stepped
from outcore.training.loss import mean_eval_loss


class PlainSGD:
    """The toy method's recipe: every weight, plain SGD, in memory."""

    def __init__(self, run: Run) -> None:
        self.run, self.cfg = run, run.cfg

    def setup(self) -> Built:
        from outcore.data import BatchLoader, build_datasets
        from outcore.models import load_model

        cfg = self.cfg
        self.model, self.tokenizer = load_model(cfg.model)
        train, self.val = build_datasets(cfg.data, self.tokenizer, cfg.seq_len, seed=cfg.seed,
                                         val_fraction=cfg.val_fraction)
        self.loader = BatchLoader(train, cfg.batch_size, seed=cfg.seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
        state = {"step": None, "base_eval_loss": None}
        if cfg.resume:
            _, (weights, optim_state, state), _ = ckpt.load_newest_valid(self.run.out)
            self.model.load_state_dict(weights, strict=False)
            self.optimizer.load_state_dict(optim_state)
            self.loader.load_state_dict(state["loader"])
        n = sum(p.numel() for p in self.model.parameters())
        return Built(n, n, tokens_per_step=cfg.batch_size * cfg.seq_len, checkpoint_step=state["step"],
                     base_eval_loss=state["base_eval_loss"])

    def step(self, lr: float) -> Stepped:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.model(**self.loader.next_batch()).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return Stepped(loss.detach())

    def evaluate(self, step: int) -> Evaluation:
        with torch.no_grad():
            return Evaluation(mean_eval_loss(lambda b: self.model(**b).loss, self.val, self.cfg.batch_size, 2))

    def save(self) -> None:
        state = {"step": self.run.step, "loader": self.loader.state_dict(), "base_eval_loss": self.run.base_eval_loss}
        ckpt.save_checkpoint(self.run.out, self.run.step, ckpt.trainable_state(self.model),
                             self.optimizer.state_dict(), state)

    def export(self, out_dir: Path) -> Path:
        return export_hf(self.model, self.tokenizer, out_dir)

    def close(self, completed: bool) -> None:
        """Nothing outside the model and optimizer, which go with the recipe."""


@pytest.fixture
def toy(monkeypatch):
    """The one entry a new method adds (its recipe here, in this test module)."""
    traits = MethodTraits(trains_weights=True, backward=True, quantized_base=False, compute_passes=3.0)
    monkeypatch.setitem(methods.METHODS, "toy", Method(f"{__name__}:PlainSGD", traits))
    return "toy"


def _overrides(inputs: Path, out: Path, **kw) -> dict:
    return {**dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                   max_steps=3, eval_every=2, save_every=2, lr=1e-2, output=str(out), ui="none",
                   val_fraction=0.1, offload="none", threads=1), **kw}


def test_a_registered_method_runs_end_to_end_in_the_lifecycle(toy, tiny_run_inputs, tmp_path):
    result = outcore.finetune(**_overrides(tiny_run_inputs, tmp_path / "run", method=toy))
    out = Path(result.output_dir)
    assert result.steps_done == 3 and len(result.losses) == 3 and result.final_eval_loss < result.base_eval_loss
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval_loss" in rows[1]
    assert sorted(c.name for c in ckpt.checkpoints(out)) == ["step_000002", "step_000003"]
    assert (out / "final" / "config.json").is_file() and not (out / "final.tmp").exists()

    resumed = outcore.finetune(**_overrides(tiny_run_inputs, tmp_path / "run", method=toy, max_steps=4),
                               resume=str(out))
    assert resumed.steps_done == 4 and resumed.base_eval_loss == result.base_eval_loss


def test_the_config_and_the_planner_read_the_registry(toy, tiny_llama):
    from outcore.planner import Budgets, make_plan

    cfg = load_config(method=toy, optim="adamw")
    assert not (cfg.uses_adapters or cfg.zeroth_order or cfg.quantizes_base)  # from its traits
    big = Budgets(device_bytes=1 << 36, host_bytes=1 << 36, nvme_bytes=1 << 40, ram_bytes=1 << 36,
                  disk_read_gbps=2.0, disk_write_gbps=3.0, h2d_gbps=8.0, d2h_gbps=8.0, host_mem_gbps=8.0,
                  flops=1e11, measured=True)
    plan = make_plan(tiny_llama, method=toy, offload="none", seq_len=32, budgets=big)
    full = make_plan(tiny_llama, method="full", offload="none", seq_len=32, budgets=big)
    assert plan.tier_bytes == full.tier_bytes  # the traits of full: the same bytes
    with pytest.raises(outcore.errors.ConfigError, match="method='nope' is not one of: full, lora, qlora, zo, toy"):
        load_config(method="nope")
