"""One block's saved activations laid out in one contiguous byte buffer, and back.

An offloaded block saves a dozen or more tensors for its backward, and several
of them alias: a ``Linear``'s input is saved once per projection (q, k, v share
it), a reshape's output shares its input's storage. :class:`BlockPack` groups
what the block saves **by storage**, so each byte is moved once, and lays the
groups out back to back in one buffer, so a block is one transfer each way
(one copy, one NVMe extent, one checksum) instead of one per tensor.

Each saved tensor becomes a :class:`PackedRef` (its storage group, byte offset,
shape, stride, dtype); :meth:`BlockPack.view` rebuilds it from the buffer with
the *same strides*, so kernels in the backward see exactly the layout they saw
in the forward and the gradients stay bit-identical.

Only tensors that read most of the storage span they touch are packed (the
span at most ``max_span_ratio`` times their bytes, no negative strides): a
narrow slice of a large buffer would inflate the copy and stays where it is. A
broadcast (stride-0) tensor moves only the bytes it really reads.

With a :class:`~.compress.Codec` (``activations_compress``), a group that one
contiguous floating-point saved tensor covers exactly is *stored* 8-bit
(:meth:`BlockPack.copy_into` encodes it) and :meth:`BlockPack.restore` decodes the
stored buffer into the *raw* layout the views expect. Other groups (several
dtypes, gaps whose bytes nobody saved and whose values could spoil a block's
scale) are stored as they are. Without a codec the stored layout is the raw one.
"""
from __future__ import annotations

import numpy as np
import torch

from .compress import COMPRESSIBLE, Codec

ALIGN = 64  # groups start at 64-byte offsets: vectorized copies, any dtype's alignment


def storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` of ``t``'s storage that ``t`` reads (None: negative strides)."""
    es = t.element_size()
    if any(st < 0 for st in t.stride()):
        return None
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * es
    return lo, lo + span * es


class _Group:
    """The saved bytes of one storage: ``[lo, hi)`` of it, placed at ``offset`` in the buffer."""

    __slots__ = ("storage", "lo", "hi", "offset", "versions", "start", "encoded", "stored", "stored_len")

    def __init__(self, storage, lo: int, hi: int, start: int):
        self.storage, self.lo, self.hi = storage, lo, hi
        self.start = start  # the first byte a saved tensor reads (lo is it rounded down to ALIGN)
        self.offset = 0  # in the raw layout (what views read)
        self.versions: list[tuple[torch.Tensor, int]] = []  # (saved tensor, its version when saved)
        self.encoded: torch.dtype | None = None  # the dtype a codec stores [start, hi) from, if any
        self.stored, self.stored_len = 0, 0  # where and how long in the stored buffer

    def covering(self) -> torch.dtype | None:
        """The dtype of a contiguous saved tensor reading exactly ``[start, hi)`` when every
        saved tensor of the group is an activation of that floating dtype (a codec may store
        it); else None.

        Per-row statistics stay exact: a tensor whose last dimension is 1 (RMSNorm's
        ``rsqrt``) scales a whole row, and one autograd does not differentiate through
        (attention's log-sum-exp, RoPE tables) enters an exponent or every block. Measured on
        a tiny Llama (``activations/compress.py``): fp8 on the ``rsqrt`` alone moved the
        gradients by 1.1% (relative L2) for 1/128 of the bytes; a linear's input, 0.1-0.8%.
        """
        dtypes = {t.dtype for t, _ in self.versions}
        if len(dtypes) != 1 or next(iter(dtypes)) not in COMPRESSIBLE:
            return None
        if any(t.shape[-1:] == (1,) or not t.requires_grad for t, _ in self.versions):
            return None
        for t, _ in self.versions:
            if (t.is_contiguous() and t.storage_offset() * t.element_size() == self.start
                    and t.numel() * t.element_size() == self.hi - self.start):
                return t.dtype
        return None


class PackedRef:
    """Where one saved tensor lives in its block's buffer (what the pack hook hands autograd)."""

    __slots__ = ("group", "byte_offset", "shape", "stride", "dtype", "nbytes")

    def __init__(self, group: _Group, byte_offset: int, t: torch.Tensor):
        self.group, self.byte_offset = group, byte_offset
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.nbytes = t.numel() * t.element_size()


class BlockPack:
    """Collects one block's saved tensors (deduplicated by storage) and lays them out.

    Life cycle: :meth:`add` per saved tensor during the forward, :meth:`seal` at the
    block's end (fixes the layout, returns the byte count), :meth:`copy_into` once
    (fills the buffer and lets go of the sources), :meth:`restore` once the bytes are
    back, :meth:`view` per unpack.

    Args:
        max_span_ratio: pack a tensor only if the storage span it reads is at most
            this many times its own bytes.
        codec: stores floating-point groups 8-bit (None: every byte as it is).
    """

    def __init__(self, max_span_ratio: float = 2.0, codec: Codec | None = None):
        self.max_span_ratio = float(max_span_ratio)
        self.codec = codec
        self.device: torch.device | None = None
        self._groups: dict[int, _Group] = {}  # storage data_ptr -> group
        self.nbytes = 0  # the stored buffer's length once sealed (what moves)
        self.raw_nbytes = 0  # the raw layout's length (= nbytes without a codec)
        self.saved_bytes = 0  # bytes of the tensors added (aliases counted once per save)
        self._sealed = False

    def add(self, t: torch.Tensor) -> PackedRef | None:
        """Take ``t`` into the pack; None when it should stay where it is.

        Args:
            t: a saved tensor (any shape; strided layout).

        Returns:
            Its :class:`PackedRef`, or None for tensors that are not dense enough,
            empty, on another device than the pack's first tensor, or not strided.
        """
        if self._sealed:
            raise RuntimeError("BlockPack.add after seal()")
        if t.layout is not torch.strided or t.numel() == 0:
            return None
        if self.device is not None and t.device != self.device:
            return None
        span = storage_span(t)
        nbytes = t.numel() * t.element_size()
        if span is None or span[1] - span[0] > self.max_span_ratio * nbytes:
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        lo = span[0] - span[0] % ALIGN  # keeps byte offsets congruent mod 64 (dtype alignment)
        g = self._groups.get(ptr)
        if g is None:
            g = self._groups[ptr] = _Group(storage, lo, span[1], span[0])
        else:
            g.lo, g.hi, g.start = min(g.lo, lo), max(g.hi, span[1]), min(g.start, span[0])
        g.versions.append((t, t._version))
        self.device = t.device
        self.saved_bytes += nbytes
        return PackedRef(g, span[0], t)

    def seal(self) -> int:
        """Fix the layouts (groups back to back at 64-byte offsets); returns the stored bytes."""
        if not self._sealed:
            off = stored = 0
            for g in self._groups.values():
                g.offset = off
                raw = -(-(g.hi - g.lo) // ALIGN) * ALIGN
                off += raw
                g.encoded = g.covering() if self.codec is not None else None
                g.stored_len = (raw if g.encoded is None
                                else self.codec.stored_bytes((g.hi - g.start) // g.encoded.itemsize))
                g.stored, stored = stored, stored + g.stored_len
            self.raw_nbytes, self.nbytes, self._sealed = off, stored, True
        return self.nbytes

    def copy_into(self, buf: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy every group into ``buf`` and drop the references to the sources (unless
        ``non_blocking``: the copies may not have read them yet).

        Args:
            buf: uint8 ``[>= nbytes]`` (HOST; pinned when the sources are on an accelerator and
                ``non_blocking``: then the caller synchronizes before reading it, and only then
                calls :meth:`release_sources` — freed sooner, the caching allocator could hand
                their blocks to the compute stream while the copy still reads them).
            non_blocking: asynchronous device-to-host copies (on the current stream).

        Raises:
            RuntimeError: a saved tensor was modified in place after it was saved
                (its backward would have read the changed values).
        """
        if not self._sealed:
            raise RuntimeError("BlockPack.copy_into before seal()")
        for g in self._groups.values():
            for t, version in g.versions:
                if t._version != version:
                    raise RuntimeError(
                        f"a tensor of shape {tuple(t.shape)} saved for backward was modified in place "
                        f"(version {version} -> {t._version}) before it was offloaded")
            dst = buf[g.stored:g.stored + g.stored_len]
            if g.encoded is not None:
                self._encode(g, dst, non_blocking)
                continue
            n = g.hi - g.lo
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(g.storage, g.lo, (n,), (1,))
            dst = dst[:n]
            if src.is_cpu:
                # one thread's memcpy (numpy releases the GIL): torch's copy_ here would start a
                # second OpenMP team on this I/O thread, competing with the compute's own team
                np.copyto(dst.numpy(), src.numpy())
            else:
                dst.copy_(src, non_blocking=non_blocking)
        if not non_blocking:
            self.release_sources()

    def _encode(self, g: _Group, dst: torch.Tensor, non_blocking: bool) -> None:
        """Store group ``g`` 8-bit into ``dst``: encoded where the tensor is (on an accelerator on
        the device, so only the 8-bit bytes cross to the host)."""
        n = g.hi - g.start
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(g.storage, g.start, (n,), (1,))
        src = src.view(g.encoded)
        if src.is_cpu:
            self.codec.encode(src, dst)
            return
        staged = torch.empty(g.stored_len, dtype=torch.uint8, device=self.device)
        self.codec.encode(src, staged)
        dst.copy_(staged, non_blocking=non_blocking)

    def restore(self, stored: torch.Tensor) -> torch.Tensor:
        """The raw layout :meth:`view` reads, from the stored buffer: ``stored`` itself when
        nothing was encoded, else a new buffer on its device with the encoded groups decoded.

        Args:
            stored: uint8 ``[>= nbytes]`` holding what :meth:`copy_into` wrote (HOST or device).

        Returns:
            uint8 ``[raw_nbytes]`` (or ``stored``).
        """
        if not any(g.encoded is not None for g in self._groups.values()):
            return stored
        raw = torch.empty(self.raw_nbytes, dtype=torch.uint8, device=stored.device)
        for g in self._groups.values():
            src = stored[g.stored:g.stored + g.stored_len]
            if g.encoded is None:
                raw[g.offset:g.offset + g.hi - g.lo].copy_(src[:g.hi - g.lo])
                continue
            self.codec.decode(src, raw[g.offset + g.start - g.lo:g.offset + g.hi - g.lo].view(g.encoded))
        return raw

    def release_sources(self) -> None:
        """Let go of the saved tensors (after the copy, or when the block is dropped)."""
        for g in self._groups.values():
            g.storage, g.versions = None, []

    @staticmethod
    def view(base: torch.Tensor, ref: PackedRef) -> torch.Tensor:
        """The saved tensor of ``ref`` rebuilt from ``base`` (the block's uint8 buffer), same strides.

        Args:
            base: uint8 ``[>= nbytes]`` holding the block's bytes (HOST or device).
            ref: what :meth:`add` returned.

        Returns:
            A tensor viewing ``base`` with ``ref``'s shape, stride and dtype.
        """
        g = ref.group
        pos = g.offset + ref.byte_offset - g.lo
        span = (1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride, strict=True))) * ref.dtype.itemsize
        return base[pos:pos + span].view(ref.dtype).as_strided(ref.shape, ref.stride)
