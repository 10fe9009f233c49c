"""Evaluate a causal LM: held-out perplexity on text data, accuracy on a labelled task.

Both go through one :class:`CausalLMScorer` (``training/loss.py``), the same forward the
training loop's loss takes (the decoder, then the LM head and cross-entropy in chunks, never the whole
``[tokens, vocab]`` logits), so it runs unchanged on a model in memory or on one whose
weights stream through the tiers (the out-of-core engine's module hooks bring each
unit in as the forward reaches it, exactly as in the finetune eval pass).

Task scoring is lm-evaluation-harness's ``loglikelihood`` for multiple choice: each
choice is the continuation ``" " + choice`` of the query; trailing spaces of the context
move to the continuation and the continuation's tokens are those of
``encode(context + continuation)`` after ``encode(context)``, no special tokens;
``acc`` picks the choice of highest log-likelihood, ``acc_norm`` the highest
log-likelihood per character of the choice (``tests/recipes/test_evaluate.py`` checks
the numbers equal the harness's own ``HFLM``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from .. import events
from ..data.tasks import Task
from ..errors import ConfigError
from ..offload.device import resolve_device
from ..training.loss import CausalLMScorer, mean_eval_loss


TARGET_DELIMITER = " "  # between the query and each choice, as the harness's default


# ------------------------------------------------------------------ log-likelihoods
def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``context`` and of ``continuation`` after it, as the harness splits them.

    Args:
        tokenizer: a Hugging Face tokenizer.
        context, continuation: the two strings (the continuation is what is scored).

    Returns:
        ``(context_ids, continuation_ids)``; an empty context becomes the BOS (else EOS) token.
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:  # "a question? " + "answer" scores " answer": the space belongs to the continuation
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], tokenizer.encode(continuation, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_context = len(tokenizer.encode(context, add_special_tokens=False))
    return whole[:n_context], whole[n_context:]


@torch.no_grad()
def loglikelihoods(scorer: CausalLMScorer, tokenizer: Any, requests: Sequence[tuple[str, str]],
                   max_tokens: int = 512, max_len: int | None = None) -> list[float]:
    """log p(continuation | context) of each ``(context, continuation)`` request.

    Requests are batched longest first, each batch at most ``max_tokens`` tokens
    (rows × longest row): out of core every batch streams the whole model once.

    Args:
        scorer: the model's scorer.
        tokenizer: its tokenizer.
        requests: ``(context, continuation)`` string pairs.
        max_tokens: tokens per batch (at least one request per batch).
        max_len: keep the last ``max_len`` tokens of a longer request (the harness's
            left truncation); None = the model's ``max_position_embeddings``.

    Returns:
        The log-likelihoods (natural log), in request order.
    """
    if max_len is None:
        max_len = getattr(scorer.model.config, "max_position_embeddings", None) or 2048
    rows = []
    for context, continuation in requests:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        ids = (ctx + cont)[-max_len:]
        rows.append((ids, min(len(cont), len(ids) - 1)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out = [0.0] * len(rows)
    start = 0
    while start < len(order):
        width = len(rows[order[start]][0])
        end = start + max(1, max_tokens // max(width, 1))
        batch_idx = order[start:end]
        nll = scorer.token_nll(_pad_batch([rows[i] for i in batch_idx], width, tokenizer))
        for b, i in enumerate(batch_idx):
            out[i] = -float(nll[b].double().sum())  # host sync: once per batch
        start = end
    return out


def _pad_batch(rows: list[tuple[list[int], int]], width: int, tokenizer: Any) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask, and labels only on each row's last ``n_cont`` tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (row, n_cont) in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        mask[b, :len(row)] = 1
        labels[b, len(row) - n_cont:len(row)] = ids[b, len(row) - n_cont:len(row)]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ------------------------------------------------------------------ task accuracy
@dataclass
class TaskScore:
    """Accuracy on a task, as lm-evaluation-harness reports a multiple-choice task."""

    task: str
    n: int  # examples scored
    acc: float  # share whose highest log-likelihood choice is the gold one
    acc_stderr: float  # standard error of the mean (the harness's: sample std / sqrt(n))
    acc_norm: float  # the same with log-likelihood divided by the choice's length in characters
    acc_norm_stderr: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def score_task(scorer: CausalLMScorer, tokenizer: Any, task: Task, max_tokens: int = 512) -> TaskScore:
    """Score every choice of every example of ``task`` and count the right answers.

    Args:
        scorer, tokenizer: the model.
        task: the examples (``outcore.data.tasks.load_task``).
        max_tokens: tokens per forward batch.

    Returns:
        The TaskScore.
    """
    requests = [(item.query, TARGET_DELIMITER + choice) for item in task.items for choice in item.choices]
    lls = iter(loglikelihoods(scorer, tokenizer, requests, max_tokens))
    hits, hits_norm = [], []
    for item in task.items:
        ll = [next(lls) for _ in item.choices]
        per_char = [v / len(c) for v, c in zip(ll, item.choices)]
        hits.append(float(_argmax(ll) == item.gold))
        hits_norm.append(float(_argmax(per_char) == item.gold))
    return TaskScore(task.name, len(hits), _mean(hits), _stderr(hits), _mean(hits_norm), _stderr(hits_norm))


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first, as numpy's


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _stderr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


# ------------------------------------------------------------------ a model or a run, end to end
@dataclass
class EvalReport:
    """What ``outcore eval`` measured."""

    model: str  # the model evaluated (a run's final/ directory for a run)
    offload: str  # none (in memory), cpu or nvme (streamed through the tiers)
    data: str | None = None  # the text data whose held-out split gave the perplexity
    eval_loss: float | None = None  # mean next-token loss over the held-out tokens
    perplexity: float | None = None  # exp(eval_loss)
    eval_tokens: int = 0  # labelled tokens the loss averages
    task: TaskScore | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``outcore eval --json``)."""
        return asdict(self)


