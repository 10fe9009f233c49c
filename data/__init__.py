"""outcore.data."""
