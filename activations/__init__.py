"""outcore.activations — what a block keeps, recomputes or offloads for its backward.

    from outcore.activations import apply_activation_policy
    handle = apply_activation_policy(model, "offload", store=store)   # or "keep" | "recompute" | "auto"
    ...train...
    handle.remove()

Every policy gives gradients bit-identical (fp32) to keeping activations: offload
moves bytes, recompute replays the same deterministic forward (RNG state restored).
"""
from .apply import ActivationHandle, apply_activation_policy, find_decoder_layers
from .offload import ActivationOffloader
from .pack import BlockPack, PackedRef
from .policy import ActivationPolicy, BlockProfile, choose_policy, expand_policy

__all__ = ["ActivationHandle", "ActivationOffloader", "ActivationPolicy", "BlockPack", "BlockProfile", "PackedRef",
           "apply_activation_policy", "choose_policy", "expand_policy", "find_decoder_layers"]
