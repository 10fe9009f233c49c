"""Chunked linear + cross-entropy == the full-logits reference (loss and grads, fp32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outcore.errors import ConfigError, DataError, ModelError
from outcore.kernels.linear_cross_entropy import (causal_lm_loss, default_chunk_size,
                                                  linear_cross_entropy)

N, H, V = 150, 24, 300


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative error of ``a`` against reference ``b``."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(seed=0, bias=False, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = ignore
    return h, w, b, t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_full_logits_reference(reduction, smoothing, bias):
    h, w, b, t = _inputs(bias=bias)
    params = [h, w] + ([b] if bias else [])
    ours = linear_cross_entropy(h, w, t, bias=b, reduction=reduction,
                                label_smoothing=smoothing, chunk_size=64)
    ref = F.cross_entropy(F.linear(h, w, b), t, reduction=reduction, label_smoothing=smoothing)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    g_out = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7)
    g_ours = torch.autograd.grad(ours, params, g_out)
    g_ref = torch.autograd.grad(ref, params, g_out)
    assert _rel(ours, ref) <= 1e-6
    for a, r in zip(g_ours, g_ref):
        assert _rel(a, r) <= 1e-6


def test_error_is_at_the_level_of_the_fp32_reference():
    # Against fp64, our fp32 error is no worse than that of fp32 F.cross_entropy.
    h, w, _, t = _inputs(seed=3)
    ours = torch.autograd.grad(linear_cross_entropy(h, w, t, label_smoothing=0.1, chunk_size=32), [h, w])
    ref32 = torch.autograd.grad(F.cross_entropy(h @ w.T, t, label_smoothing=0.1), [h, w])
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    ref64 = torch.autograd.grad(F.cross_entropy(h64 @ w64.T, t, label_smoothing=0.1), [h64, w64])
    for a, r32, r64 in zip(ours, ref32, ref64):
        assert _rel(a, r64) <= 2 * _rel(r32, r64) + 1e-7


@pytest.mark.parametrize("chunk", [1, 7, N, 10 * N, None])
def test_chunk_size_does_not_change_the_result(chunk):
    h, w, _, t = _inputs(seed=1)
    a = linear_cross_entropy(h, w, t, chunk_size=chunk)
    ga = torch.autograd.grad(a, [h, w])
    ref = F.cross_entropy(h @ w.T, t)
    gr = torch.autograd.grad(ref, [h, w])
    assert _rel(a, ref) <= 1e-6 and all(_rel(x, y) <= 1e-6 for x, y in zip(ga, gr))


def test_custom_ignore_index_and_all_ignored():
    h, w, _, t = _inputs(seed=2, ignore=7_000)
    t[t == 7_000] = -1
    ours = linear_cross_entropy(h, w, t, ignore_index=-1)
    ref = F.cross_entropy(h @ w.T, t, ignore_index=-1)
    assert _rel(ours, ref) <= 1e-6
    none = torch.full((N,), -100)
    assert torch.isnan(linear_cross_entropy(h, w, none)) and torch.isnan(F.cross_entropy(h @ w.T, none))
    assert linear_cross_entropy(h, w, none, reduction="sum").item() == 0.0


def test_tied_embedding_gradients_accumulate():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H)
    ids = torch.randint(0, V, (N,))
    t = torch.randint(0, V, (N,))

    def run(loss_fn):
        emb.zero_grad()
        hidden = torch.tanh(emb(ids))  # the embedding is used before and as the output projection
        loss_fn(hidden).backward()
        return emb.weight.grad.clone()

    ours = run(lambda hid: linear_cross_entropy(hid, emb.weight, t, chunk_size=50))
    ref = run(lambda hid: F.cross_entropy(hid @ emb.weight.T, t))
    assert _rel(ours, ref) <= 1e-6


def test_frozen_weight_and_no_grad():
    h, w, _, t = _inputs(seed=4)
    w.requires_grad_(False)  # e.g. LoRA: the lm_head is frozen
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, t), [h])
    (rh,) = torch.autograd.grad(F.cross_entropy(h @ w.T, t), [h])
    assert _rel(gh, rh) <= 1e-6
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t)
    assert not loss.requires_grad and _rel(loss, F.cross_entropy(h @ w.T, t)) <= 1e-6


def test_bfloat16_is_close_to_fp32():
    h, w, _, t = _inputs(seed=5)
    hb, wb = (x.detach().bfloat16().requires_grad_() for x in (h, w))
    loss = linear_cross_entropy(hb, wb, t)
    assert loss.dtype == torch.float32
    gh, gw = torch.autograd.grad(loss, [hb, wb])
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    ref = F.cross_entropy(h @ w.T, t)
    assert abs(loss.item() - ref.item()) / ref.item() < 2e-2


def test_bfloat16_few_rows_weight_grad_is_one_gemm():
    """16-bit with few rows (N x 2 <= H x 4, a large head's case): d_weight is one GEMM over the
    kept d_logits, so it is independent of the chunking and near the fp32 gradient."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(16, 64, generator=g), torch.randn(V, 64, generator=g) * 0.1
    t = torch.randint(0, V, (16,), generator=g)
    grads = []
    for chunk in (3, 16):
        hb, wb = (x.bfloat16().requires_grad_() for x in (h, w))
        grads.append(torch.autograd.grad(linear_cross_entropy(hb, wb, t, chunk_size=chunk), [hb, wb]))
    assert grads[0][1].dtype == torch.bfloat16 and torch.equal(grads[0][1], grads[1][1])
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.autograd.grad(F.cross_entropy(hf @ wf.T, t), [hf, wf])
    assert _rel(grads[0][1], ref[1]) < 2e-2 and _rel(grads[0][0], ref[0]) < 2e-2


def test_causal_lm_loss_matches_hugging_face(tiny_llama):
    model = tiny_llama
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 17))
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    ref = model(input_ids=ids, labels=labels).loss
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    hidden = model.model(input_ids=ids).last_hidden_state
    ours = causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=8)
    grads = torch.autograd.grad(ours, list(model.parameters()))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert _rel(ours, ref) <= 1e-6
    for a, r in zip(grads, ref_grads):
        assert _rel(a, r) <= 1e-6
    n_items = torch.tensor(23)
    ref_sum = model(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
    ours_sum = causal_lm_loss(hidden, model.lm_head.weight, labels, num_items_in_batch=n_items)
    assert _rel(ours_sum, ref_sum) <= 1e-6
    rows = causal_lm_loss(hidden, model.lm_head.weight, labels, reduction="none")
    assert rows.shape == labels.shape and torch.all(rows[:, -1] == 0)


def test_ops_are_registered_and_pass_opcheck():
    for name in ("linear_cross_entropy_fwd", "linear_cross_entropy_bwd"):  # CPU reference + CUDA impl
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"outcore::{name}", "CUDA")
    # opcheck: schema, fake impl and autograd registration agree with the real impl.
    h, w, b = torch.randn(12, 4).requires_grad_(), torch.randn(9, 4).requires_grad_(), torch.randn(9)
    t = torch.tensor([1, 2, -100, 8, 0, 3, 3, 4, 5, 6, 7, -100])
    torch.library.opcheck(torch.ops.outcore.linear_cross_entropy_fwd,
                          (h, w, t, b, -100, 0.1, 2, 5, True, True, False))
    torch.library.opcheck(torch.ops.outcore.linear_cross_entropy_bwd,
                          (torch.randn(12), h.detach(), w.detach(), t, b, -100, 0.0, 5, True, True, True))


