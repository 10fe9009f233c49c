"""outcore.kernels."""
