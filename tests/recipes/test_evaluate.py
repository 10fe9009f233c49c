"""Evaluation scores against references: a plain transformers forward, and lm-evaluation-harness.

Perplexity is exp(mean token NLL) of the held-out split; each choice's log-likelihood is
the sum of log p(token) of its continuation; acc / acc_norm are the harness's. In memory
and streamed from NVMe through the tiers the numbers are the same.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from outcore.data.tasks import load_task
from outcore.recipes.evaluate import (TARGET_DELIMITER, StreamedModel, encode_pair, evaluate_model,
                                      evaluation_config, loglikelihoods, score_task)
from outcore.training.loss import CausalLMScorer

TASK_ITEMS = 12  # of the shipped Shakespeare task: enough for several right and wrong answers


def _requests(task):
    return [(i.query, TARGET_DELIMITER + c) for i in task.items for c in i.choices]


def _reference_loglikelihood(model, tok, context, continuation):
    """One request, unbatched: sum of log-softmax at the continuation's tokens of a plain HF forward."""
    ctx, cont = encode_pair(tok, context, continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    n = len(ctx)
    return sum(float(logp[n + j - 1, t]) for j, t in enumerate(cont))


@pytest.fixture(scope="module")
def tiny(tiny_run_inputs):
    from outcore.models import load_model

    model, tok = load_model(str(tiny_run_inputs / "model"))
    return model.eval(), tok


def test_encode_pair_moves_trailing_space_to_the_continuation(tiny):
    _, tok = tiny
    assert encode_pair(tok, "To be, or not ", "to be") == encode_pair(tok, "To be, or not", " to be")
    ctx, cont = encode_pair(tok, "", "hello")
    assert ctx == [tok.bos_token_id] and cont == tok.encode("hello", add_special_tokens=False)


def test_loglikelihoods_equal_a_plain_transformers_forward(tiny):
    model, tok = tiny
    reqs = _requests(load_task("shakespeare", limit=TASK_ITEMS))
    ours = loglikelihoods(CausalLMScorer(model), tok, reqs, max_tokens=64)  # several padded batches
    ref = [_reference_loglikelihood(model, tok, c, x) for c, x in reqs]
    assert ours == pytest.approx(ref, abs=1e-4)
    assert len(set(round(v, 3) for v in ours)) > len(ours) // 2  # distinct scores: a real comparison


def test_scores_equal_lm_evaluation_harness(tiny, tmp_path, monkeypatch):
    """The harness's own HFLM log-likelihoods and its multiple-choice acc / acc_norm, on the same items."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))  # the local file's cache: not ~
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.api.instance import Instance
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    task = load_task("shakespeare", limit=TASK_ITEMS)
    reqs = _requests(task)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")
    theirs = [ll for ll, _ in lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(reqs)],
        disable_tqdm=True)]
    ours = loglikelihoods(CausalLMScorer(model), tok, reqs)
    assert ours == pytest.approx(theirs, abs=1e-4)

    harness_task = ConfigurableTask(config={
        "task": "shakespeare_mc", "dataset_path": "json", "output_type": "multiple_choice",
        "dataset_kwargs": {"data_files": {"test": str(task.path)}}, "test_split": "test",
        "doc_to_text": "{{query}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}"})
    docs = list(harness_task.test_docs())[:TASK_ITEMS]
    assert [harness_task.doc_to_text(d) + harness_task.config.target_delimiter + harness_task.doc_to_choice(d)[0]
            for d in docs] == [reqs[4 * k][0] + reqs[4 * k][1] for k in range(TASK_ITEMS)]
    it = iter(theirs)
    results = [harness_task.process_results(d, [(next(it), False) for _ in d["choices"]]) for d in docs]
    score = score_task(CausalLMScorer(model), tok, task)
    assert score.n == TASK_ITEMS
    assert score.acc == pytest.approx(sum(r["acc"] for r in results) / TASK_ITEMS)
    assert score.acc_norm == pytest.approx(sum(r["acc_norm"] for r in results) / TASK_ITEMS)


def _on(model, device):
    """``model`` in memory on ``device`` (a copy off the CPU: the module's fixture stays there)."""
    import copy

    return model if device.type == "cpu" else copy.deepcopy(model).to(device)


def _plain_perplexity(model, tok, cfg):
    """exp(mean token NLL) of the held-out split by the model's own forward (HF's loss, no outcore head)."""
    from outcore.data import build_datasets, eval_batches
    from outcore.offload.device import to_device

    _, val = build_datasets(cfg.data, tok, cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction)
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(val, cfg.batch_size, cfg.eval_batches):
            batch = to_device(batch, next(model.parameters()).device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            nll = F.cross_entropy(logits[:, :-1].transpose(1, 2).double(), batch["labels"][:, 1:], reduction="sum")
            total += float(nll)
            n += int((batch["labels"][:, 1:] != -100).sum())
    return math.exp(total / n), n


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_perplexity_and_task_in_memory_and_streamed(tiny, tiny_run_inputs, tmp_path, offload, compute_device):
    model, tok = tiny
    model = _on(model, compute_device)  # the references compute where the evaluation does
    cfg = evaluation_config(str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                            val_fraction=0.1, eval_batches=3, eval_task="shakespeare", offload=offload,
                            swap_dir=str(tmp_path / "swap") if offload == "nvme" else None,
                            device=compute_device.type)
    report = evaluate_model(cfg)
    ppl, n = _plain_perplexity(model, tok, cfg)
    assert report.offload == offload and report.eval_tokens == n
    assert report.perplexity == pytest.approx(ppl, rel=1e-5)
    ref = score_task(CausalLMScorer(model), tok, load_task("shakespeare"))
    assert report.task.n == 40
    assert (report.task.acc, report.task.acc_norm) == (ref.acc, ref.acc_norm)
    if offload == "nvme":
        assert not (tmp_path / "swap").exists()  # the swap directory is removed when scoring ends


def test_streamed_loglikelihoods_equal_in_memory(tiny, tiny_run_inputs, tmp_path, compute_device):
    """Out of core (weights read from NVMe unit by unit) the log-likelihoods are the in-memory ones
    (on the same device)."""
    from outcore.models import load_model_lazily

    model, tok = tiny
    model = _on(model, compute_device)
    reqs = _requests(load_task("shakespeare", limit=TASK_ITEMS))
    lazy, _, fill = load_model_lazily(str(tiny_run_inputs / "model"))
    cfg = evaluation_config(str(tiny_run_inputs / "model"), offload="nvme", swap_dir=str(tmp_path / "swap"),
                            device=compute_device.type)
    streamed = StreamedModel(lazy.eval(), cfg, fill)
    try:
        ours = loglikelihoods(streamed.scorer, tok, reqs, max_tokens=64)
        assert streamed.engine.tier_stats()["NVME"].read_bytes > 0  # it did stream
    finally:
        streamed.close()
    assert ours == loglikelihoods(CausalLMScorer(model), tok, reqs, max_tokens=64)


def test_evaluation_config_of_a_run(tmp_path):
    """A run directory: its final/ model with the run's data and split; any method (zo too) may take a task."""
    from outcore.errors import CheckpointError
    from outcore.training.config import FinetuneConfig, save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(FinetuneConfig(method="zo", optim="mezo", data="notes.txt", seq_len=64, seed=3), run / "config.yaml")
    with pytest.raises(CheckpointError, match=r"has no final/ model; run 'outcore export"):
        evaluation_config(str(run))
    (run / "final").mkdir()
    cfg = evaluation_config(str(run), eval_task="shakespeare", batch_size=None)
    assert (cfg.model, cfg.data, cfg.seq_len, cfg.seed) == (str(run / "final"), "notes.txt", 64, 3)
    assert cfg.eval_task == "shakespeare" and cfg.offload == "none"  # evaluation runs in memory unless asked
