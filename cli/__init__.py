"""The ``outcore`` command line: the parser and dispatch (``app``), one module per subcommand,
and ``jsonout``, which keeps a ``--json`` command's stdout to its JSON document (scripts use it too).
Importing it imports no torch: a command imports what it needs when it runs.
"""
from .._exports import lazy_exports

# Lazy (PEP 562), as the other packages: ``python -m outcore.cli.app`` and a script importing
# ``outcore.cli.jsonout`` load only what they use.
_EXPORTS = {
    "main": ".app", "build_parser": ".app", "parse_args": ".app", "commands": ".app", "Command": ".app",
    "emit_json": ".jsonout", "json_stdout": ".jsonout",
}
__all__ = list(sorted(_EXPORTS))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
