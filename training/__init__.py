"""Training services every recipe uses: the run's config, its output directory, checkpoints
(atomic; DCP across ranks), a run as one of several ranks, SSD-wear counting, the training loss,
and what is built before the first step. Recipes (``outcore.recipes``) compose these; nothing
here imports ``recipes`` or ``tui``."""
