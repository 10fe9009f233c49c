#!/usr/bin/env python
"""Each fused kernel in kernels/ on a device, against its pure-PyTorch reference.

For every kernel: does the device's implementation keep the promise its module makes
(tests/kernels/ checks the same promises at small sizes), and how fast is it?

  kernel               promise on CUDA (Triton)                      bytes per element
  adamw8bit            bit-identical to the reference                16 (+16 per 256-block)
  quantize             bit-identical (codes and block absmax)         5 (+4 per block)
  dequantize           bit-identical                                  5 (+4 per block)
  stochastic_round     bit-identical (same hash bits per element)     6
  zo_perturb           deterministic, z ~ N(0, 1), masked entries     8
                       untouched; NOT the reference's bits (Triton
                       draws z from Philox, the reference from torch)
  lce_fp32, lce_bf16   chunked linear + cross-entropy, forward and backward, against the
                       full-logits F.cross_entropy: relative gradient error <= 1e-5 in fp32
                       (<= 1e-6 against the chunked reference, the Triton chunk kernel alone);
                       bf16: no stated bound, the errors are reported. Compute-bound: TFLOPS
                       (6 N H V per forward + backward) and the peak memory of each path.

On the CPU the public ops run the reference itself (AdamW8bit: the C++ extension, bit-identical
at every ISA level), so those rows say "skipped": nothing else to compare. ``--impl triton``
calls the Triton kernels directly, which on a CPU needs ``TRITON_INTERPRET=1`` (the
interpreter: correctness only, its times mean nothing).

Every check runs from the same state on both sides; the device result is also compared with
the *CPU* reference on a prefix of whole blocks (up to 4M elements), so "bit-identical"
holds across devices, as the gpu tests claim. Times: median of ``--repeats`` after
``--warmup`` (CUDA events on a GPU), GB/s = the bytes the kernel must move / median time.

Usage:
  python scripts/bench_kernels.py --device cuda --json          # hundreds of MiB per tensor
  python scripts/bench_kernels.py --device cpu --dry-run        # tiny shapes, seconds
  TRITON_INTERPRET=1 python scripts/bench_kernels.py --device cpu --impl triton --dry-run
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from _accel import (Device, add_device_argument, machine, peak_memory, reset_peak_memory,
                    resolve, summarize, synchronize, time_repeats, timer_name)
from outcore.cli.jsonout import emit_json, json_stdout

KERNELS = ("adamw8bit", "quantize", "dequantize", "stochastic_round", "zo_perturb", "lce_fp32", "lce_bf16")
BLOCK = 256  # elements per quantization block (kernels/quantize.py BLOCKSIZE)
CPU_CHECK_MAX = 1 << 22  # elements compared with the CPU reference (whole blocks)
# (tokens N, hidden H, vocab V): a 1.7B-shaped head (SmolLM2) in fp32, Llama-3-8B's in bf16
LCE_GPU = {"lce_fp32": (8192, 2048, 49152), "lce_bf16": (4096, 4096, 128256)}
LCE_CPU = {"lce_fp32": (1024, 256, 8192), "lce_bf16": (512, 256, 8192)}
LCE_DRY = {"lce_fp32": (256, 64, 1000), "lce_bf16": (128, 64, 2000)}


class Skip(Exception):
    """This kernel cannot be measured here (the reason is the message)."""


@dataclass
class Ctx:
    dev: Device
    impl: str  # "op" (the public op, as training calls it) or "triton" (the Triton entry point)
    n: int  # elements of the element-wise kernels
    lce: dict[str, tuple[int, int, int]]
    repeats: int
    warmup: int


# ---------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------
def randn(n: int, c: Ctx, seed: int) -> torch.Tensor:
    """n standard normals on the device (drawn there on CUDA: 64M values from the CPU take seconds)."""
    if c.dev.kind == "cuda":
        return torch.randn(n, device=c.dev.torch, generator=torch.Generator(c.dev.torch).manual_seed(seed))
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(c.dev.torch)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(view), b.view(view)
    return bool(torch.equal(a.cpu(), b.cpu())) if a.device != b.device else bool(torch.equal(a, b))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().to(a.device).double()).abs().max()) if a.numel() else 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    b = b.detach().to(a.device).double()
    return float((a.detach().double() - b).norm() / b.norm().clamp_min(1e-30))


def triton_runs(c: Ctx, t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t`` is possible (CUDA, or the CPU interpreter)."""
    from outcore.kernels._library import triton_usable

    return triton_usable(t)


