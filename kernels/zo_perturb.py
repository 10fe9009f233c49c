"""Zeroth-order perturbation from a seed: ``w = src + scale * z(seed) [* mask]``.

The one op every zeroth-order path in outcore uses (MeZO, Sparse MeZO, the
streamed block schedule, distributed ZO, replay). ``z`` is a standard normal
tensor of ``w``'s shape that is *regenerated* from ``seed`` every time and never
stored: the op draws it in fixed chunks of :data:`CHUNK` elements, chunk ``c``
from a generator seeded with ``zo_seed(seed, c)``, so the transient memory is
one chunk whatever the tensor size, and the values depend only on
``(seed, shape)`` — not on which code path (in memory, streamed, replayed) asks.

Per element the arithmetic is always ``out = src + fl32(scale * z) * mask``,
the same sequence on every path, which is what makes in-memory, streamed and
replayed runs bit-identical in fp32.

Backends — where ``z`` is drawn, which decides its bits (the run log records it, and a
resume or replay draws from the same one, whatever device it computes on):

- ``torch-cpu``: torch's CPU generator. Any device can draw it (on the CPU, then copied:
  the arithmetic after the draw is IEEE-exact everywhere), so a CPU run replays exactly on a
  GPU machine. The default off CUDA (the simulated accelerator included).
- ``torch-cuda``: torch's CUDA generator (a CUDA machine without Triton).
- ``triton``: the Triton kernel's Philox stream (:mod:`outcore.kernels.zo_perturb_triton`), the
  default on CUDA: fast, and needs a CUDA device to replay.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ._library import cuda_kernel_registrar

CHUNK = 1 << 20  # elements per generator re-seed: bounds the transient z buffer to 4 MiB
TORCH_CPU, TORCH_CUDA, TRITON = "torch-cpu", "torch-cuda", "triton"
BACKENDS = (TORCH_CPU, TORCH_CUDA, TRITON)
_LEGACY = {"torch": TORCH_CPU}  # run logs from before the GPU path ran: every one was drawn on a CPU
_MASK64 = (1 << 64) - 1


def zo_seed(seed: int, index: int) -> int:
    """Mix a seed and an index into a new 63-bit seed (splitmix64 finalizer).

    Used for (step seed, sample) -> sample seed, (sample seed, parameter index) ->
    tensor seed and (tensor seed, chunk) -> generator seed.

    Args:
        seed: any non-negative integer.
        index: any non-negative integer.

    Returns:
        A seed in ``[0, 2**63)``, a pure function of the two inputs.

    Raises:
        ConfigError: a negative seed or index.
    """
    if seed < 0 or index < 0:
        raise ConfigError(f"zo_seed(seed={seed}, index={index}): both must be >= 0")
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _check(w: torch.Tensor, seed: int, mask: torch.Tensor | None, src: torch.Tensor | None) -> None:
    if not w.is_floating_point():
        raise ConfigError(f"zo_perturb_: tensor of dtype {w.dtype} is not floating point; "
                          "only float parameters can be perturbed")
    if not w.is_contiguous():
        raise ConfigError(f"zo_perturb_: tensor of shape {tuple(w.shape)} is not contiguous; "
                          "call .contiguous() on the parameter first")
    if seed < 0:
        raise ConfigError(f"zo_perturb_: seed={seed} must be >= 0")
    for name, t in (("mask", mask), ("src", src)):
        if t is not None and t.shape != w.shape:
            raise ConfigError(f"zo_perturb_: {name} shape {tuple(t.shape)} != tensor shape "
                              f"{tuple(w.shape)}; pass a {name} of the parameter's shape")
    if src is not None and src.dtype != w.dtype:
        raise ConfigError(f"zo_perturb_: src dtype {src.dtype} != tensor dtype {w.dtype}")


def noise_backend(device: torch.device) -> str:
    """The backend a new run computing on ``device`` draws ``z`` from."""
    if device.type == "cuda":
        from ._library import triton_usable

        return TRITON if triton_usable(torch.empty(0, device=device)) else TORCH_CUDA
    return TORCH_CPU


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``backend`` as recorded (None: ``device``'s own; an older log's ``torch``: ``torch-cpu``),
    checked drawable on ``device``.

    Raises:
        ConfigError: an unknown backend, or one this machine cannot draw (a GPU run's ``triton``
            or ``torch-cuda`` noise replayed without CUDA).
    """
    if backend is None:
        return noise_backend(device)
    backend = _LEGACY.get(backend, backend)
    if backend not in BACKENDS:
        raise ConfigError(f"zeroth-order noise backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != TORCH_CPU and device.type != "cuda":
        raise ConfigError(f"this run drew its noise with {backend!r} on a GPU: resume or replay it on a CUDA "
                          f"device (this one is {device.type})")
    if backend == TRITON and noise_backend(device) != TRITON:
        raise ConfigError("this run drew its noise with Triton's Philox stream: resume or replay it where "
                          "triton is installed")
    return backend


def _reference(w: torch.Tensor, seed: int, scale: float, mask: torch.Tensor | None, src: torch.Tensor | None,
               draw: torch.device) -> None:
    """Chunked torch generator draws on ``draw`` (``w``'s device, or the CPU for ``torch-cpu``
    noise on another device: drawn there, scaled, then copied — the bits of a CPU run)."""
    flat_w = w.view(-1)
    flat_src = flat_w if src is None else src.contiguous().view(-1)
    flat_mask = None if mask is None else mask.contiguous().view(-1)
    gen = torch.Generator(device=draw)
    n = flat_w.numel()
    for c, start in enumerate(range(0, n, CHUNK)):
        stop = min(start + CHUNK, n)
        gen.manual_seed(zo_seed(seed, c))
        z = torch.randn(stop - start, generator=gen, device=draw, dtype=torch.float32)
        z.mul_(scale)  # d = fl32(scale * z): rounded once, identically on every path
        z = z.to(w.device)
        if flat_mask is not None:
            z.mul_(flat_mask[start:stop])  # exact: multiplies by 0 or 1
        d = z if w.dtype == torch.float32 else z.to(w.dtype)
        torch.add(flat_src[start:stop], d, out=flat_w[start:stop])


@torch.library.custom_op("outcore::zo_perturb_", mutates_args=("w",))
def _zo_perturb_op(w: torch.Tensor, seed: int, scale: float, mask: torch.Tensor | None,
                   src: torch.Tensor | None) -> None:
    """Reference implementation (any device): chunked torch generator draws on ``w``'s device."""
    _reference(w, seed, scale, mask, src, w.device)


@_zo_perturb_op.register_fake
def _(w, seed, scale, mask, src) -> None:  # fake impl: shapes only, nothing to return
    return None


def _triton_impl():
    from .zo_perturb_triton import zo_perturb_triton_

    return zo_perturb_triton_


_maybe_register_triton = cuda_kernel_registrar(_zo_perturb_op, _triton_impl)


def zo_perturb_(w: torch.Tensor, seed: int, scale: float, mask: torch.Tensor | None = None,
                src: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Set ``w = src + scale * z(seed) * mask`` in place (``src`` defaults to ``w``).

    Args:
        w: the tensor to write, any shape, contiguous, floating point.
        seed: the tensor's seed (``zo_seed(sample_seed, param_index)``).
        scale: multiplier of z (``+eps``/``-eps`` to perturb, ``-lr*g/n`` to update).
        mask: optional tensor of ``w``'s shape, 0/1 (bool or float): entries with 0
            keep ``src``'s value (Sparse MeZO).
        src: optional clean tensor of ``w``'s shape and dtype; the result is computed
            from it, so ``w`` can be a scratch copy and ``src`` stays untouched.
        backend: where ``z`` is drawn (see the module doc; None: ``w``'s device's own).

    Returns:
        ``w``.

    Raises:
        ConfigError: a non-float or non-contiguous ``w``, a negative seed, or a
            mask/src of another shape or dtype.
    """
    _check(w, seed, mask, src)
    backend = resolve_backend(backend, w.device)
    if backend == TRITON:
        _maybe_register_triton()
        torch.ops.outcore.zo_perturb_(w, int(seed), float(scale), mask, src)
    else:  # the reference itself: on CUDA the op dispatches to Triton
        _reference(w, int(seed), float(scale), mask, src, torch.device("cpu" if backend == TORCH_CPU else w.device))
    return w


def zo_noise(shape: tuple[int, ...] | torch.Size, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Materialize z(seed) for ``shape`` (tests and diagnostics; the trainers never do).

    Args:
        shape: tensor shape.
        seed: the tensor's seed.
        device: where to draw it.

    Returns:
        A float32 tensor of ``shape`` equal to what :func:`zo_perturb_` adds with scale 1.
    """
    out = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
    return zo_perturb_(out, seed, 1.0)