def evaluation_config(model: str, **overrides: Any):
    """The FinetuneConfig that says what to evaluate: a run's own, or the defaults, with ``overrides``.

    ``model`` may be a run's output directory (it holds ``config.yaml``): its ``final/``
    model is evaluated on the run's data, split, sequence length, batch size and task,
    so the perplexity reproduces the run's final eval loss.

    Args:
        model: a model spec (as ``--model``) or a run directory.
        **overrides: config keys (None values are ignored): ``data``, ``seq_len``, ``eval_task`` ...

    Returns:
        The validated config (``model`` names the directory to load).

    Raises:
        ConfigError: a bad key or value. CheckpointError: a run without ``final/``.
    """
    from pathlib import Path

    from ..errors import CheckpointError
    from ..training.config import load_config

    given = {k: v for k, v in overrides.items() if v is not None}
    # in memory unless asked: a run's own offload setting was for training, with optimizer state
    given.setdefault("offload", "none")
    run = Path(model)
    if not (run / "config.yaml").is_file():
        return load_config(None, None, model=model, **given)
    if not (run / "final").is_dir():
        raise CheckpointError(f"run {model!r} has no final/ model; run 'outcore export {model}' and "
                              f"evaluate {str(run / 'export')!r}")
    # nothing trains here: the run's method (a zo run's, which takes no eval_task) does not apply
    return load_config(run / "config.yaml", None, model=str(run / "final"), resume=None, overwrite=True,
                       method="full", optim="adamw", **given)


