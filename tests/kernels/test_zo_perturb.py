"""outcore::zo_perturb_ — the seeded perturbation op (reference path; Triton when usable)."""
import textwrap

import pytest
import torch

from outcore._optional import is_triton_available
from outcore.errors import ConfigError
from outcore.kernels.zo_perturb import CHUNK, zo_noise, zo_perturb_, zo_seed


def test_seed_mixing_is_deterministic_and_spreads():
    assert zo_seed(3, 4) == zo_seed(3, 4)
    seeds = {zo_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_noise_is_standard_normal_and_reproducible():
    z = zo_noise((CHUNK + 1000,), 7)  # spans two chunks
    assert torch.equal(z, zo_noise((CHUNK + 1000,), 7))
    assert not torch.equal(z, zo_noise((CHUNK + 1000,), 8))
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1.0) < 5e-3
    # the chunks are independent streams, not a repeat
    assert not torch.equal(z[:1000], z[CHUNK:CHUNK + 1000])


def test_perturb_equals_reference_formula_and_src_leaves_src_alone():
    torch.manual_seed(0)
    w = torch.randn(33, 17)
    z = zo_noise(w.shape, 11)
    ref = w + (z * 1e-3)
    out = torch.empty_like(w)
    zo_perturb_(out, 11, 1e-3, src=w)
    assert torch.equal(out, ref)
    w2 = w.clone()
    zo_perturb_(w2, 11, 1e-3)  # in place gives the same bits
    assert torch.equal(w2, ref)


def test_mask_keeps_unmasked_entries_bit_exact():
    torch.manual_seed(0)
    w = torch.randn(64, 8)
    mask = w.abs() <= 0.5
    out = w.clone()
    zo_perturb_(out, 3, 0.1, mask=mask)
    assert torch.equal(out[~mask], w[~mask])
    assert (out[mask] != w[mask]).all()


def test_bf16_perturbation():
    w = torch.zeros(100, dtype=torch.bfloat16)
    zo_perturb_(w, 1, 1.0)
    assert torch.equal(w, zo_noise((100,), 1).to(torch.bfloat16))


def test_custom_op_is_registered():
    w = torch.zeros(10)
    torch.ops.outcore.zo_perturb_(w, 5, 1.0, None, None)
    assert torch.equal(w, zo_noise((10,), 5))


@pytest.mark.parametrize("bad,match", [
    (lambda: zo_perturb_(torch.zeros(4, dtype=torch.int32), 0, 1.0), "torch.int32"),
    (lambda: zo_perturb_(torch.zeros(4, 4).t(), 0, 1.0), r"\(4, 4\) is not contiguous"),
    (lambda: zo_perturb_(torch.zeros(4), -1, 1.0), "seed=-1"),
    (lambda: zo_perturb_(torch.zeros(4), 0, 1.0, mask=torch.ones(5, dtype=torch.bool)), r"mask shape \(5,\)"),
    (lambda: zo_perturb_(torch.zeros(4), 0, 1.0, src=torch.zeros(4, dtype=torch.float64)), "src dtype"),
    (lambda: zo_seed(-2, 0), "seed=-2"),
])
def test_bad_inputs_name_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        bad()


# Run in the Triton interpreter by the `run_in_triton_interpreter` fixture (tests/kernels/conftest.py).
_TRITON_CHECK = textwrap.dedent("""
    import torch
    from outcore.kernels._library import triton_importable
    from outcore.kernels.zo_perturb_triton import zo_perturb_triton_
    assert triton_importable()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    src = torch.randn(10_000, device=dev)
    a, b = torch.empty_like(src), torch.empty_like(src)
    zo_perturb_triton_(a, 9, 0.5, None, src)
    zo_perturb_triton_(b, 9, 0.5, None, src)
    assert torch.equal(a, b)  # same seed, same z
    z = (a - src) / 0.5
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05, (z.mean(), z.std())
    mask = src.abs() < 0.5
    c = src.clone()
    zo_perturb_triton_(c, 9, 0.5, mask, None)
    assert torch.equal(c[~mask], src[~mask]) and torch.allclose(c[mask], a[mask])
    print("ok")
""")


@pytest.mark.skipif(not is_triton_available(), reason="triton is not installed")
def test_triton_kernel_contract(run_in_triton_interpreter):
    out = run_in_triton_interpreter(_TRITON_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_dispatch_uses_a_cuda_kernel_and_is_deterministic():
    w = torch.zeros(5000, device="cuda")
    v = torch.zeros(5000, device="cuda")
    zo_perturb_(w, 4, 1.0)
    zo_perturb_(v, 4, 1.0)
    assert torch.equal(w, v) and abs(w.std().item() - 1) < 0.1


def test_a_run_draws_its_noise_where_its_log_says(compute_device):
    """The backend is part of the run: off CUDA it is torch's CPU generator, drawn on the CPU
    and copied, so a run replays to the same bits on any device (a GPU machine included)."""
    from outcore.kernels.zo_perturb import TORCH_CPU, noise_backend

    if compute_device.type == "cuda":
        pytest.skip("a CUDA device draws its own noise by default (triton, or torch's CUDA generator)")
    assert noise_backend(compute_device) == TORCH_CPU
    w = torch.zeros(CHUNK + 77, device=compute_device)
    zo_perturb_(w, 5, 0.25, backend=TORCH_CPU)
    want = torch.zeros(CHUNK + 77)
    zo_perturb_(want, 5, 0.25)
    assert torch.equal(w.cpu(), want)


def test_gpu_noise_is_refused_where_it_cannot_be_drawn():
    from outcore.kernels.zo_perturb import TORCH_CPU, resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("torch", cpu) == TORCH_CPU  # an older log: every one was drawn on a CPU
    for backend in ("triton", "torch-cuda"):
        with pytest.raises(ConfigError, match="on a GPU"):
            resolve_backend(backend, cpu)
    with pytest.raises(ConfigError, match="is not one of"):
        resolve_backend("philox", cpu)


def test_the_log_header_names_the_backend(compute_device):
    from outcore.optim import MeZO

    p = torch.nn.Parameter(torch.zeros(8, device=compute_device))
    backend = MeZO([p], lr=1e-3).header()["backend"]
    assert backend in ("torch-cuda", "triton") if compute_device.type == "cuda" else backend == "torch-cpu"
