"""outcore.optim."""
