"""Distributed ZO over gloo: 2 real processes == 1 process with the same total perturbations."""
import subprocess
import sys
import textwrap

import pytest
import torch

from outcore.offload.zo import ZOBlockTrainer
from outcore.optim.zo_core import ZOHyper

WORKER = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    from outcore.optim.zo_core import ZOHyper
    from outcore.offload.zo.distributed import distributed_trainer

    rank, world, init, out, split = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    # rank 1 streams its weights from NVMe (the store), rank 0 keeps them in RAM: same bits
    swap = {"swap_dir": f"{out}/swap{rank}"} if rank == 1 else {}
    tr = distributed_trainer(model, ZOHyper(eps=1e-2, n_samples=4), seed=3, split=split, **swap)
    g = torch.Generator().manual_seed(rank if split == "data" else 0)
    for step in range(3):
        ids = torch.randint(0, 128, (2, 12), generator=g)
        tr.step({"input_ids": ids}, lr=1e-2)
    torch.save({"sd": tr.state_dict(), "grads": [r.grads for r in tr.log]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
''')


def _run(tmp_path, split):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(init), str(tmp_path), split],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out.decode()[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow(ci=True)
def test_two_gloo_processes_equal_one_process(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    r0, r1 = _run(tmp_path, "samples")
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    tr = ZOBlockTrainer(model, ZOHyper(eps=1e-2, n_samples=4), seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tr.step({"input_ids": torch.randint(0, 128, (2, 12), generator=g)}, lr=1e-2)
    ref = tr.state_dict()
    assert r0["grads"] == r1["grads"] == [r.grads for r in tr.log]
    for k, v in ref.items():
        assert torch.equal(r0["sd"][k], v) and torch.equal(r1["sd"][k], v), k


@pytest.mark.slow
def test_data_split_keeps_replicas_identical(tmp_path):
    r0, r1 = _run(tmp_path, "data")
    assert r0["grads"] == r1["grads"]
    for k, v in r0["sd"].items():
        assert torch.equal(v, r1["sd"][k]), k


def test_split_is_validated(tiny_llama):
    from outcore.errors import ConfigError
    with pytest.raises(ConfigError, match="split='rows'"):
        ZOBlockTrainer(tiny_llama, ZOHyper(), split="rows")