def op_impl(c: Ctx, t: torch.Tensor) -> str:
    """What the public op runs on this device for tensors like ``t``."""
    if c.impl == "triton":
        if not triton_runs(c, t):
            raise Skip("--impl triton: Triton cannot launch here (needs CUDA, or TRITON_INTERPRET=1 on the CPU)")
        return "triton-interpreter" if c.dev.kind == "cpu" else "triton"
    if c.dev.kind == "cuda":
        return "triton" if triton_runs(c, t) else "reference (Triton is not usable here)"
    return "reference"


def timing(fn: Callable[[], Any], c: Ctx, nbytes: int | None) -> dict[str, Any]:
    times = time_repeats(fn, c.dev, c.repeats, c.warmup)
    out = summarize(times)
    if nbytes:
        out["bytes_moved"] = nbytes
        out["gb_per_s"] = nbytes / out["median_s"] / 1e9
    return out


def cpu_prefix_check(n: int) -> int:
    """Elements (whole 256-blocks) compared with the CPU reference."""
    return min(n, CPU_CHECK_MAX) // BLOCK * BLOCK or n


def verdict(impl: str, ok: bool, promise: str) -> dict[str, Any]:
    """Status of a kernel's check. The reference compared with itself proves nothing: skipped."""
    if impl.startswith("reference"):
        return {"status": "skipped", "reason": f"the device ran the reference itself ({impl}); nothing else to "
                                               f"compare", "promise": promise}
    return {"status": "ok" if ok else "failed", "promise": promise}


# ---------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------
def bench_adamw8bit(c: Ctx) -> dict[str, Any]:
    from outcore.kernels import adamw8bit as k
    from outcore.kernels.quantize import num_blocks

    n, dev = c.n, c.dev.torch
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    state = [randn(n, c, 1), k.init_codes(n, True, dev), torch.zeros(num_blocks(n), device=dev),
             k.init_codes(n, False, dev), torch.zeros(num_blocks(n), device=dev)]
    if c.impl == "triton" or c.dev.kind != "cpu":
        impl = op_impl(c, state[0])
    else:  # the CPU op is the C++ extension where it builds
        impl = f"cpp-{k.cpu_isa()}" if k.cpu_extension() is not None else "reference"
    promise = "bit-identical to the reference"  # every implementation, every CPU ISA level
    if c.impl == "triton":
        from outcore.kernels.adamw8bit_triton import adamw8bit_update_triton

        def run(st, g, t):
            adamw8bit_update_triton(st[0], g, *st[1:], k.coefficients(step=t, **hp), k.DEFAULT_STATE_FORMAT)
    else:
        def run(st, g, t):
            k.adamw8bit_update(st[0], g, *st[1:], step=t, impl="auto", **hp)

    m = cpu_prefix_check(n)
    steps = []
    for t in (1, 2, 3):  # each step from the same state on both sides; magnitudes change, absmax moves
        grad = randn(n, c, 100 + t) * 10.0 ** (t - 3)
        before = [x.clone() for x in state]
        run(state, grad, t)
        ref = [x.clone() for x in before]
        coeffs = k.coefficients(step=t, **hp)
        k.adamw8bit_update_ref(ref[0], grad, *ref[1:], coeffs)
        step = _adamw_compare(state, ref)
        if c.dev.kind != "cpu":  # the same step of the first m elements on the CPU reference
            cpu = [x.cpu().clone() for x in _prefix(before, m)]
            k.adamw8bit_update_ref(cpu[0], grad[:m].cpu(), *cpu[1:], coeffs)
            step["cpu_reference_bit_identical"] = all(bits_equal(a.cpu(), b) for a, b in zip(_prefix(state, m), cpu))
        steps.append(step)
        del before, ref
    ok = all(s["within_promise"] and s.get("cpu_reference_bit_identical", True) for s in steps)
    out = {"numel": n, "dtype": "float32 params and grads, uint8 moments", "impl": impl,
           **verdict(impl, ok, promise), "steps": steps, "cpu_checked_elements": m if c.dev.kind != "cpu" else None}
    grad = randn(n, c, 200)
    ref_state = [x.clone() for x in state]
    coeffs4 = k.coefficients(step=4, **hp)
    nbytes = 16 * n + 16 * num_blocks(n)  # p, g read; p written (4 B each); 2 x (code read + written); absmax
    out["time"] = timing(lambda: run(state, grad, 4), c, nbytes)
    out["reference_time"] = timing(lambda: k.adamw8bit_update_ref(ref_state[0], grad, *ref_state[1:], coeffs4),
                                   c, nbytes)
    out["speedup_vs_reference"] = out["reference_time"]["median_s"] / out["time"]["median_s"]
    return out


