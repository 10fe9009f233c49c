"""Shared helpers for outcore's ``torch.library`` ops and their Triton impls.

Every fused op in ``kernels/`` is declared once as ``outcore::<name>`` with
``torch.library.custom_op`` (schema + fake impl), has a pure-PyTorch reference
that serves CPU (and any device without a faster impl), and may register a
Triton impl for ``cuda`` (docs/architecture.md §9). This module holds the few
helpers those modules share; keep it tiny and stable.

Nothing here imports triton at module import time (docs/architecture.md §13).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from .._optional import is_triton_available, triton_interpret

NAMESPACE = "outcore"


def op_name(name: str) -> str:
    """The qualified name ``outcore::<name>`` of an op.

    Args:
        name: the op's bare name, e.g. ``"linear_cross_entropy_fwd"``.

    Returns:
        ``"outcore::" + name``.
    """
    return f"{NAMESPACE}::{name}"


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """True when ``import triton`` works (an installed but broken triton counts as absent).

    It imports triton (once; the answer is cached): for the moment a kernel is registered,
    never at import time. :func:`triton_usable` answers another question: whether a launch
    on given tensors can run here.
    """
    if not is_triton_available():
        return False
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no Triton here"
        return False
    return True


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on these tensors now.

    True when triton is installed and either every tensor is on CUDA (compiled
    kernels) or ``TRITON_INTERPRET=1`` is set and every tensor is on the CPU
    (Triton's interpreter, used by the tests on machines without a GPU).

    Args:
        *tensors: the tensors the kernel would read or write (at least one).

    Returns:
        True if a Triton launch on these tensors is possible.
    """
    if not tensors or not is_triton_available():
        return False
    kinds = {t.device.type for t in tensors}
    if kinds == {"cuda"}:
        return True
    return kinds == {"cpu"} and triton_interpret()


def pick_config(configs: Sequence[dict[str, Any]], default: dict[str, Any]) -> dict[str, Any]:
    """The launch config to use where ``triton.autotune`` is unavailable.

    ``triton.autotune`` does not work in the interpreter (it times kernels), so
    kernels carry an interpreter-safe default: large tiles, because the
    interpreter's cost grows with the number of programs.

    Args:
        configs: the candidate configs a CUDA build may autotune over.
        default: the config used under ``TRITON_INTERPRET=1``.

    Returns:
        ``default`` in the interpreter, else the first of ``configs`` (or ``default``).
    """
    if triton_interpret() or not configs:
        return dict(default)
    return dict(configs[0])


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cuda_kernel_registrar(op: Any, load: Callable[[], Callable[..., Any]]) -> Callable[[], None]:
    """A function that registers ``load()`` as ``op``'s CUDA kernel on its first call.

    Called before an op's first CUDA launch, never at import time: ``load`` imports the
    Triton module, and nothing is registered where ``import triton`` fails.

    Args:
        op: the ``torch.library.custom_op`` object.
        load: returns the Triton implementation (imports its module).

    Returns:
        The registering function (idempotent).
    """
    done: list[bool] = []

    def register() -> None:
        if done:
            return
        done.append(True)
        if triton_importable():
            op.register_kernel("cuda")(load())

    return register
