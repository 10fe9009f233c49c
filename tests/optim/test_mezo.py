"""MeZO / SparseMeZO optimizers: SPSA estimate, options, and exact replay of the in-place path."""
import pytest
import torch

from outcore.errors import CheckpointError, ConfigError
from outcore.kernels.zo_perturb import zo_noise, zo_seed
from outcore.optim.mezo import MeZO
from outcore.optim.sparse_mezo import SparseMeZO
from outcore.optim.zo_core import ZOHyper, sample_seeds
from outcore.optim.zo_replay import ZOLog, replay


# tiny ops: thread hand-offs cost more than they save on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def _quadratic(seed=0, n=24):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Tanh(), torch.nn.Linear(n, 1))
    x = torch.randn(64, n)
    y = torch.randn(64, 1)
    return model, lambda: torch.nn.functional.mse_loss(model(x), y)


def test_one_step_matches_spsa_formula():
    model, loss = _quadratic()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MeZO.from_model(model, lr=0.01, eps=1e-3, seed=5)
    opt.step(loss)
    rec = opt.log[0]
    assert rec.seeds == sample_seeds(5, 1, 1)
    # the estimate: (L(w+eps z) - L(w-eps z)) / 2 eps computed by hand
    names = list(w0)
    with torch.no_grad():
        for sign in (1, -1):
            for j, (n, p) in enumerate(model.named_parameters()):
                p.copy_(w0[n] + sign * 1e-3 * zo_noise(p.shape, zo_seed(rec.seeds[0], j)))
            if sign == 1:
                lp = loss().item()
            else:
                lm = loss().item()
    assert rec.grads[0] == pytest.approx((lp - lm) / 2e-3, rel=1e-3, abs=1e-4)
    assert names == opt.param_names


@pytest.mark.parametrize("lr,kw", [(0.02, {}), (0.02, {"n_samples": 3}),
                                   (0.004, {"momentum": 0.8, "weight_decay": 0.1}),
                                   (0.02, {"sparsity": 0.5, "mask_every": 2})])
def test_mezo_decreases_loss(lr, kw):
    model, loss = _quadratic()
    cls = SparseMeZO if "sparsity" in kw else MeZO
    opt = cls.from_model(model, lr=lr, eps=1e-3, seed=1, **kw)
    first = loss().item()
    for _ in range(80):
        opt.step(loss)
    assert loss().item() < 0.9 * first


@pytest.mark.parametrize("kw", [{"n_samples": 2, "momentum": 0.8, "weight_decay": 0.05},
                                {"sparsity": 0.6, "mask_every": 3}])
def test_inplace_replay_is_bit_exact(kw, tmp_path):
    model, loss = _quadratic(seed=3)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cls = SparseMeZO if "sparsity" in kw else MeZO
    opt = cls.from_model(model, lr=0.01, eps=1e-2, seed=2, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(12):
        opt.step(loss)
        sched.step()
    log = ZOLog(opt.header(), opt.log)
    log.save(tmp_path)
    out = replay(base, ZOLog.load(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(out[k], v), k
    assert (tmp_path / "zo_log.jsonl").stat().st_size < 12 * 400
    # without the perturbation rounding replay would differ: the log schedule matters
    bad = ZOLog({**log.header, "schedule": "exact"}, log.records)
    other = replay(base, bad)
    assert any(not torch.equal(other[k], v) for k, v in model.state_dict().items())


def test_sparse_mezo_touches_only_small_entries():
    model, loss = _quadratic()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = SparseMeZO.from_model(model, lr=0.05, sparsity=0.75, mask_every=100, seed=0)
    opt.step(loss)
    thr = opt.log[0].thresholds
    for j, (n, p) in enumerate(model.named_parameters()):
        large = before[n].abs() > thr[j]
        assert torch.equal(p.detach()[large], before[n][large])
        if p.numel() >= 16:
            assert large.float().mean().item() == pytest.approx(0.75, abs=0.1)


def test_lora_only_perturbs_adapters(tiny_llama):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = MeZO.from_model(model, lr=1e-3)
    assert opt.param_names and all("lora_" in n for n in opt.param_names)
    ids = torch.randint(0, 256, (2, 16))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n][0].detach().clone()
    opt.step(lambda: model(input_ids=ids, labels=ids).loss)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    assert not torch.equal([p for n, p in model.named_parameters() if "lora_B" in n][0], lora_b)


@pytest.mark.parametrize("kw,match", [({"eps": 0.0}, "eps=0.0"), ({"n_samples": 0}, "n_samples=0"),
                                      ({"momentum": 1.0}, "momentum=1.0"), ({"lr": -1.0}, "lr=-1.0"),
                                      ({"weight_decay": -0.1}, "weight_decay=-0.1")])
def test_bad_hyper_parameters(kw, match):
    model, _ = _quadratic()
    with pytest.raises(ConfigError, match=match):
        MeZO.from_model(model, **kw)


def test_bad_sparsity_and_frozen_model():
    model, _ = _quadratic()
    with pytest.raises(ConfigError, match="sparsity=1.0"):
        SparseMeZO.from_model(model, sparsity=1.0)
    with pytest.raises(ConfigError, match="mask_every=0"):
        ZOHyper(mask_every=0)
    with pytest.raises(ConfigError, match="optim_args.foo"):
        ZOHyper.from_args({"foo": 1})
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="requires_grad"):
        MeZO(model.parameters())


def test_replay_rejects_mismatched_base(tmp_path):
    model, loss = _quadratic()
    opt = MeZO.from_model(model, lr=0.01)
    opt.step(loss)
    log = ZOLog(opt.header(), opt.log)
    with pytest.raises(CheckpointError, match="'0.weight'"):
        replay({"x": torch.zeros(1)}, log)
    with pytest.raises(CheckpointError, match="does not exist"):
        ZOLog.load(tmp_path / "nope.jsonl")
    (tmp_path / "zo_log.jsonl").write_text('{"format": "x"}\n')
    with pytest.raises(CheckpointError, match="malformed"):
        ZOLog.load(tmp_path)


def test_export_zo_run_from_safetensors_base(tmp_path):
    from safetensors.torch import load_file, save_file

    from outcore.recipes.export import export_zo_run

    model, loss = _quadratic(seed=4)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "base.safetensors"))
    opt = MeZO.from_model(model, lr=0.01, n_samples=2, seed=9)
    for _ in range(4):
        opt.step(loss)
    ZOLog({**opt.header(), "base": {"kind": "safetensors", "path": "base.safetensors"}}, opt.log).save(tmp_path)
    out = export_zo_run(tmp_path, tmp_path / "final")
    got = load_file(str(out / "model.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k
    ZOLog(opt.header(), opt.log).save(tmp_path)  # no base named
    with pytest.raises(CheckpointError, match="names no base"):
        export_zo_run(tmp_path, tmp_path / "final2")
