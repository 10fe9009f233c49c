"""Apply per-block activation policies to a Hugging Face model without changing its code.

Each decoder block's ``forward`` is wrapped on the *instance* (``layer.forward =
wrapper``; ``handle.remove()`` deletes the attribute and the class method is
back). The wrapper does nothing outside autograd (eval, ``no_grad``); in
training it runs the block under ``torch.utils.checkpoint`` (RECOMPUTE), or
inside the :class:`ActivationOffloader`'s pack hooks (OFFLOAD_*). When anything
offloads, every block's output also gets a gradient hook that starts the
reverse-order prefetch below it, so the kept last block's backward already
hides the read of the first offloaded one.

``"auto"`` measures the first training forward (per block: the bytes an offload
would move, deduplicated as the offloader packs them, its input bytes and its
time, with everything kept; with ``compress``, also the bytes it would store),
then calls :func:`choose_policy` with the budgets and bandwidths (and, on a CPU
device, the measured copy bandwidth), and applies its choice from the next step on.
"""
from __future__ import annotations

import functools
import tempfile
import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError, ModelError
from ..models._structure import decoder_layers
from ..offload.device import is_accelerator
from ..offload.device import free_device_bytes
from .compress import codec_for
from .offload import _MIN_BYTES, ActivationOffloader
from .pack import BlockPack
from .policy import AUTO, ActivationPolicy, BlockProfile, choose_policy, expand_policy
from .tiled_block import TiledBlock, block_runner, tileable
from .tiling import is_tileable, tile_mlp, tile_of

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # transformers' names for it
_DEFAULT_NVME_BPS = (2.0e9, 3.0e9)  # read, write: this hardware class (BENCHMARKING.md), until probed


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks a policy wraps: those of any layout
    :func:`outcore.models.decoder_layers` knows (``model.model.layers`` for Llama-likes).

    Raises:
        ModelError: no known block list is found.
    """
    return decoder_layers(model, any_layout=True)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class ActivationHandle:
    """The applied policies; ``remove()`` restores the model and frees the I/O machinery.

    Attributes:
        policies: one :class:`ActivationPolicy` per block (for "auto": after the first step).
        offloader: the :class:`ActivationOffloader` (None when nothing offloads).
        profiles: per-block :class:`BlockProfile` measured by "auto" (else None).
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList, policies: list[ActivationPolicy] | None,
                 store: Any, auto: dict | None, prefetch_depth: int, min_bytes: int = _MIN_BYTES,
                 keep_last: int = 1, compress: str = "none", tile: int = 0, host_budget: int = 1 << 30):
        self.model, self.layers = model, layers
        self.policies = policies if policies is not None else [ActivationPolicy.KEEP] * len(layers)
        self.profiles: list[BlockProfile] | None = None
        self._auto = auto
        self._store, self._own_store = store, False
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._prefetch_depth, self._min_bytes, self._keep_last = prefetch_depth, min_bytes, keep_last
        self._compress, self._host_budget = compress, host_budget
        self._device = next(model.parameters()).device  # where the blocks compute
        self.offloader: ActivationOffloader | None = None
        self._measure: list[list[float]] = [[0, 0, 0.0, 0] for _ in layers]  # saved, input, seconds, stored
        self._ensure_offloader()
        for i, layer in enumerate(layers):
            layer.forward = self._wrap(i, layer.forward, layer)
        #: tokens per MLP tile (0: untiled); the blocks whose MLP it tiles are undone by remove()
        self.tile = tile
        self._untile = [tile_mlp(layer.mlp, tile) for layer in layers
                        if tile and is_tileable(getattr(layer, "mlp", None))]

    # ------------------------------------------------------------------ plumbing
    def _ensure_offloader(self) -> None:
        if self.offloader is not None or not any(p.offloads for p in self.policies):
            return
        if self._store is None:  # no store given: a private one with a temporary swap dir
            from ..offload import TieredStore
            host = (self._auto or {}).get("host_budget", self._host_budget)
            need_host = any(p.offloads and p.to_host for p in self.policies)
            self._tmp = tempfile.TemporaryDirectory(prefix="outcore-act-")
            # on the model's device: its HOST buffers are pinned for that device's copies
            self._store = TieredStore(device_bytes=0, host_bytes=host if need_host else 0,
                                      swap_dir=f"{self._tmp.name}/swap", device=self._device)
            self._own_store = True
        self.offloader = ActivationOffloader(self._store, prefetch_depth=self._prefetch_depth,
                                             min_bytes=self._min_bytes, compress=self._compress)

    def _wrap(self, index: int, forward, layer: nn.Module):
        def wrapped(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            if index == 0 and self.offloader is not None:
                self.offloader.new_step()
            if self._auto is not None and self.profiles is None:
                return self._measured(index, forward, args, kwargs)
            policy = self.policies[index]
            if policy.recomputes:
                kwargs = _without_cache(kwargs)
            hidden = args[0] if args else kwargs.get("hidden_states")
            if (policy.recomputes and len(args) <= 1 and isinstance(hidden, torch.Tensor)
                    and tileable(layer, kwargs, hidden.shape[1], self.tile)):
                out = self._tiled_block(index, policy, layer, forward, hidden, kwargs)
            elif policy is ActivationPolicy.RECOMPUTE:
                out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
            elif policy.recomputes:  # the checkpoint offloaded
                with self.offloader.block(index, policy, layer):
                    out = _offloaded_checkpoint(forward, args, kwargs)
            elif policy.offloads:
                with self.offloader.block(index, policy, layer):
                    out = forward(*args, **kwargs)
            else:
                out = forward(*args, **kwargs)
            if index == len(self.layers) - 1 and self.offloader is not None:
                self.offloader.pool.idle()  # the transfer buffers sit unused through the loss
            t = _first_tensor(out)
            if self.offloader is not None and t is not None and t.requires_grad:
                # fires when d loss / d output exists: block `index`'s backward is next, so
                # the reads of the offloaded blocks below it start now (kept blocks included:
                # the last kept block's backward hides the read of the first offloaded one)
                t.register_hook(lambda g, i=index: self._reached(i))
            return out
        return wrapped

    def _tiled_block(self, index: int, policy: ActivationPolicy, layer: nn.Module, forward, hidden: torch.Tensor,
                     kwargs: dict) -> torch.Tensor:
        """A recomputed block over ``self.tile`` positions at a time (``tiled_block.py``): its
        checkpoint, the input saved by :class:`TiledBlock`, goes through the offloader as the
        reentrant checkpoint's does."""
        run = block_runner(layer, forward, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        params = [p for p in layer.parameters() if p.requires_grad]
        if policy is ActivationPolicy.RECOMPUTE:
            return TiledBlock.apply(run, self.tile, hidden, *params)
        with self.offloader.block(index, policy, layer):
            return TiledBlock.apply(run, self.tile, hidden, *params)

    def _reached(self, index: int) -> None:
        if self.offloader is not None:
            self.offloader.backward_reached(index)

    def _measured(self, index: int, forward, args, kwargs):
        """KEEP, while counting the bytes an offload would move (deduplicated) and timing the block."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        params = {p.untyped_storage().data_ptr() for p in self.layers[index].parameters()}
        rec = self._measure[index]
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rec[1] = hidden.numel() * hidden.element_size() if isinstance(hidden, torch.Tensor) else 0
        pack_ = BlockPack(codec=codec_for(self._compress))

        def pack(t):
            base = t._base if t._base is not None else t
            if (t.numel() * t.element_size() >= self._min_bytes and not isinstance(base, nn.Parameter)
                    and not t.is_sparse and t.untyped_storage().data_ptr() not in params):
                pack_.add(t)
            return outer[0](t) if outer is not None else t

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, outer[1] if outer is not None else (lambda x: x)):
            out = forward(*args, **kwargs)
        rec[2] = time.perf_counter() - t0
        rec[3] = pack_.seal()  # the bytes an offload would store (compressed with a codec)
        rec[0] = pack_.raw_nbytes
        pack_.release_sources()
        if index == len(self.layers) - 1:
            self._decide()
        return out

    def _decide(self) -> None:
        a = self._auto
        self.profiles = [BlockProfile(int(s), int(i), float(t), int(o)) for s, i, t, o in self._measure]
        self.policies = choose_policy(
            self.profiles, a["device_budget"], host_budget=a.get("host_budget", 0),
            host_bps=a.get("host_bps", 0.0), nvme_budget=a.get("nvme_budget"),
            nvme_read_bps=a.get("nvme_read_bps", _DEFAULT_NVME_BPS[0]),
            nvme_write_bps=a.get("nvme_write_bps", _DEFAULT_NVME_BPS[1]), keep_last=self._keep_last,
            copy_bps=a["copy_bps"] if "copy_bps" in a else _copy_bps(self._device))
        self._ensure_offloader()

    def remove(self) -> None:
        """Unwrap every block and stop the offload threads (and a private store)."""
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        for untile in self._untile:
            untile()
        self._untile = []
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None
        if self._own_store:
            self._store.close()
            self._own_store = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def apply_activation_policy(model: nn.Module,
                            policy: "ActivationPolicy | str | Sequence[ActivationPolicy | str]" = "keep",
                            store: Any = None, *, device_budget: int | None = None,
                            prefetch_depth: int = 2, min_bytes: int = _MIN_BYTES, keep_last: int = 1,
                            compress: str = "none", seq_tile: "int | str" = 0,
                            **bandwidth: float) -> ActivationHandle:
    """Apply activation policies to ``model``'s decoder blocks.

    Args:
        model: a Hugging Face causal LM (or anything :func:`find_decoder_layers` accepts).
        policy: one policy for all blocks, a list (one per block), or a name:
            "keep", "recompute", "offload" (NVMe for all blocks but the last),
            "offload_host", "offload_nvme", or "auto".
        store: the run's :class:`~outcore.offload.TieredStore` (offloaded bytes go to
            its HOST / NVME tiers under its budgets). None: a private store with a
            temporary swap dir is made when something offloads.
        device_budget: for "auto": bytes activations may hold on the device
            (None: half the available memory of the device).
        prefetch_depth: blocks whose activations are read ahead in the backward.
        min_bytes: saved tensors smaller than this are never offloaded (they stay
            on the device: RoPE tables shared by all blocks, norm statistics).
        keep_last: for "offload" and "auto": the last blocks that always KEEP (their
            backward comes first, so nothing could hide their transfer).
        compress: how offloaded activations are stored, one of
            :data:`~.policy.ACTIVATION_COMPRESSION` (``int8`` / ``fp8``: 8-bit with
            per-block scales, :mod:`.compress`; ``none``: bit-identical to keep).
        seq_tile: each block's MLP computed over tiles of this many tokens (``auto``:
            :func:`~.tiling.auto_tile` of the model's shape; 0: untiled), so its memory in
            the forward, the recompute and the backward grows with the tile (:mod:`.tiling`).
        **bandwidth: ``host_budget`` (bytes a private store's HOST tier holds; default
            1 GiB), and for "auto": ``host_bps``, ``nvme_budget``,
            ``nvme_read_bps``, ``nvme_write_bps``, ``copy_bps`` (as in
            :func:`choose_policy`; ``copy_bps`` is measured on a CPU device when not given).

    Returns:
        An :class:`ActivationHandle`; call ``.remove()`` to undo.

    Raises:
        ModelError: no decoder blocks found, or the model is already wrapped.
        ConfigError: an unknown policy or ``compress`` name, a list of the wrong length, an
            unknown keyword, a bad ``seq_tile``, or a negative
            ``prefetch_depth``/``min_bytes``/``keep_last``.
    """
    layers = find_decoder_layers(model)
    if any("forward" in layer.__dict__ for layer in layers):
        raise ModelError(f"{type(model).__name__} already has wrapped blocks; remove() the "
                         f"previous activation policy first")
    unknown = set(bandwidth) - {"host_budget", "host_bps", "nvme_budget", "nvme_read_bps", "nvme_write_bps",
                                "copy_bps"}
    if unknown:
        raise ConfigError(f"unknown keyword(s) {sorted(unknown)} for apply_activation_policy")
    for name, v in (("prefetch_depth", prefetch_depth), ("min_bytes", min_bytes), ("keep_last", keep_last)):
        if int(v) < 0:
            raise ConfigError(f"{name}={v} must be >= 0")
    codec_for(compress)  # an unknown name fails here, not at the first offloaded block
    opts = dict(prefetch_depth=int(prefetch_depth), min_bytes=int(min_bytes), keep_last=int(keep_last),
                compress=compress, tile=tile_of(model, seq_tile))
    if isinstance(policy, str) and policy.lower() == AUTO:
        if device_budget is None:
            device_budget = _available_device_bytes(next(model.parameters()).device) // 2
        auto = dict(bandwidth, device_budget=int(device_budget))
        return ActivationHandle(model, layers, None, store, auto, **opts)
    return ActivationHandle(model, layers, expand_policy(policy, len(layers), keep_last=int(keep_last)),
                            store, None, host_budget=int(bandwidth.get("host_budget", 1 << 30)), **opts)


def _offloaded_checkpoint(forward, args: tuple, kwargs: dict) -> Any:
    """``forward`` recomputed in the backward, its inputs saved through the hooks around it.

    The reentrant checkpoint saves its tensor inputs with ``save_for_backward``, so the
    offloader's pack hook sees the block's input hidden state (and nothing else: the forward
    runs without a graph) and moves it to its tier; the non-reentrant one keeps its inputs
    in a closure no hook sees. Keyword arguments (the mask, RoPE's cos / sin, shared by every
    block) ride in the closure. It restores the RNG state for the recompute, as the other.
    """
    return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True)


def _without_cache(kwargs: dict) -> dict:
    """A recomputed block's keyword arguments without a KV cache, as transformers' own
    checkpointing drops it: the recompute would append the block's keys and values to it a
    second time (and a training step has no use for one: it holds every block's)."""
    kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _copy_bps(device: torch.device, nbytes: int = 16 << 20) -> float:
    """Bytes/s of a large copy on a CPU device (it competes with compute); 0 on an accelerator (DMA)."""
    if device.type != "cpu":
        return 0.0
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # touch the pages first: the offloader's buffers are pooled, so faults do not recur
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / max(time.perf_counter() - t0, 1e-9)


def _available_device_bytes(device: torch.device) -> int:
    if is_accelerator(device):
        return free_device_bytes(device)  # a sync point, once per apply
    import psutil
    return int(psutil.virtual_memory().available)
