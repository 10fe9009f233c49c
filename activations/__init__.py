"""outcore.activations."""
