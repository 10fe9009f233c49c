"""outcore.tui."""
