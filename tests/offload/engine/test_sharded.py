"""Sharded out-of-core data parallelism over gloo: 2 ranks x B == 1 rank accumulating 2 x B,
and its DCP checkpoints resumed at another world size (2 -> 1, 1 -> 2).

Two real processes (``torch.distributed`` over gloo, a ``FileStore`` rendezvous) each train a
tiny Llama out of core on their own micro-batch, each keeping half of every unit's optimizer
state in its own swap directory; the test process trains the same model on one rank,
accumulating both micro-batches. Without clipping the ranks' summed gradient is the
accumulated one bit for bit and the updates are element-wise, so the weights are equal bit
for bit; with clipping the global norm is summed in another order (equal within fp32
rounding: the measured difference is printed and bounded). The model's vocabulary makes its
(tied) embedding's state large enough to stream in pieces inside each rank's range; the head
(a final norm of 64 elements) lies wholly in rank 0's range, so rank 1 owns none of it.
On the simulated accelerator (``compute_device``) the ranks compute on sim and join over
``simgloo`` (``offload/simdist.py``): the reduce-scatter and all-gather take device tensors.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from outcore.offload.engine import WEIGHTS, load_sharded, offload_model, save_sharded
from outcore.optim import build_optimizer
from outcore.recipes.export import unit_weights

STEPS, LR = 3, 1e-2
# (optimizer, clip, offload, dtype): the cases one pair of worker processes runs for the module;
# CI (``--slow=ci``) runs the first two
CASES = [("adamw8bit", 0.0, "nvme", "float32"), ("adamw", 1.0, "nvme", "float32"),
         ("adamw", 0.0, "nvme", "float32"), ("adamw8bit", 1.0, "nvme", "float32"), ("adamw", 1.0, "cpu", "float32"),
         ("adamw", 0.0, "nvme", "bfloat16")]  # bf16: fp32 masters (a state kind) sharded too
CI_CASES = 2
HPARAMS = {"adamw": {}, "adamw8bit": {"min_8bit_size": 256}}  # the norms keep fp32 moments


def model(dtype="float32"):
    """The tiny Llama every run trains (its embedding's state streams in pieces)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).train()
    m.config.use_cache = False
    return m


def loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def batches(step):
    """Step ``step``'s two micro-batches: one per rank, or both on one rank."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(2)]


# the workers import the model, loss and batches from this file (its folder: their last argument);
# they compute on the device their second-to-last argument names (sim: built and enabled before
# their first backward) and join the group over that device's backend (sim: simgloo)
COMMON = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, sys.argv[-1])
    from test_sharded import batches, loss, model
    from outcore.offload.device import resolve_device
    from outcore.offload.device import distributed_backend
    device = resolve_device(sys.argv[-2])
''')

WORKER = COMMON + textwrap.dedent('''
    import datetime, sys
    import torch.distributed as dist
    from outcore.offload.distributed.ranks import Ranks
    from outcore.offload.engine.assemble import offload_model
    from outcore.offload.engine.units import WEIGHTS
    from outcore.optim import build_optimizer
    from outcore.recipes.export import unit_weights

    import outcore.offload.engine.sharding as sharding
    sharding.CHUNK = 3 * 4096  # several collectives per unit, a chunk ending inside a tensor

    rank, init, out, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3], eval(sys.argv[4])
    hparams = eval(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group(distributed_backend(device), init_method="file://" + init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name, clip, offload, dtype in cases:
        m = model(dtype)
        opt = build_optimizer(name, list(m.parameters()), lr=%r, **hparams[name])
        eng = offload_model(m, opt, offload=offload, swap_dir=f"{out}/swap{rank}", prefetch=1,
                            max_grad_norm=clip, ranks=Ranks(rank, 2, rank), device=device)
        losses = [eng.train_step(loss, [batches(s)[rank]], %r).item() for s in range(%r)]
        weights = {n: w.clone() for u in eng.units for n, w in unit_weights(eng, u).items()}
        state = sum(h.numel * h.dtype.itemsize for u in eng.units for p, h in u.layout.handles.items()
                    if p.kind != WEIGHTS)
        results[(name, clip, offload, dtype)] = {"weights": weights, "losses": losses, "state": state,
                                          "norm": None if eng.last_grad_norm is None else eng.last_grad_norm.item()}
        eng.close()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
''' % (LR, LR, STEPS))

def _wait(procs):
    """Wait for the ranks; a failure shows the first failed rank's output (the others only
    say their peer went away)."""
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    failed = [(p.returncode, out) for p, out in zip(procs, outs) if p.returncode]
    assert not failed, min(failed, key=lambda f: "Connection closed by peer" in f[1])[1][-4000:]


@pytest.fixture(scope="module")
def ranks_out(request, tmp_path_factory):
    """``ranks_out(device)``: both ranks' results on ``device`` for every case that runs (one pair
    of processes per device for the module, started at the first test that asks)."""
    cases = CASES if request.config.getoption("--slow") == "all" else CASES[:CI_CASES]
    done: dict[str, list] = {}

    def run(device: torch.device) -> list:
        if device.type not in done:
            tmp = tmp_path_factory.mktemp(f"sharded_{device.type}")
            script = tmp / "worker.py"
            script.write_text(WORKER)
            procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp / "init"), str(tmp), repr(cases),
                                       repr(HPARAMS), device.type, str(Path(__file__).parent)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
            _wait(procs)
            done[device.type] = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
        return done[device.type]

    return run


def _one_rank(name, clip, offload, dtype, swap_dir, device):
    """One rank accumulating both micro-batches of each step (the reference)."""
    m = model(dtype)
    opt = build_optimizer(name, list(m.parameters()), lr=LR, **HPARAMS[name])
    eng = offload_model(m, opt, offload=offload, swap_dir=swap_dir, prefetch=1, max_grad_norm=clip, grad_accum=2,
                        device=device)
    for s in range(STEPS):
        eng.train_step(loss, batches(s), LR)
    weights = {n: w.clone() for u in eng.units for n, w in unit_weights(eng, u).items()}
    state = sum(h.numel * h.dtype.itemsize for u in eng.units for p, h in u.layout.handles.items() if p.kind != WEIGHTS)
    norm = None if eng.last_grad_norm is None else eng.last_grad_norm.item()
    eng.close()
    return weights, state, norm


@pytest.mark.parametrize("name,clip,offload,dtype", [
    pytest.param(*case, marks=pytest.mark.slow(ci=i < CI_CASES)) for i, case in enumerate(CASES)])
def test_two_ranks_equal_one_rank_accumulating(ranks_out, tmp_path, name, clip, offload, dtype, compute_device):
    torch.set_num_threads(1)
    want, state, norm = _one_rank(name, clip, offload, dtype, tmp_path / "swap", compute_device)
    r0, r1 = (out[(name, clip, offload, dtype)] for out in ranks_out(compute_device))
    diff = 0.0
    for pname, w in want.items():
        assert torch.equal(r0["weights"][pname], r1["weights"][pname]), pname  # the replicas agree
        diff = max(diff, (r0["weights"][pname] - w).abs().max().item())
    print(f"{compute_device.type} {name} clip={clip} {offload} {dtype}: max |2 ranks - 1 rank| = {diff:.3g}")
    if clip == 0:
        assert diff == 0.0
    else:  # the global norm summed in another order: equal within fp32 rounding, which
        # 8-bit moments can round to a neighbouring code (a fraction of one step's lr)
        assert r0["norm"] == r1["norm"] and r0["norm"] == pytest.approx(norm, rel=1e-6)
        assert 0 < diff < (1e-6 if name == "adamw" else 0.1 * LR)
    # each rank stores half of the state, give or take one PIECE_ALIGN row per tensor
    assert r0["state"] + r1["state"] < 1.1 * state and max(r0["state"], r1["state"]) < 0.6 * state


def test_shard_ranges_cut_pieces_and_cover_every_element(tiny_llama_factory):
    from outcore.offload.distributed import Ranks
    from outcore.offload.engine import causal_lm_units
    from outcore.offload.engine.sharding import Shard
    from outcore.offload.engine.unit_sizes import PIECE_ALIGN

    m = tiny_llama_factory(layers=1)
    for unit in causal_lm_units(m):
        shards = [Shard.of(unit, Ranks(r, 3, r)) for r in range(3)]
        covered = {k: 0 for k in unit.train_slots}
        for shard in shards:
            assert shard.length % PIECE_ALIGN == 0
            for k, lo, hi in shard.spans:
                assert lo % PIECE_ALIGN == 0 and 0 <= shard.at(k, lo) < shard.at(k, hi) <= shard.length
                covered[k] += hi - lo
        assert covered == {k: unit.slots[k].numel for k in unit.train_slots}, unit.name


def test_an_optimizer_that_mixes_elements_is_refused(tiny_llama_factory, tmp_path):
    from outcore.errors import ConfigError
    from outcore.offload.distributed import Ranks

    m = tiny_llama_factory(layers=1)
    opt = build_optimizer("galore", list(m.parameters()), lr=LR, rank=4)
    with pytest.raises(ConfigError, match="element-wise"):
        offload_model(m, opt, offload="cpu", swap_dir=None, ranks=Ranks(0, 2, 0))


def test_the_plan_sizes_one_ranks_share_of_the_state(tiny_llama_factory):
    from outcore.planner.sizes import model_spec, unit_bytes

    spec = model_spec(tiny_llama_factory(layers=2))
    one = unit_bytes(spec, method="full", optim="adamw", dtype="float32")
    two = unit_bytes(spec, method="full", optim="adamw", dtype="float32", world=2)
    assert [u.state for u in two] == [-(-u.state // 2) for u in one]
    assert [u.weights for u in two] == [u.weights for u in one]  # every rank holds the whole weights


# -- checkpoints (torch.distributed.checkpoint), resharded ----------------------------------
CKPT_WORKER = COMMON + textwrap.dedent('''
    import datetime, sys
    import torch.distributed as dist
    from outcore.offload.distributed.ranks import Ranks
    from outcore.offload.engine.sharded_checkpoint import load_sharded, save_sharded
    from outcore.offload.engine.assemble import offload_model
    from outcore.optim import build_optimizer
    from outcore.recipes.export import unit_weights

    rank, init, out, lr, hp = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), eval(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group(distributed_backend(device), init_method="file://" + init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))

    def engine():
        m = model()
        opt = build_optimizer("adamw8bit", list(m.parameters()), lr=lr, **hp)
        return offload_model(m, opt, offload="nvme", swap_dir=f"{out}/swap{rank}", prefetch=1,
                             ranks=Ranks(rank, 2, rank), device=device)

    def weights(eng):
        return {n: w.clone() for u in eng.units for n, w in unit_weights(eng, u).items()}

    results = {}
    eng = engine()  # 1 -> 2: the one-rank checkpoint, one more step here
    load_sharded(eng, f"{out}/ckpt1")
    eng.train_step(loss, [batches(2)[rank]], lr)
    results["from1"] = weights(eng)
    eng.close()
    eng = engine()  # 2 -> 1: two steps, saved, one more step
    for s in range(2):
        eng.train_step(loss, [batches(s)[rank]], lr)
    save_sharded(eng, f"{out}/ckpt2")
    eng.train_step(loss, [batches(2)[rank]], lr)
    results["on2"] = weights(eng)
    eng.close()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
''')


def _engine(swap_dir, device):
    m = model()
    opt = build_optimizer("adamw8bit", list(m.parameters()), lr=LR, **HPARAMS["adamw8bit"])
    return offload_model(m, opt, offload="nvme", swap_dir=swap_dir, prefetch=1, grad_accum=2, device=device)


def _weights(eng):
    return {n: w.clone() for u in eng.units for n, w in unit_weights(eng, u).items()}


@pytest.mark.slow(ci=True)
def test_checkpoints_reshard_between_one_and_two_ranks(tmp_path, compute_device):
    torch.set_num_threads(1)
    eng = _engine(tmp_path / "swap", compute_device)  # one rank: two steps, saved, one more step
    for s in range(2):
        eng.train_step(loss, batches(s), LR)
    save_sharded(eng, tmp_path / "ckpt1")
    eng.train_step(loss, batches(2), LR)
    on1 = _weights(eng)
    eng.close()

    script = tmp_path / "worker.py"
    script.write_text(CKPT_WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init"), str(tmp_path), repr(LR),
                               repr(HPARAMS["adamw8bit"]), compute_device.type, str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    _wait(procs)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))

    eng = _engine(tmp_path / "swap", compute_device)  # 2 -> 1: the two ranks' checkpoint, one more step here
    load_sharded(eng, tmp_path / "ckpt2")
    eng.train_step(loss, batches(2), LR)
    from2 = _weights(eng)
    eng.close()
    for name, w in on1.items():
        assert torch.equal(r0["from1"][name], w) and torch.equal(r1["from1"][name], w), name  # 1 -> 2
        assert torch.equal(from2[name], r0["on2"][name]), name  # 2 -> 1
    assert not torch.equal(on1["model.embed_tokens.weight"], model().model.embed_tokens.weight)
