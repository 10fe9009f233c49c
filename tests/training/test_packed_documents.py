"""A packed row's documents are kept apart (``padding_free``): the per-document loss and the
gradients of a packed batch equal each document run alone (fp32), through the chunked head
and through the model's own loss, in memory and through the zeroth-order block runner."""
from __future__ import annotations

import pytest
import torch

from outcore.data import document_positions
from outcore.training.loss import CausalLMScorer

EOS = 2
LENGTHS = ([5, 11, 16], [9, 9, 14])  # two rows of 32 tokens, three documents each


def _documents(seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in LENGTHS:
        docs = [torch.cat([torch.randint(3, 256, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]
        rows.append(docs)
    return rows


def _packed_batch(rows) -> dict[str, torch.Tensor]:
    ids = torch.stack([torch.cat(docs) for docs in rows]).long()
    positions = document_positions(ids, EOS).long()
    labels = ids.clone()
    labels[positions == 0] = -100  # as SequenceDataset.get_batch gives a packed row
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _alone(doc: torch.Tensor) -> dict[str, torch.Tensor]:
    ids = doc.long().unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("head", ["chunked", "model"])
def test_a_packed_batch_scores_each_document_as_if_alone(tiny_llama, head):
    model = tiny_llama.train()
    model.config.use_cache = False
    scorer = CausalLMScorer(model)
    if head == "model":
        scorer.head_loss = None  # the model's own forward and loss (a loss the chunked head does not cover)
    rows = _documents()
    packed = scorer.token_nll(_packed_batch(rows))
    for r, docs in enumerate(rows):
        start = 0
        for doc in docs:
            alone = scorer.token_nll(_alone(doc))[0]
            torch.testing.assert_close(packed[r, start:start + doc.numel()], alone, rtol=1e-5, atol=1e-6)
            start += doc.numel()


def test_a_packed_step_has_the_gradients_of_the_documents_alone(tiny_llama_factory):
    packed_model, alone_model = tiny_llama_factory().train(), tiny_llama_factory().train()
    rows = _documents(1)
    batch = _packed_batch(rows)
    loss = CausalLMScorer(packed_model).loss(batch)
    loss.backward()
    n = int((batch["labels"][:, 1:] != -100).sum())  # the labelled predictions the mean is over
    alone = CausalLMScorer(alone_model)
    total = 0.0
    for docs in rows:
        for doc in docs:
            part = alone.token_nll(_alone(doc)).sum() / n
            part.backward()
            total += float(part.detach())
    assert float(loss) == pytest.approx(total, rel=1e-6)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_zeroth_order_runner_keeps_documents_apart(tiny_llama):
    from outcore.offload.zo.model import CausalLMBlocks

    model = tiny_llama.eval()
    model.config.use_cache = False
    batch = _packed_batch(_documents(2))
    h = CausalLMBlocks(model).loss(batch)
    with torch.no_grad():
        reference = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                          labels=batch["labels"], use_cache=False).loss
    torch.testing.assert_close(h, reference, rtol=1e-6, atol=1e-6)
