"""outcore.models."""
