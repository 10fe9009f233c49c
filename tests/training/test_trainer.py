"""Every trainer a recipe steps is a ``Trainer`` (training/trainer.py): its members, their
signatures, and (the data-parallel wrapper, on one rank) the engine's own step, bit for bit.
That the in-memory model and the engine train alike: tests/offload/test_engine*.py and
tests/recipes/test_full_finetune.py."""
from __future__ import annotations

import copy
import inspect

import torch

from outcore.offload.engine import OutOfCoreEngine
from outcore.offload.distributed import Ranks
from outcore.offload.engine import offload_model
from outcore.optim import AdamW
from outcore.training.distributed.across_ranks import DataParallelAdapters, data_parallel
from outcore.training.in_memory import InMemoryModel
from outcore.training.trainer import Trainer

_METHODS = ("train_step", "close")


def _signature(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _lora(factory):
    from peft import LoraConfig, get_peft_model

    base = factory(seed=0, layers=2)
    base.config.use_cache = False
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # B starts at zero: give the adapters a real delta
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def _engine(model, tmp_path) -> OutOfCoreEngine:
    adapters = [p for p in model.parameters() if p.requires_grad]
    return offload_model(model, torch.optim.AdamW(adapters, lr=1e-3), offload="cpu", swap_dir=tmp_path / "swap",
                         max_grad_norm=1.0, resident_trainable=True, device="cpu")


def test_each_trainer_has_the_protocol_s_members_and_nothing_borrowed(tiny_llama_factory, tmp_path):
    model = tiny_llama_factory(layers=2)
    params = list(model.parameters())
    in_memory = InMemoryModel(model, torch.optim.AdamW(params), params, 1.0)
    streamed = tiny_llama_factory(layers=2)
    engine = offload_model(streamed, AdamW(list(streamed.parameters())), offload="cpu", swap_dir=None, device="cpu")
    adapters = _engine(_lora(tiny_llama_factory), tmp_path)
    wrapped = DataParallelAdapters(adapters, Ranks(0, 2), tmp_path)  # (built without a process group)
    try:
        for trainer in (in_memory, engine, wrapped):
            assert isinstance(trainer, Trainer), type(trainer)
            for name in _METHODS:
                assert _signature(getattr(trainer, name)) == _signature(getattr(Trainer, name)), (trainer, name)
            assert trainer.last_grad_norm is None  # (no step yet)
        # the wrapper is no proxy: the engine's other members are asked of the engine
        assert not hasattr(wrapped, "store") and not hasattr(wrapped, "units") and wrapped.engine is adapters
        assert data_parallel(engine, Ranks(), tmp_path) is engine  # one rank: the engine itself
        assert isinstance(data_parallel(adapters, Ranks(0, 2), tmp_path), DataParallelAdapters)
    finally:
        engine.close()
        adapters.close()


def test_the_data_parallel_wrapper_on_one_rank_steps_as_the_engine(tiny_llama_factory, tmp_path):
    """Its step is the engine's begin_step / micro_batch / end_step around the shared accumulation:
    with one rank (nothing summed) the same losses, norms and adapters as the engine's own step."""
    model = _lora(tiny_llama_factory)
    other = copy.deepcopy(model)
    own = _engine(model, tmp_path / "a")
    wrapped = DataParallelAdapters(_engine(other, tmp_path / "b"), Ranks(), tmp_path)

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            micro = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
            assert torch.equal(own.train_step(loss_fn, micro, 1e-3), wrapped.train_step(loss_fn, micro, 1e-3))
            assert torch.equal(own.last_grad_norm, wrapped.last_grad_norm)
        mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
        theirs = {n: p for n, p in other.named_parameters() if p.requires_grad}
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    finally:
        own.close()
        wrapped.close()
