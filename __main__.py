"""``python -m outcore`` is the ``outcore`` command."""
from .tui.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
