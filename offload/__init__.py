"""outcore.offload."""