def _prefix(state: list[torch.Tensor], m: int) -> list[torch.Tensor]:
    """The first ``m`` elements (whole blocks) of an 8-bit AdamW state: blocks are independent."""
    return [x[:m] if i in (0, 1, 3) else x[: m // BLOCK] for i, x in enumerate(state)]


def _adamw_compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, Any]:
    """One step of the kernel against one step of the reference from the same state."""
    names = ("param", "m_codes", "m_absmax", "v_codes", "v_absmax")
    identical = {nm: bits_equal(a, b) for nm, a, b in zip(names, got, want)}
    codes_off = [float((a.int() - b.int()).abs().gt(0).float().mean()) for a, b in ((got[1], want[1]),
                                                                                   (got[3], want[3]))]
    out = {"bit_identical": all(identical.values()), "identical": identical,
           "param_max_abs_err": max_abs(got[0], want[0]), "code_mismatch_fraction": codes_off}
    out["within_promise"] = out["bit_identical"]
    return out


def bench_quantize(c: Ctx) -> dict[str, Any]:
    from outcore.kernels.quantize import _quantize_ref, dynamic_map, num_blocks, quantize_blockwise

    n = c.n
    x = randn(n, c, 3)
    impl = op_impl(c, x)
    if c.impl == "triton":
        from outcore.kernels.quantize_triton import quantize_blockwise_triton as quant
    else:
        def quant(x, qmap, blocksize=BLOCK):
            return quantize_blockwise(x, qmap, blocksize)
    checks = {}
    m = cpu_prefix_check(n)
    for signed, data in ((True, x), (False, x.abs())):  # Adam's m (signed map) and v (unsigned)
        qmap = dynamic_map(signed, c.dev.torch)
        got, want = quant(data, qmap, BLOCK), _quantize_ref(data, qmap, BLOCK)
        chk = {"bit_identical": bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]),
               "code_mismatches": int((got[0] != want[0]).sum()), "absmax_max_abs_err": max_abs(got[1], want[1])}
        if c.dev.kind != "cpu":
            cpu = _quantize_ref(data[:m].cpu(), dynamic_map(signed), BLOCK)
            chk["cpu_reference_bit_identical"] = (bits_equal(got[0][:m].cpu(), cpu[0])
                                                  and bits_equal(got[1][: m // BLOCK].cpu(), cpu[1]))
        checks["signed" if signed else "unsigned"] = chk
    ok = all(ch["bit_identical"] and ch.get("cpu_reference_bit_identical", True) for ch in checks.values())
    qmap = dynamic_map(True, c.dev.torch)
    nbytes = 4 * n + n + 4 * num_blocks(n)
    out = {"numel": n, "dtype": "float32 -> uint8 codes + float32 absmax per 256", "impl": impl,
           **verdict(impl, ok, "bit-identical to the reference"), "checks": checks,
           "cpu_checked_elements": m if c.dev.kind != "cpu" else None,
           "time": timing(lambda: quant(x, qmap, BLOCK), c, nbytes),
           "reference_time": timing(lambda: _quantize_ref(x, qmap, BLOCK), c, nbytes)}
    out["speedup_vs_reference"] = out["reference_time"]["median_s"] / out["time"]["median_s"]
    return out


def bench_dequantize(c: Ctx) -> dict[str, Any]:
    from outcore.kernels.quantize import _dequantize_ref, _quantize_ref, dequantize_blockwise, dynamic_map, num_blocks

    n = c.n
    qmap = dynamic_map(True, c.dev.torch)
    codes, absmax = _quantize_ref(randn(n, c, 4), qmap, BLOCK)
    impl = op_impl(c, codes)
    if c.impl == "triton":
        from outcore.kernels.quantize_triton import dequantize_blockwise_triton as deq
    else:
        def deq(codes, absmax, qmap, blocksize=BLOCK):
            return dequantize_blockwise(codes, absmax, qmap, blocksize)
    got, want = deq(codes, absmax, qmap, BLOCK), _dequantize_ref(codes, absmax, qmap, BLOCK)
    m = cpu_prefix_check(n)
    chk = {"bit_identical": bits_equal(got, want), "max_abs_err": max_abs(got, want)}
    if c.dev.kind != "cpu":
        cpu = _dequantize_ref(codes[:m].cpu(), absmax[: m // BLOCK].cpu(), dynamic_map(True), BLOCK)
        chk["cpu_reference_bit_identical"] = bits_equal(got[:m].cpu(), cpu)
    ok = chk["bit_identical"] and chk.get("cpu_reference_bit_identical", True)
    nbytes = n + 4 * num_blocks(n) + 4 * n
    out = {"numel": n, "dtype": "uint8 codes + float32 absmax -> float32", "impl": impl,
           **verdict(impl, ok, "bit-identical to the reference"), "checks": chk,
           "cpu_checked_elements": m if c.dev.kind != "cpu" else None,
           "time": timing(lambda: deq(codes, absmax, qmap, BLOCK), c, nbytes),
           "reference_time": timing(lambda: _dequantize_ref(codes, absmax, qmap, BLOCK), c, nbytes)}
    out["speedup_vs_reference"] = out["reference_time"]["median_s"] / out["time"]["median_s"]
    return out


def _sr_or_zo_impl(c: Ctx, t: torch.Tensor) -> str:
    """stochastic_round_ / zo_perturb_ register their Triton kernel for CUDA on first use."""
    if c.impl == "triton":
        return op_impl(c, t)
    if c.dev.kind == "cuda":
        from outcore.kernels._library import triton_importable

        return "triton" if triton_importable() else "reference (Triton is not usable here)"
    return "reference"


def bench_stochastic_round(c: Ctx) -> dict[str, Any]:
    from outcore.kernels import stochastic_round as sr

    n = c.n
    x = randn(n, c, 5) * 1e-2
    x[:4] = torch.tensor([float("nan"), float("inf"), -1e-40, -0.0])  # the special values keep their rules
    out, ref = (torch.empty(n, dtype=torch.bfloat16, device=c.dev.torch) for _ in range(2))
    key, offset = sr.round_key(1, 2, 3), 12345
    impl = _sr_or_zo_impl(c, x)
    if c.impl == "triton":
        from outcore.kernels.stochastic_round_triton import stochastic_round_triton_ as run
    else:
        run = sr.stochastic_round_
    reference = sr._stochastic_round_op._init_fn  # the op's pure-PyTorch body, on any device
    run(out, x, key, offset)
    reference(ref, x, key, offset)
    m = cpu_prefix_check(n)
    chk = {"bit_identical": bits_equal(out, ref),
           "mismatches": int((out.view(torch.int16) != ref.view(torch.int16)).sum())}
    if c.dev.kind != "cpu":
        cpu = torch.empty(m, dtype=torch.bfloat16)
        sr.stochastic_round_(cpu, x[:m].cpu(), key, offset)  # on the CPU the op is the reference
        chk["cpu_reference_bit_identical"] = bits_equal(out[:m].cpu(), cpu)
    ok = chk["bit_identical"] and chk.get("cpu_reference_bit_identical", True)
    nbytes = 4 * n + 2 * n
    res = {"numel": n, "dtype": "float32 -> bfloat16", "impl": impl,
           **verdict(impl, ok, "bit-identical to the reference (same hash bits per element index)"),
           "checks": chk, "cpu_checked_elements": m if c.dev.kind != "cpu" else None,
           "time": timing(lambda: run(out, x, key, offset), c, nbytes),
           "reference_time": timing(lambda: reference(ref, x, key, offset), c, nbytes)}
    res["speedup_vs_reference"] = res["reference_time"]["median_s"] / res["time"]["median_s"]
    return res


def bench_zo_perturb(c: Ctx) -> dict[str, Any]:
    from outcore.kernels import zo_perturb as zp

    n, seed, scale = c.n, 9, 0.5
    src = randn(n, c, 6)
    w, w2, w_ref = (torch.empty_like(src) for _ in range(3))
    impl = _sr_or_zo_impl(c, src)
    if c.impl == "triton":
        from outcore.kernels.zo_perturb_triton import zo_perturb_triton_

        def run(w, mask=None):
            zo_perturb_triton_(w, seed, scale, mask, src)
    else:
        def run(w, mask=None):
            zp.zo_perturb_(w, seed, scale, mask=mask, src=src)
    reference = zp._zo_perturb_op._init_fn
    run(w)
    run(w2)
    reference(w_ref, seed, scale, None, src)
    z = ((w.double() - src.double()) / scale)
    mean, std = float(z.mean()), float(z.std())
    mask = src.abs() < 0.5
    w_mask = torch.empty_like(src)
    run(w_mask, mask)
    chk = {"deterministic": bits_equal(w, w2),
           "z_mean": mean, "z_std": std,
           # 6 standard errors: a correct N(0, 1) fails this about once in 10^8 runs
           "z_is_standard_normal": abs(mean) < 6 / math.sqrt(n) and abs(std - 1) < 6 / math.sqrt(2 * n) + 1e-6,
           "masked_entries_untouched": bits_equal(w_mask[~mask], src[~mask]),
           "unmasked_entries_as_without_mask": bits_equal(w_mask[mask], w[mask]),
           "reference_bits": bits_equal(w, w_ref), "max_abs_diff_vs_reference": max_abs(w, w_ref)}
    ok = all(chk[k] for k in ("deterministic", "z_is_standard_normal", "masked_entries_untouched",
                              "unmasked_entries_as_without_mask"))
    promise = ("deterministic per backend, z ~ N(0, 1), masked entries untouched; not the reference's bits "
               "(Triton draws z from Philox, the reference from torch's generator)")
    nbytes = 8 * n
    res = {"numel": n, "dtype": "float32", "impl": impl, **verdict(impl, ok, promise), "checks": chk,
           "time": timing(lambda: run(w), c, nbytes),
           "reference_time": timing(lambda: reference(w_ref, seed, scale, None, src), c, nbytes)}
    res["speedup_vs_reference"] = res["reference_time"]["median_s"] / res["time"]["median_s"]
    return res


def bench_lce(c: Ctx, name: str) -> dict[str, Any]:
    from outcore.kernels import linear_cross_entropy as lce

    dtype = torch.float32 if name == "lce_fp32" else torch.bfloat16
    n, hdim, vocab = c.lce[name]
    h = randn(n * hdim, c, 7).view(n, hdim).to(dtype).requires_grad_()
    w = (randn(vocab * hdim, c, 8).view(vocab, hdim) * hdim ** -0.5).to(dtype).requires_grad_()
    t = (randn(n, c, 9).abs() * vocab / 4).long().clamp_(0, vocab - 1)  # skewed ids, as text's are
    t[::9] = -100  # ignored rows
    impl = op_impl(c, h)
    chunk = lce.default_chunk_size(n, vocab)

    def chunked(ce_chunk):
        loss, dh, dw, _ = lce._fwd_impl(h.detach(), w.detach(), t, None, -100, 0.0, lce.REDUCTIONS["mean"], chunk,
                                        True, True, False, ce_chunk)
        return loss, dh, dw

    if c.impl == "triton":
        from outcore.kernels.linear_cross_entropy_triton import ce_chunk_triton

        def ours():
            return chunked(ce_chunk_triton)
    else:
        def ours():  # the public op and its autograd, as training calls it
            loss = lce.linear_cross_entropy(h, w, t)
            return (loss.detach(), *torch.autograd.grad(loss, [h, w]))

    def full():  # HF's way: all [N, V] logits, upcast to fp32
        loss = F.cross_entropy((h @ w.T).float(), t)
        return (loss.detach(), *torch.autograd.grad(loss, [h, w]))

    got, want, chunk_ref = ours(), full(), chunked(lce.ce_chunk_reference)
    chk = {"loss": float(got[0]), "loss_abs_err_vs_full": abs(float(got[0]) - float(want[0])),
           "d_hidden_rel_err_vs_full": rel_err(got[1], want[1]), "d_weight_rel_err_vs_full": rel_err(got[2], want[2]),
           "d_hidden_max_abs_err_vs_full": max_abs(got[1], want[1]),
           "d_weight_max_abs_err_vs_full": max_abs(got[2], want[2]),
           "d_hidden_rel_err_vs_chunked_reference": rel_err(got[1], chunk_ref[1]),
           "d_weight_rel_err_vs_chunked_reference": rel_err(got[2], chunk_ref[2])}
    finite = all(bool(torch.isfinite(x).all()) for x in got)
    if dtype == torch.float32:
        promise = "fp32: gradients within 1e-5 relative of the full-logits loss, 1e-6 of the chunked reference"
        ok = finite and chk["loss_abs_err_vs_full"] <= 1e-5 * max(1.0, abs(float(want[0]))) and max(
            chk["d_hidden_rel_err_vs_full"], chk["d_weight_rel_err_vs_full"]) <= 1e-5 and max(
            chk["d_hidden_rel_err_vs_chunked_reference"], chk["d_weight_rel_err_vs_chunked_reference"]) <= 1e-6
    else:
        promise = "bf16: no stated bound; errors reported (a finite result is the check)"
        ok = finite
    del got, want, chunk_ref
    flops = 6 * n * hdim * vocab  # forward logits, d_hidden, d_weight: three N x H x V matmuls
    nbytes = (2 * n * hdim + 2 * vocab * hdim) * h.element_size()  # read h, w; write dh, dw (the minimum)
    res = {"shape": {"tokens": n, "hidden": hdim, "vocab": vocab}, "dtype": str(dtype).replace("torch.", ""),
           "chunk_rows": chunk, "impl": impl, **verdict(impl, ok, promise), "checks": chk}
    for key, fn in (("time", ours), ("reference_time", full)):
        synchronize(c.dev)
        reset_peak_memory(c.dev)
        base = torch.cuda.memory_allocated(c.dev.torch) if c.dev.kind == "cuda" else 0
        res[key] = timing(fn, c, nbytes)
        res[key]["tflops"] = flops / res[key]["median_s"] / 1e12
        peak = peak_memory(c.dev)["max_allocated_bytes"]
        res[key]["peak_extra_bytes"] = None if peak is None else peak - base
    res["speedup_vs_reference"] = res["reference_time"]["median_s"] / res["time"]["median_s"]
    res["reference"] = "F.cross_entropy of the full [N, V] logits (upcast to fp32), autograd"
    return res


BENCH: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "adamw8bit": bench_adamw8bit, "quantize": bench_quantize, "dequantize": bench_dequantize,
    "stochastic_round": bench_stochastic_round, "zo_perturb": bench_zo_perturb,
    "lce_fp32": lambda c: bench_lce(c, "lce_fp32"), "lce_bf16": lambda c: bench_lce(c, "lce_bf16"),
}


def overall(results: dict[str, dict[str, Any]]) -> str:
    """passed: every kernel kept its promise; failed: one broke it or errored; partial: some were
    skipped (nothing to compare, or not measurable here), the rest passed; skipped: none ran."""
    statuses = [r.get("status") for r in results.values()]
    if any(s in ("failed", "error") for s in statuses):
        return "failed"
    if statuses and all(s == "ok" for s in statuses):
        return "passed"
    return "partial" if "ok" in statuses else "skipped"


def run_all(c: Ctx, names: list[str], results: dict[str, dict[str, Any]], log: Callable[[str], None]) -> None:
    for name in names:
        log(f"[bench_kernels] {name} ...")
        try:
            results[name] = BENCH[name](c)
        except Skip as exc:
            results[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one kernel's failure must not hide the others
            results[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        finally:
            if c.dev.kind == "cuda":
                torch.cuda.empty_cache()  # each kernel starts from an empty cache: its peak is its own
        log(f"[bench_kernels] {name}: {results[name]['status']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_argument(p)
    p.add_argument("--impl", choices=("op", "triton"), default="op",
                   help="op: the public ops as training calls them (Triton on CUDA, the reference or C++ on the "
                        "CPU); triton: the Triton entry points directly (on a CPU only with TRITON_INTERPRET=1)")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(KERNELS))
    p.add_argument("--numel", type=int, default=0, help="elements of the element-wise kernels (default: 64Mi on "
                   "CUDA, 4Mi on sim/cpu, 256Ki with --dry-run, 64Ki in the Triton interpreter)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (default 10; 3 with --dry-run)")
    p.add_argument("--warmup", type=int, default=-1, help="untimed repeats first (default 2; 1 with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes and few repeats: tests the script")
    p.add_argument("--json", action="store_true", help="print one JSON object (and nothing else) on stdout")
    args = p.parse_args(argv)
    args.only = [k.strip() for k in args.only.split(",") if k.strip()] or list(KERNELS)
    bad = [k for k in args.only if k not in KERNELS]
    if bad:
        p.error(f"unknown kernel {bad[0]!r}; choose from {', '.join(KERNELS)}")
    if args.numel < 0 or args.repeats < 0:
        p.error("--numel and --repeats must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    contextlib.ExitStack().enter_context(json_stdout(args.json))  # library chatter to stderr, to the end
    dev = resolve(args.device)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    small = args.dry_run or dev.kind != "cuda"
    numel = args.numel or (1 << 16 if interp else 1 << 18 if args.dry_run else 1 << 22 if small else 1 << 26)
    lce = LCE_DRY if (args.dry_run or interp) else LCE_CPU if small else LCE_GPU
    c = Ctx(dev, args.impl, numel, lce, args.repeats or (3 if args.dry_run else 10),
            args.warmup if args.warmup >= 0 else (1 if args.dry_run else 2))
    torch.set_num_threads(os.cpu_count() or 1)
    report: dict[str, Any] = {
        "script": "bench_kernels", "device": dev.describe(), "impl": args.impl, "dry_run": args.dry_run,
        "triton_interpret": interp, "numel": numel, "repeats": c.repeats, "warmup": c.warmup,
        "timer": timer_name(dev), "machine": machine(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        # another job on this machine while it ran (the GPU proof names its background builds)
        "concurrent_load": os.environ.get("PROOF_BACKGROUND") or None,
    }
    results: dict[str, dict[str, Any]] = {}

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    try:
        run_all(c, args.only, results, log)
        report["status"] = overall(results)
    except KeyboardInterrupt:  # the proof's stage timeout (SIGINT): keep what finished
        report["status"] = "interrupted"
        for name in args.only:
            results.setdefault(name, {"status": "not_run", "reason": "interrupted (stage timeout)"})
    report["kernels"] = results
    if args.json:
        emit_json(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["status"] in ("passed", "partial", "skipped") else 1


def print_table(r: dict[str, Any]) -> None:
    d = r["device"]
    print(f"device {d['used']} ({d.get('name') or d['torch_device']}), impl={r['impl']}, {r['numel']} elements, "
          f"median of {r['repeats']} after {r['warmup']} warm-up ({r['timer']})"
          + (f"; fallback: {d['fallback']}" if d["fallback"] else ""))
    print(f"{'kernel':<18}{'status':<9}{'impl':<20}{'median ms':>10}{'GB/s':>8}{'TFLOPS':>8}{'ref ms':>9}{'x ref':>7}")
    for name, k in r["kernels"].items():
        t, rt = k.get("time") or {}, k.get("reference_time") or {}
        ms = f"{t['median_s'] * 1e3:.3f}" if t else "-"
        rms = f"{rt['median_s'] * 1e3:.3f}" if rt else "-"
        gbs = f"{t['gb_per_s']:.1f}" if t.get("gb_per_s") and not t.get("tflops") else "-"
        tfl = f"{t['tflops']:.1f}" if t.get("tflops") else "-"
        sp = f"{k['speedup_vs_reference']:.2f}" if k.get("speedup_vs_reference") else "-"
        print(f"{name:<18}{k['status']:<9}{k.get('impl', '-')[:19]:<20}{ms:>10}{gbs:>8}{tfl:>8}{rms:>9}{sp:>7}")
        if k.get("reason") or k.get("error"):
            print(f"  {k.get('reason') or k.get('error')}")
    print(f"overall: {r['status']}")


if __name__ == "__main__":
    sys.exit(main())