def evaluate_model(cfg: Any, *, perplexity: bool = True) -> EvalReport:
    """Held-out perplexity on ``cfg.data`` and accuracy on ``cfg.eval_task`` of ``cfg.model``.

    The held-out split is finetune's (``build_datasets`` with the same seed, fraction
    and sequence length); ``cfg.eval_batches`` batches of ``cfg.batch_size`` (0 = all).
    With ``cfg.offload`` cpu or nvme the weights stream through the tiers, unit by unit.

    Args:
        cfg: from :func:`evaluation_config`.
        perplexity: measure the held-out perplexity (else only the task).

    Returns:
        The EvalReport.

    Raises:
        OutcoreError: a bad model, data, task file or memory setting (one line).
    """
    import time

    from ..data import build_datasets
    from ..data.tasks import load_task
    from ..models import check_packed_documents
    from ..training.process import set_threads

    t0 = time.perf_counter()
    set_threads(cfg.threads)
    task = load_task(cfg.eval_task) if cfg.eval_task else None  # a bad file fails before the model loads
    model, tokenizer, engine = _load_for_eval(cfg)
    report = EvalReport(model=cfg.model, offload=cfg.offload if engine is not None else "none")
    try:
        scorer = CausalLMScorer(model) if engine is None else engine.scorer
        if perplexity:
            if cfg.padding_free:
                check_packed_documents(model)
            _, val = build_datasets(cfg.data, tokenizer, cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction,
                                    max_bytes=cfg.data_max_bytes, padding_free=cfg.padding_free)
            report.data, report.eval_loss = cfg.data, mean_eval_loss(scorer.loss, val, cfg.batch_size,
                                                                      cfg.eval_batches)
            report.perplexity = events.perplexity(report.eval_loss)  # (``perplexity`` here is the flag)
            report.eval_tokens = _labelled_tokens(val, cfg.batch_size, cfg.eval_batches)
        if task is not None:
            report.task = score_task(scorer, tokenizer, task, cfg.batch_size * cfg.seq_len)
    finally:
        if engine is not None:
            engine.close()
    report.wall_s = time.perf_counter() - t0
    return report


def _labelled_tokens(dataset: Any, batch_size: int, n_batches: int) -> int:
    from ..data import eval_batches

    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in eval_batches(dataset, batch_size, n_batches))


def _load_for_eval(cfg: Any) -> tuple[torch.nn.Module, Any, Any]:
    """The model in memory (engine None), or built on the meta device and streamed from the tiers."""
    from ..dtypes import torch_dtype
    from ..models import load_model, load_model_lazily

    if cfg.offload == "auto":
        raise ConfigError("offload='auto' does not apply to evaluation; pass none (in memory), cpu or nvme")
    if cfg.offload == "none":
        model, tokenizer = load_model(cfg.model, dtype=torch_dtype(cfg.dtype))
        model.to(resolve_device(cfg.device)).eval()
        return model, tokenizer, None
    model, tokenizer, fill = load_model_lazily(cfg.model, dtype=torch_dtype(cfg.dtype))
    model.eval()
    return model, tokenizer, StreamedModel(model, cfg, fill)


class StreamedModel:
    """A frozen model whose weights live in the tiers and stream in as its forward reaches them.

    The out-of-core engine of training, with nothing to train: every unit is read-only
    (never written back) and prefetched ``k`` units ahead of the forward.

    Args:
        model: built on the meta device (``load_model_lazily``).
        cfg: ``offload`` (cpu | nvme), ``swap_dir``, ``device_mem``, ``host_mem``.
        fill: ``fill(name, out)`` reads a weight from the model's files.
    """

    def __init__(self, model: torch.nn.Module, cfg: Any, fill: Any) -> None:
        import tempfile
        from pathlib import Path

        from ..bytesize import parse_bytes
        from ..models import plain_name
        from ..offload.engine import StreamedInference

        model.config.use_cache = False  # no generation: a KV cache only costs memory
        device = resolve_device(cfg.device)
        self.scorer = CausalLMScorer(model, device)
        self._tmp = None if cfg.swap_dir else tempfile.TemporaryDirectory(prefix="outcore-eval-")
        swap = Path(cfg.swap_dir) if cfg.swap_dir else Path(self._tmp.name) / "swap"
        head = [] if self.scorer.head_loss is None else [self.scorer.head_loss]
        self.engine = StreamedInference(  # freezes every parameter: units are read-only
            model, offload=cfg.offload, swap_dir=swap, head_modules=head,
            device_bytes=parse_bytes(cfg.device_mem) if cfg.device_mem else None,
            host_bytes=parse_bytes(cfg.host_mem) if cfg.host_mem else None, device=device,
            init_weights=lambda slot, t: fill(plain_name(slot.name), t))

    def close(self) -> None:
        """Remove the swap directory and free the arenas."""
        try:
            self.engine.close()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
