"""``python -m outcore`` is the ``outcore`` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
