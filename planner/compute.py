"""What a unit's compute costs on this machine, timed on a real block and a real head.

The plan's compute time is FLOPs over a rate. A square matmul's rate alone misses what
a step does besides matmuls (attention's softmax, the norms, rotary, SiLU, residual
adds, the loss's softmax over the vocabulary) and the smaller matmuls' lower rate: on
2 CPU cores (2026-11-24) a SmolLM2-135M block's forward + backward took 1.28x its
matmul FLOPs at the 1024-square rate and its head's chunked loss 1.45x, so the plan
under-estimated the step by ~27%. Here the plan times what the engine runs, in the
compute dtype, once per shape and process (2 cores: ~1 s for SmolLM2-135M, ~5 s for the
1.7B shape):

* a block: ``transformers``' ``LlamaDecoderLayer`` (SDPA attention, SwiGLU MLP) with the
  model's widths, forward + backward over one sequence of the run's length (at most
  ``MAX_TOKENS``);
* the head: ``kernels.causal_lm_loss`` (the chunked linear + cross-entropy the engine's
  loss runs) forward + backward over the same tokens.

Each gives a FLOP rate (the unit's ``forward_flops_per_token`` count over its measured
time) that the plan applies to every unit of that kind. A block larger than
``MAX_MEASURED_PARAMS`` is timed at a narrower width (fewer heads, a narrower MLP): wider
matmuls run at least as fast, so the estimate errs slow. A head larger than
``MAX_MEASURED_HEAD_PARAMS`` is timed on fewer vocabulary rows at the whole vocabulary's
chunk of tokens. With these rates the step estimate came within 0-14% of the measured
median on SmolLM2-135M and the 1.7B shape (``bench_step.py``, 2026-11-24), from 25-29% short.
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..offload.device import synchronize_device
from .sizes import ModelSpec

#: tokens one measurement runs: enough for steady GEMM shapes
MAX_TOKENS = 512
#: the widest block timed (parameters): an 8B block is timed at ~1/2 its width
MAX_MEASURED_PARAMS = 48 << 20
#: the largest head timed (parameters): its rate per FLOP falls as the vocabulary grows (a
#: 49k x 2048 head ran at ~80 GFLOP/s, 24k rows of it at ~125 on 2 cores), so only an
#: 8B-sized head is cut
MAX_MEASURED_HEAD_PARAMS = 128 << 20
_LONG_RUN_S = 0.25  # a run this long is timed once (after its warm-up)
#: parameters one CPU optimizer-update measurement steps: two matrices of the model's MLP
#: shape, cut to this (16 M: its state and weights well out of the last-level cache)
UPDATE_MEASURED_PARAMS = 16 << 20


@dataclass(frozen=True)
class ComputeRates:
    """Sustained FLOP/s per unit kind (``forward_flops_per_token`` FLOPs per second)."""

    block: float
    head: float
    matmul: float  # any other unit: a square matmul's rate

    def of(self, kind: str) -> float:
        """The rate of a unit of ``kind`` (``block`` | ``head`` | ``embed``)."""
        return {"block": self.block, "head": self.head}.get(kind, self.matmul)


def measure_compute_rates(spec: ModelSpec, dtype: torch.dtype, seq_len: int, device_kind: str,
                          matmul: float) -> ComputeRates:
    """Time one block and one head of ``spec``'s shape forward + backward (see the module doc).

    Args:
        spec: the model's dimensions.
        dtype: the compute dtype.
        seq_len: tokens per sequence of the run.
        device_kind: ``cpu`` or ``cuda``.
        matmul: the square-matmul rate, for units that are neither.

    Returns:
        The :class:`ComputeRates`.
    """
    tokens = max(2, min(seq_len, MAX_TOKENS))
    dims = (spec.hidden, spec.intermediate, spec.heads, spec.kv_heads, spec.head_dim)
    block = _block_rate(dims, dtype, tokens, device_kind) if spec.layers else matmul
    head = _head_rate(spec.vocab, spec.hidden, dtype, tokens, device_kind)
    return ComputeRates(block=block, head=head, matmul=matmul)


def measure_update_rate(spec: ModelSpec, optim: str, optim_args: Mapping[str, Any] | None,
                        precision: str) -> float:
    """Parameters per second of a full fine-tune's CPU optimizer update, timed here.

    The optimizer ``optim`` (with ``optim_args``, in ``precision``: bf16 weights for
    ``bf16-lean``, else the fp32 ones a run updates, its masters under a 16-bit dtype) steps
    two matrices of ``spec``'s MLP shape, ``UPDATE_MEASURED_PARAMS`` in all, on all of torch's
    threads: the 8-bit and low-rank updates are bound by their arithmetic, not by RAM
    bandwidth, so the plan takes their rate from here rather than from bytes moved. Once per
    shape, optimizer and precision in a process (2026-11-27, 2 cores: ~0.25 s for the 8B
    shape's AdamW8bit or AdamW, 6.3 s for GaLore, whose warm-up step runs its SVDs; the first
    use of the CPU extension builds it, ~20 s, as the run would).
    """
    args = tuple(sorted((optim_args or {}).items()))
    key = (spec.hidden, spec.intermediate, optim, repr(args), precision)
    if key not in _UPDATE_RATES:
        _UPDATE_RATES[key] = _update_rate(spec.hidden, spec.intermediate, optim, dict(args), precision)
    return _UPDATE_RATES[key]


_UPDATE_RATES: dict[tuple, float] = {}


def _update_rate(hidden: int, intermediate: int, optim: str, optim_args: dict[str, Any], precision: str) -> float:
    from ..dtypes import BF16_LEAN
    from ..optim import build_optimizer, with_precision

    rows = max(1, min(intermediate, UPDATE_MEASURED_PARAMS // (2 * hidden)))
    dtype = torch.bfloat16 if precision == BF16_LEAN else torch.float32
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(rows, hidden, generator=g) * 0.02).to(dtype)) for _ in range(2)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    opt = with_precision(build_optimizer(optim, params, **optim_args), precision, seed=0)
    return sum(p.numel() for p in params) / _seconds(opt.step, torch.device("cpu"))


def _narrowed(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
              ) -> tuple[int, int, int, int]:
    """(intermediate, heads, kv_heads, hidden) of a block at most ``MAX_MEASURED_PARAMS``:
    the attention narrowed by whole key/value groups, the MLP in proportion."""
    params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    scale = min(1.0, math.sqrt(MAX_MEASURED_PARAMS / params))
    if scale == 1.0:
        return intermediate, heads, kv_heads, hidden
    group = heads // kv_heads
    kv = max(1, round(kv_heads * scale))
    width = kv * group * head_dim
    return max(1, round(intermediate * scale)), kv * group, kv, width


@functools.lru_cache(maxsize=None)
def _block_rate(dims: tuple[int, int, int, int, int], dtype: torch.dtype, tokens: int, device_kind: str) -> float:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hidden, intermediate, heads, kv_heads, head_dim = dims
    intermediate, heads, kv_heads, hidden = _narrowed(hidden, intermediate, heads, kv_heads, head_dim)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    device = torch.device(device_kind)
    layer = LlamaDecoderLayer(config, 0).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    rotary = LlamaRotaryEmbedding(config).to(device)(x, positions)

    def step() -> None:
        out = layer(x, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    matmul = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    forward = tokens * (2.0 * matmul + 2.0 * tokens * heads * head_dim)  # as forward_flops_per_token
    return 3.0 * forward / _seconds(step, device)


@functools.lru_cache(maxsize=None)
def _head_rate(vocab: int, hidden: int, dtype: torch.dtype, tokens: int, device_kind: str) -> float:
    from ..kernels.linear_cross_entropy import causal_lm_loss, default_chunk_size

    rows = max(1, min(vocab, MAX_MEASURED_HEAD_PARAMS // hidden))
    chunk = default_chunk_size(tokens, vocab)  # the whole vocabulary's chunk of tokens
    device = torch.device(device_kind)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=g, requires_grad=True)
    weight = (torch.randn(rows, hidden, device=device, dtype=dtype, generator=g) * hidden ** -0.5).requires_grad_()
    labels = torch.randint(0, rows, (1, tokens), device=device, generator=g)

    def step() -> None:
        causal_lm_loss(h, weight, labels, chunk_size=chunk).backward()

    return 3.0 * 2.0 * tokens * rows * hidden / _seconds(step, device)


def _seconds(step, device: torch.device) -> float:
    """The median time of ``step`` (forward + backward, or an update) over 3 runs after one warm-up; one
    run when it takes longer than ``_LONG_RUN_S`` (a wide block: seconds per run)."""
    step()
    synchronize_device(device)
    times: list[float] = []
    while len(times) < 3 and not (times and times[0] > _LONG_RUN_S):
        t0 = time.perf_counter()
        step()
        synchronize_device(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
