"""outcore.activations — what a block keeps, recomputes or offloads for its backward.

    from outcore.activations import apply_activation_policy
    handle = apply_activation_policy(model, "offload", store=store)   # or "keep" | "recompute" | "auto"
    ...train...
    handle.remove()

Every policy gives gradients bit-identical (fp32) to keeping activations: offload
moves bytes, recompute replays the same deterministic forward (RNG state restored).
"""
import importlib

# Lazy exports (PEP 562): ``outcore.activations.policy`` (the policy names the config and
# the command line use) stays free of torch until a name that needs it is used.
_EXPORTS = {
    "ActivationHandle": "apply", "apply_activation_policy": "apply", "find_decoder_layers": "apply",
    "ActivationOffloader": "offload", "BlockPack": "pack", "PackedRef": "pack",
    "ActivationPolicy": "policy", "BlockProfile": "policy", "choose_policy": "policy",
    "expand_policy": "policy", "ACTIVATION_POLICIES": "policy",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
