"""Block-wise 8-bit dynamic quantization (the 8-bit optimizers paper, Dettmers et al. 2022).

A tensor is cut into blocks of ``BLOCKSIZE`` (256) consecutive elements; each block
keeps its absolute maximum in fp32 and every element becomes the index (``uint8``) of
the nearest value of a 256-entry *dynamic quantile map* after division by that
absmax. The maps are bitsandbytes' ``create_dynamic_map``: a decimal exponent
(1e-6 ... 1) followed by a linear fraction, ``signed`` for Adam's first moment,
unsigned (twice the resolution, no sign) for the second.

Exact definitions (the CPU extension and the Triton kernels reproduce them bit for bit):

* ``inv = 1 / absmax`` per block (``1`` where the block is all zeros),
* ``y = x * inv``; ``code = #{k : t[k] < y}`` with ``t[k] = (map[k] + map[k+1]) / 2``
  (fp32), i.e. round to nearest map entry, ties to the lower one,
* ``dequantize(code) = map[code] * absmax``.

A fast path does not binary-search ``t``: :func:`bucket_table` maps the sign and top 16
bits of ``y``'s fp32 pattern (:func:`bucket_index`) to the count of thresholds below that
bucket; one comparison with the next threshold finishes the job, because no bucket holds
two thresholds (checked when the table is built).

Ops (``torch.library``): ``outcore::quantize_blockwise`` and
``outcore::dequantize_blockwise``, with fake impls, the reference for CPU and a Triton
impl for CUDA (``kernels/quantize_triton.py``).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._library import op_name, triton_usable

BLOCKSIZE = 256  # elements per quantization block (one fp32 absmax each)
SMALL_TENSOR_NUMEL = 4096  # tensors with fewer elements keep fp32 optimizer state


# ---------------------------------------------------------------------------------
# The maps and their lookup tables
# ---------------------------------------------------------------------------------
def _linspace(n: int) -> Tensor:
    """``torch.linspace(0.1, 1, n)`` in fp32 as torch's vectorized CPU kernel computes it (x86
    with AVX2 or AVX-512: ``start + step * i`` below the middle, ``end - step * (n - 1 - i)``
    from it, each one FMA, one rounding), whatever the host runs. Its scalar kernel (torch's
    ``default`` capability; other CPUs) rounds the product first: 42 of the signed map's 256
    values and 31 of the unsigned one's came out 1-2 ulps apart, so codes written on one host
    decoded to other values on the other."""
    start, end = torch.tensor(0.1, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32)
    step = ((end - start) / (n - 1)).double()  # fp32 division, as torch's
    i = torch.arange(n, dtype=torch.float64)
    # both exact in float64 (<= 32 significant bits): the cast is the FMA's one rounding
    below, above = start.double() + step * i, end.double() - step * (n - 1 - i)
    return torch.where(i < n // 2, below, above).float()


@functools.lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> Tensor:
    data: list[float] = []
    for i in range(7):  # decimal exponents 1e-6 ... 1e0
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = _linspace(items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()  # fp32 products, as bitsandbytes rounds them
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def dynamic_map(signed: bool = True, device: torch.device | str = "cpu") -> Tensor:
    """The 256-entry dynamic quantile map, sorted ascending: bitsandbytes' values on x86
    (AVX2 and up), and the same on every host (see :func:`_linspace`).

    Args:
        signed: True for values in [-1, 1] (Adam's first moment), False for [0, 1]
            (the second moment; twice the resolution).
        device: where the map tensor lives.

    Returns:
        (256,) float32 tensor.
    """
    return _dynamic_map_cpu(bool(signed)).to(device)


def thresholds(qmap: Tensor) -> Tensor:
    """Midpoints between neighbouring map entries, the rounding boundaries.

    Args:
        qmap: (256,) sorted float32 map.

    Returns:
        (256,) float32: ``t[k] = (qmap[k] + qmap[k+1]) / 2`` for k < 255 and ``t[255] = +inf``
        (a sentinel so that ``code + (y > t[code])`` never leaves [0, 255]).
    """
    _check_map(qmap)
    t = torch.empty(256, dtype=torch.float32, device=qmap.device)
    t[:255] = (qmap[:-1] + qmap[1:]) / 2
    t[255] = float("inf")
    return t


# The bucket index of a normalized value y: its sign and the top 16 bits of |y|'s fp32
# pattern (8 exponent + 7 mantissa bits), clamped to the binades [2^-27, 2): every map
# threshold lies in between (the smallest is ~1.6e-7 ~ 2^-22.6), so clamping is exact.
BUCKET_BITS_MIN = 100 << 7  # (|y| bits >> 16) of 2^-27 (biased exponent 100)
BUCKET_BITS_MAX = (128 << 7) - 1  # ... of the largest float below 2.0
BUCKETS_PER_SIGN = BUCKET_BITS_MAX - BUCKET_BITS_MIN + 1  # 3584


def bucket_index(y: Tensor) -> Tensor:
    """Bucket of each normalized value (the formula the C++ and Triton kernels use).

    Args:
        y: any shape, float32.

    Returns:
        int64 tensor of y's shape in [0, 2 * BUCKETS_PER_SIGN).
    """
    bits = y.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = ((bits & 0x7FFFFFFF) >> 16).clamp(BUCKET_BITS_MIN, BUCKET_BITS_MAX) - BUCKET_BITS_MIN
    return mag + (bits >> 31) * BUCKETS_PER_SIGN


@functools.lru_cache(maxsize=None)
def _bucket_table_cpu(signed: bool) -> Tensor:
    t = thresholds(_dynamic_map_cpu(signed))
    k = torch.arange(BUCKETS_PER_SIGN, dtype=torch.int64)
    lo = ((k + BUCKET_BITS_MIN) << 16).to(torch.int32).view(torch.float32)
    hi = (((k + BUCKET_BITS_MIN) << 16) | 0xFFFF).to(torch.int32).view(torch.float32)
    lo[0], hi[-1] = 0.0, float("inf")  # clamped ends cover everything below / above
    a = torch.cat([lo, -hi])  # each bucket's value range [a, b]: positives, then negatives
    b = torch.cat([hi, -lo])
    codes = torch.searchsorted(t[:255].contiguous(), a, side="left")  # thresholds < a
    nxt = t[(codes + 1).clamp_max(255)]
    if not bool(((codes >= 254) | (nxt >= b)).all()):  # pragma: no cover - checked once
        raise AssertionError("a quantization bucket holds two thresholds")
    return codes.to(torch.uint8)


def bucket_table(signed: bool = True, device: torch.device | str = "cpu") -> Tensor:
    """Lookup table from :func:`bucket_index` to a first-guess code.

    ``code(y) = table[bucket_index(y)] + (y > t[table[...]])`` equals the reference's
    ``searchsorted(t, y)``: the table holds the number of thresholds below each bucket's
    lowest value, and no bucket holds two thresholds (checked when the table is built).

    Args:
        signed: which dynamic map.
        device: where the table lives.

    Returns:
        (2 * BUCKETS_PER_SIGN,) uint8 (7 KiB: stays in L1 cache).
    """
    return _bucket_table_cpu(bool(signed)).to(device)


def quantize_with_table(y: Tensor, table: Tensor, thr: Tensor) -> Tensor:
    """Codes of normalized values by the table method (for tests and as documentation).

    Args:
        y: any shape, float32 (already divided by the block absmax).
        table: from :func:`bucket_table`.   thr: (256,) from :func:`thresholds`.

    Returns:
        uint8 codes of y's shape.
    """
    c = table[bucket_index(y)].long()
    return (c + (y > thr[c]).long()).to(torch.uint8)


# ---------------------------------------------------------------------------------
# Reference implementation (pure PyTorch; defines the numerics)
# ---------------------------------------------------------------------------------
def num_blocks(numel: int, blocksize: int = BLOCKSIZE) -> int:
    """Number of quantization blocks of a tensor with ``numel`` elements."""
    return (int(numel) + blocksize - 1) // blocksize


def blocks_view(x: Tensor, blocksize: int = BLOCKSIZE) -> Tensor:
    """``x`` flattened, zero-padded to whole blocks and viewed as (nblocks, blocksize).

    Args:
        x: any shape; float.
        blocksize: elements per block.

    Returns:
        (nblocks, blocksize) tensor (a copy only where padding was needed).
    """
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel(), blocksize) * blocksize - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, blocksize)


def absmax_reciprocal(absmax: Tensor) -> Tensor:
    """``1 / absmax`` per block, 1 for all-zero blocks (which quantize to the code of 0).

    Args:
        absmax: (nblocks,) float32.

    Returns:
        (nblocks,) float32.
    """
    return torch.where(absmax > 0, absmax, torch.ones_like(absmax)).reciprocal()


def quantize_blocks_ref(blocks: Tensor, qmap: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize rows of ``blocks`` (reference; see the module docstring for the rule).

    Args:
        blocks: (nblocks, blocksize) float32.
        qmap: (256,) sorted float32 map.

    Returns:
        codes (nblocks, blocksize) uint8 and absmax (nblocks,) float32.
    """
    absmax = blocks.abs().amax(dim=1)
    y = blocks * absmax_reciprocal(absmax)[:, None]
    t = thresholds(qmap)[:255].contiguous()
    codes = torch.searchsorted(t, y.contiguous(), side="left")
    return codes.to(torch.uint8), absmax


def _quantize_ref(x: Tensor, qmap: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    codes, absmax = quantize_blocks_ref(blocks_view(x.float(), blocksize), qmap)
    return codes.reshape(-1)[: x.numel()].clone(), absmax


def _dequantize_ref(codes: Tensor, absmax: Tensor, qmap: Tensor, blocksize: int) -> Tensor:
    n = codes.numel()
    vals = qmap[blocks_view(codes, blocksize).long()] * absmax[:, None]
    return vals.reshape(-1)[:n].clone()


def _check_map(qmap: Tensor) -> None:
    if qmap.shape != (256,) or qmap.dtype != torch.float32:
        raise ValueError(f"qmap has shape {tuple(qmap.shape)} and dtype {qmap.dtype}; "
                         "expected a (256,) float32 map from dynamic_map()")


def _check_blocksize(blocksize: int) -> None:
    if blocksize < 1 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize={blocksize} must be a positive power of two")


# ---------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------
@torch.library.custom_op(op_name("quantize_blockwise"), mutates_args=())
def quantize_blockwise_op(x: Tensor, qmap: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    """Op form of :func:`quantize_blockwise` (reference impl; CUDA may use Triton)."""
    return _quantize_ref(x, qmap, blocksize)


@quantize_blockwise_op.register_fake
def _(x, qmap, blocksize):
    nb = num_blocks(x.numel(), blocksize)
    return (x.new_empty(x.numel(), dtype=torch.uint8), x.new_empty(nb, dtype=torch.float32))


@torch.library.custom_op(op_name("dequantize_blockwise"), mutates_args=())
def dequantize_blockwise_op(codes: Tensor, absmax: Tensor, qmap: Tensor, blocksize: int) -> Tensor:
    """Op form of :func:`dequantize_blockwise` (reference impl; CUDA may use Triton)."""
    return _dequantize_ref(codes, absmax, qmap, blocksize)


@dequantize_blockwise_op.register_fake
def _(codes, absmax, qmap, blocksize):
    return codes.new_empty(codes.numel(), dtype=torch.float32)


@quantize_blockwise_op.register_kernel("cuda")
def _(x, qmap, blocksize):
    if triton_usable(x):
        from .quantize_triton import quantize_blockwise_triton
        return quantize_blockwise_triton(x, qmap, blocksize)
    return _quantize_ref(x, qmap, blocksize)  # pragma: no cover


@dequantize_blockwise_op.register_kernel("cuda")
def _(codes, absmax, qmap, blocksize):
    if triton_usable(codes):
        from .quantize_triton import dequantize_blockwise_triton
        return dequantize_blockwise_triton(codes, absmax, qmap, blocksize)
    return _dequantize_ref(codes, absmax, qmap, blocksize)  # pragma: no cover


def quantize_blockwise(x: Tensor, qmap: Tensor | None = None,
                       blocksize: int = BLOCKSIZE) -> tuple[Tensor, Tensor]:
    """Block-wise 8-bit quantization of ``x``.

    Args:
        x: any shape, floating point (computed in fp32).
        qmap: (256,) sorted float32 map on ``x.device``; default the signed dynamic map.
        blocksize: elements per block (a power of two).

    Returns:
        codes (x.numel(),) uint8 and absmax (ceil(numel / blocksize),) float32.

    Raises:
        ValueError: ``x`` is not floating point, the map or the block size is malformed.
    """
    if not x.is_floating_point():
        raise ValueError(f"quantize_blockwise needs a floating-point tensor, got {x.dtype}")
    _check_blocksize(blocksize)
    qmap = dynamic_map(True, x.device) if qmap is None else qmap
    _check_map(qmap)
    return quantize_blockwise_op(x.contiguous(), qmap, blocksize)


def dequantize_blockwise(codes: Tensor, absmax: Tensor, qmap: Tensor | None = None,
                         blocksize: int = BLOCKSIZE, shape: torch.Size | None = None) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: ``qmap[codes] * absmax`` per block.

    Args:
        codes: (n,) uint8.
        absmax: (ceil(n / blocksize),) float32.
        qmap: the map used to quantize (default: signed dynamic map).
        blocksize: elements per block.
        shape: optional shape of the result (default (n,)).

    Returns:
        float32 tensor of ``shape``.

    Raises:
        ValueError: dtypes or sizes do not fit together.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    _check_blocksize(blocksize)
    if absmax.numel() != num_blocks(codes.numel(), blocksize):
        raise ValueError(f"absmax has {absmax.numel()} entries; {codes.numel()} codes in blocks "
                         f"of {blocksize} need {num_blocks(codes.numel(), blocksize)}")
    qmap = dynamic_map(True, codes.device) if qmap is None else qmap
    _check_map(qmap)
    out = dequantize_blockwise_op(codes.reshape(-1).contiguous(), absmax.float().contiguous(),
                                  qmap, blocksize)
    return out if shape is None else out.view(shape)
