"""AdamW with block-wise 8-bit moments (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2022), on the outcore contract.

Per parameter with at least ``min_8bit_size`` (4096) elements the state is

    step      ()          float32
    m_codes   (numel,)    uint8    first moment: E4M3, or the signed dynamic map
    m_absmax  (nblocks,)  float32  one per 256 elements
    v_codes   (numel,)    uint8    second moment: E5M2, or the unsigned dynamic map
    v_absmax  (nblocks,)  float32

i.e. 2 + 8/256 bytes per parameter instead of AdamW's 8. ``state_format`` says what a code
means: ``"fp8"`` (default) FP8 values (E4M3 for ``m``, E5M2 for ``v``;
``kernels/quantize_fp8.py``), whose CPU update needs no table lookups, or ``"dynamic"``
bitsandbytes' dynamic maps: finer codes near each block's absmax (7 bits of mantissa against 3
and 2), ~0.7x the speed with AVX2. FP8's losses were as close to fp32 AdamW's or closer in every
convergence run (``docs/benchmarks.md``). Smaller tensors (norms, biases) keep fp32 ``exp_avg`` / ``exp_avg_sq`` and are
updated exactly like :class:`outcore.optim.AdamW` (their bytes do not matter, their precision does).

The update is the fused op ``outcore::adamw8bit_update`` (``kernels/adamw8bit.py``): the
C++ extension on CPU (AVX-512, AVX2 or scalar), Triton on CUDA (either state format) and the
pure-PyTorch reference elsewhere, bit-identical to each other. Parameters must be float32 (they are the master weights).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from ..kernels.adamw8bit import (DEFAULT_STATE_FORMAT, IMPLS, adamw8bit_update, adamw8bit_update_many,
                                 check_state_format, coefficients, init_codes)
from ..kernels.quantize import BLOCKSIZE, SMALL_TENSOR_NUMEL, num_blocks
from ._base import OutcoreOptimizer, StateSpec, check_hparams


class AdamW8bit(OutcoreOptimizer):
    """AdamW whose moments are stored in 8 bits, block-wise.

    Args:
        params: parameters or param-group dicts (float32).
        lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW` (decoupled decay).
        min_8bit_size: tensors with fewer elements keep fp32 moments.
        impl: "auto" (fastest available), "ref", "cpp" or "compile" (benchmarks, tests).
        state_format: "fp8" (default) or "dynamic" (see the module docstring); a param
            group's own, saved with it in ``state_dict()`` (a loaded state keeps the format its
            codes were written in, "dynamic" for states saved before the formats existed).

    Raises:
        ValueError: a hyper-parameter is out of range, or ``impl`` / ``state_format`` is unknown.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = SMALL_TENSOR_NUMEL,
                 impl: str = "auto", state_format: str = DEFAULT_STATE_FORMAT) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
        check_state_format(state_format)
        if min_8bit_size < 1:
            raise ValueError(f"min_8bit_size={min_8bit_size} must be >= 1")
        self.impl = impl
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      min_8bit_size=min_8bit_size, state_format=state_format))

    @staticmethod
    def is_8bit(p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p``'s moments are quantized (else fp32)."""
        return p.numel() >= group["min_8bit_size"]

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """See the module docstring."""
        if p.dtype != torch.float32:
            raise ValueError(f"AdamW8bit needs float32 parameters (master weights), got {p.dtype} "
                             f"for a tensor of shape {tuple(p.shape)}")
        step = {"step": (torch.Size([]), torch.float32)}
        if not self.is_8bit(p, group):
            return {**step, "exp_avg": (p.shape, p.dtype), "exp_avg_sq": (p.shape, p.dtype)}
        n, nb = p.numel(), num_blocks(p.numel())
        return {**step, "m_codes": (torch.Size([n]), torch.uint8),
                "m_absmax": (torch.Size([nb]), torch.float32),
                "v_codes": (torch.Size([n]), torch.uint8),
                "v_absmax": (torch.Size([nb]), torch.float32)}

    def elementwise_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, int]:
        """Element-wise: codes line up with ``p``, one absmax per 256-element block (pieces
        start on block boundaries), one step count per tensor."""
        if not self.is_8bit(p, group):
            return {"step": 0, "exp_avg": 1, "exp_avg_sq": 1}
        return {"step": 0, "m_codes": 1, "m_absmax": BLOCKSIZE, "v_codes": 1, "v_absmax": BLOCKSIZE}

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """Zero moments: codes set to the format's code of 0 (the dynamic maps': not code 0)."""
        state = super().init_state(p, group)
        if "m_codes" in state:
            state["m_codes"] = init_codes(p.numel(), True, p.device, group["state_format"])
            state["v_codes"] = init_codes(p.numel(), False, p.device, group["state_format"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`OutcoreOptimizer.load_state_dict`; a group saved before ``state_format``
        existed holds dynamic-map codes."""
        groups = [{"state_format": "dynamic", **g} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    def _update_many_cpu(self, params: list[Tensor], grads: list[Tensor],
                         states: list[dict[str, Tensor]], group: dict[str, Any],
                         lean: list[tuple[int, int]] | None = None) -> bool:
        """All 8-bit tensors in one C++ call (CPU, impl auto/cpp; one tensor too: the direct call
        skips the custom op's dispatch, ~50 us); bf16 weights and gradients with ``lean`` (see
        :meth:`update_lean`). False if not applicable."""
        if self.impl not in ("auto", "cpp"):
            return False
        dtype = torch.float32 if lean is None else torch.bfloat16
        if not all(p.device.type == "cpu" and p.is_contiguous() and p.dtype == dtype and g.device.type == "cpu"
                   and g.dtype == dtype and g.shape == p.shape for p, g in zip(params, grads)):
            return False
        beta1, beta2 = group["betas"]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        by_step: dict[float, Any] = {}  # tensors usually share their step count
        coeffs = []
        for t in steps:
            k = float(t.item())
            if k not in by_step:
                by_step[k] = coefficients(group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], k)
            coeffs.append(by_step[k])
        # any shape will do (the kernel reads numel and data); no per-tensor view objects
        flat = [g if g.is_contiguous() else g.contiguous() for g in grads]
        done = adamw8bit_update_many(params, flat,
                                     [s["m_codes"] for s in states], [s["m_absmax"] for s in states],
                                     [s["v_codes"] for s in states], [s["v_absmax"] for s in states],
                                     coeffs, lean, group["state_format"])
        if not done:
            torch._foreach_sub_(steps, 1)  # the per-tensor path counts again
            if self.impl == "cpp":
                raise ValueError("impl='cpp' needs a buildable C++ extension "
                                 "(unset OUTCORE_NO_CPP_EXT, install a C++ compiler)")
        return done

    def update_lean(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
                    group: dict[str, Any], rounding: list[tuple[int, int]]) -> list[bool]:
        """The 8-bit tensors on CPU in one C++ call that widens, updates and rounds a few
        blocks at a time in L1 (``kernels/adamw8bit.py: adamw8bit_update_many``); the fp32-state
        ones and other devices are left to :class:`~outcore.optim.LeanOptimizer`'s chunks."""
        big = [i for i, s in enumerate(states) if "exp_avg" not in s]
        done = [False] * len(params)
        if big and self._update_many_cpu([params[i] for i in big], [grads[i] for i in big],
                                         [states[i] for i in big], group, [rounding[i] for i in big]):
            for i in big:
                done[i] = True
        return done

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """8-bit update of the large tensors, fused fp32 AdamW of the small ones."""
        beta1, beta2 = group["betas"]
        small = [i for i, s in enumerate(states) if "exp_avg" in s]
        big = [i for i, s in enumerate(states) if "exp_avg" not in s]
        if big and not self._update_many_cpu([params[i] for i in big], [grads[i] for i in big],
                                             [states[i] for i in big], group):
            for i in big:
                p, g, s = params[i], grads[i], states[i]
                s["step"].add_(1)
                # .item() of a CPU tensor is free; on CUDA this is a sync point, once per
                # tensor (the step count must reach the kernel as a scalar).
                adamw8bit_update(p, g, s["m_codes"], s["m_absmax"], s["v_codes"], s["v_absmax"],
                                 lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                 weight_decay=group["weight_decay"], step=float(s["step"].item()),
                                 impl=self.impl, state_format=group["state_format"])
        if small:
            steps = [states[i]["step"] for i in small]
            torch._foreach_add_(steps, 1)
            # Each small tensor is microseconds of work, but the fused kernel opens one
            # parallel region per tensor: on CPU run them on one thread (same bits; on a
            # busy 2-core machine the regions' barrier waits were ~1000x the work).
            with _one_cpu_thread(params[small[0]].device.type == "cpu"):
                torch._fused_adamw_([params[i] for i in small], [grads[i] for i in small],
                                    [states[i]["exp_avg"] for i in small],
                                    [states[i]["exp_avg_sq"] for i in small], [], steps,
                                    lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], eps=group["eps"],
                                    amsgrad=False, maximize=False, grad_scale=None, found_inf=None)


@contextlib.contextmanager
def _one_cpu_thread(active: bool) -> Iterator[None]:
    """Intra-op parallelism off for the block (process-wide; restored on exit)."""
    threads = torch.get_num_threads()
    if not active or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