def test_default_chunk_size():
    assert default_chunk_size(8192, 49152) == 128  # ~32 MiB of fp32 logits
    assert default_chunk_size(10, 49152) == 10
    assert default_chunk_size(100_000, 256) == 32768


@pytest.mark.parametrize("kwargs, err, needle", [
    ({"reduction": "avg"}, ConfigError, "'avg'"),
    ({"label_smoothing": 1.5}, ConfigError, "1.5"),
    ({"chunk_size": 0}, ConfigError, "chunk_size=0"),
])
def test_bad_options(kwargs, err, needle):
    h, w, _, t = _inputs()
    with pytest.raises(err, match=needle):
        linear_cross_entropy(h, w, t, **kwargs)


def test_bad_shapes_and_targets():
    h, w, _, t = _inputs()
    with pytest.raises(ModelError, match=r"\(300, 23\)"):
        linear_cross_entropy(h, w[:, :23], t)
    with pytest.raises(ModelError, match="float64"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ModelError, match=r"bias shape \(5,\)"):
        linear_cross_entropy(h, w, t, bias=torch.zeros(5))
    with pytest.raises(DataError, match=r"\(149,\)"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(DataError, match="float32"):
        linear_cross_entropy(h, w, t.float())
    bad = t.clone()
    bad[3] = V
    with pytest.raises(DataError, match=f"target {V} is outside"):
        linear_cross_entropy(h, w, bad)
    with pytest.raises(ModelError, match=r"\[B, T, H\]"):
        causal_lm_loss(h, w, t)
    with pytest.raises(DataError, match=r"labels shape \(1, 150\)"):
        causal_lm_loss(h.view(2, 75, H), w, t.view(1, N))
    with pytest.raises(ConfigError, match="'sum' must be 'mean'"):
        causal_lm_loss(h.view(2, 75, H), w, t.view(2, 75), reduction="sum", num_items_in_batch=3)
