"""Example scripts: outcore used from other tools' training scripts (run each with ``python -m``)."""
