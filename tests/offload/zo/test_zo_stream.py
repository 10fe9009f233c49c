"""The ZO block schedule: in memory == streamed from NVMe (the tiered store) == replay, bit for bit (fp32)."""
import pytest
import torch

from outcore.errors import ConfigError, SwapDirError
from outcore.offload.zo import CausalLMBlocks, ZOBlockTrainer
from outcore.optim.zo_core import ZOHyper
from outcore.optim.zo_replay import ZOLog, replay


pytestmark = pytest.mark.usefixtures("one_thread")  # same reduction order in every mode; tiny shapes anyway


def _batches(n, seed=0, vocab=256, b=2, t=16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (b, t), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return out


def _train(model, hyper, batches, swap_dir=None, lrs=None, prefetch=2, device=None):
    """In memory (``model`` on ``device``) or streamed from ``swap_dir`` to ``device``."""
    if swap_dir is None and device is not None:
        model.to(device)
    tr = ZOBlockTrainer(model, hyper, seed=7, swap_dir=swap_dir, prefetch=prefetch, device=device)
    for k, batch in enumerate(batches):
        tr.step(batch, lr=(lrs[k] if lrs else 1e-3))
    sd = tr.state_dict()
    nvme = tr.tier_stats().get("NVME")
    tr.close()
    return sd, tr, nvme


def test_block_forward_equals_model_forward(tiny_llama):
    batch = _batches(1)[0]
    ref = tiny_llama(**batch).loss
    ours = CausalLMBlocks(tiny_llama).loss(batch)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hyper", [ZOHyper(eps=1e-2, n_samples=2),
                                   ZOHyper(eps=1e-2, momentum=0.7, weight_decay=0.1),
                                   ZOHyper(eps=1e-2, sparsity=0.5, mask_every=2)],
                         ids=["n2", "momentum-wd", "sparse"])
def test_in_memory_streamed_and_replay_are_bit_identical(tiny_llama_factory, tmp_path, hyper, compute_device):
    batches = _batches(5)
    lrs = [1e-3, 2e-3, 1.5e-3, 1e-3, 5e-4]
    base = {k: v.to(compute_device) for k, v in tiny_llama_factory().state_dict().items()}  # replayed there
    mem, tr_mem, _ = _train(tiny_llama_factory(), hyper, batches, lrs=lrs, device=compute_device)
    disk, tr_disk, nvme = _train(tiny_llama_factory(), hyper, batches, swap_dir=str(tmp_path / "swap"), lrs=lrs,
                                 device=compute_device)
    # no read-ahead: every block waits for its read, a different interleaving of the same I/O
    disk0, tr_disk0, nvme0 = _train(tiny_llama_factory(), hyper, batches, swap_dir=str(tmp_path / "swap0"),
                                    lrs=lrs, prefetch=0, device=compute_device)
    assert [r.grads for r in tr_mem.log] == [r.grads for r in tr_disk.log] == [r.grads for r in tr_disk0.log]
    assert nvme.read_bytes > 0 and nvme.written_bytes > 0  # counted in the store's tier statistics
    assert nvme0.read_bytes > 0 and nvme0.written_bytes > 0
    assert not (tmp_path / "swap").exists()  # the store removes its swap dir on close
    log = ZOLog(tr_mem.header(), tr_mem.log)
    log.save(tmp_path)
    rep = replay(base, ZOLog.load(tmp_path))
    changed = 0
    for name, w in mem.items():
        assert torch.equal(w, disk[name]) and torch.equal(w, disk0[name]), name
        assert torch.equal(w, rep[name]), name
        changed += not torch.equal(w, base[name])
    assert changed == len(mem)  # every trainable tensor moved


def test_zo_block_training_lowers_loss(tiny_llama):
    batch = _batches(1, seed=3)[0]
    tr = ZOBlockTrainer(tiny_llama, ZOHyper(eps=1e-3, n_samples=4), seed=0)
    before = tr.eval_loss(batch)
    for _ in range(30):
        tr.step(batch, lr=2e-3)
    after = tr.eval_loss(batch)
    assert after < before - 0.05


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_params_are_empty_between_visits(tiny_llama_factory, tmp_path, tied):
    model = tiny_llama_factory(tie=tied)
    tr = ZOBlockTrainer(model, ZOHyper(), swap_dir=str(tmp_path / "s"))
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == 0  # on disk, not in RAM
    assert model.model.embed_tokens.weight.numel() == 0  # the embedding streams too (tied: kept while there is room)
    tr.step(_batches(1)[0], lr=1e-3)
    assert layer.self_attn.q_proj.weight.numel() == 0
    assert tr.tier_stats()["NVME"].read_bytes > 0
    tr.close()


def test_untied_head_streamed_equals_in_memory(tiny_llama_factory, tmp_path, compute_device):
    batches, hyper = _batches(3), ZOHyper(eps=1e-2, n_samples=2)
    mem, tr_mem, _ = _train(tiny_llama_factory(tie=False), hyper, batches, device=compute_device)
    disk, tr_disk, _ = _train(tiny_llama_factory(tie=False), hyper, batches, swap_dir=str(tmp_path / "s"),
                              prefetch=1, device=compute_device)
    assert [r.grads for r in tr_mem.log] == [r.grads for r in tr_disk.log]
    assert all(torch.equal(w, disk[name]) for name, w in mem.items())


def test_tied_embedding_is_read_once_and_blocks_once_a_step(tiny_llama_factory, tmp_path):
    from outcore.offload.aligned import align_up

    tr = ZOBlockTrainer(tiny_llama_factory(), ZOHyper(eps=1e-2), swap_dir=str(tmp_path / "s"), prefetch=1)
    embed, *rest = [align_up(u.numel * 4) for u in tr.blocks.units]
    for batch in _batches(4):
        tr.step(batch, lr=1e-3)
    assert tr.tier_stats()["NVME"].read_bytes == embed + 4 * sum(rest)
    tr.close()


def test_bad_arguments(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="world=2 needs an exchange"):
        ZOBlockTrainer(tiny_llama, ZOHyper(), world=2, rank=0)
    with pytest.raises(ConfigError, match="rank=3, world=2"):
        ZOBlockTrainer(tiny_llama, ZOHyper(), world=2, rank=3)
    with pytest.raises(SwapDirError, match="missing"):
        ZOBlockTrainer(tiny_llama, ZOHyper(), swap_dir=str(tmp_path / "missing" / "x"))
    tr = ZOBlockTrainer(tiny_llama, ZOHyper())
    with pytest.raises(ConfigError, match="lr=0"):
        tr.step(_batches(1)[0], lr=0)
    for p in tiny_llama.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no parameter"):
        ZOBlockTrainer(tiny_llama, ZOHyper())
