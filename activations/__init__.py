"""outcore.activations — what a block keeps, recomputes or offloads for its backward.

    from outcore.activations import apply_activation_policy
    handle = apply_activation_policy(model, "offload", store=store)   # or "keep" | "recompute" | "auto"
    ...train...
    handle.remove()

Every policy gives gradients bit-identical (fp32) to keeping activations: offload
moves bytes, recompute replays the same deterministic forward (RNG state restored).
``seq_tile`` runs each block's MLP over tiles of tokens (``tiling.py``): exact but for the
MLP weights' gradients, summed per tile (fp32 rounding).
"""
from .._exports import lazy_exports

# Lazy exports (PEP 562): ``outcore.activations.policy`` (the policy names the config and
# the command line use) stays free of torch until a name that needs it is used.
_EXPORTS = {
    "ActivationHandle": ".apply", "apply_activation_policy": ".apply", "find_decoder_layers": ".apply",
    "ActivationOffloader": ".offload", "BlockPack": ".pack", "PackedRef": ".pack",
    "ActivationPolicy": ".policy", "BlockProfile": ".policy", "choose_policy": ".policy",
    "expand_policy": ".policy", "ACTIVATION_POLICIES": ".policy", "ACTIVATION_COMPRESSION": ".policy",
    "TiledMLP": ".tiling", "tile_mlp": ".tiling",
}
__all__ = list(sorted(_EXPORTS))


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
