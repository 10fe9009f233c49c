"""The ``outcore`` command line (console script ``outcore`` and ``python -m outcore``).

Subcommands are listed once, in :func:`commands`; each is a module with
``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> int``
(``finetune.py``, ``plan.py``, ``doctor.py``, ...).

Exit codes (defined once, in :mod:`outcore.errors`): 0 success; 2 bad input (an
:class:`outcore.errors.OutcoreError`, printed as exactly one line ``outcore: error:
<message>``, or an argparse usage error); 3 a disk is full (``DiskFullError``: the
last checkpoint is intact, free space and ``--resume``); 4 corrupt bytes read back
(``IntegrityError``: the file and unit are named); 5 another rank of a distributed run
died or stopped answering (``RankLostError``); 130 interrupted by SIGINT (Ctrl-C)
and 143 by SIGTERM (one line ``outcore: interrupted: ...``; a run stops at the end of
its step and checkpoints first, a second signal exits at once); 141 stdout closed by
its reader (a pipe). Other exceptions are bugs and keep their traceback.

Importing this module imports neither torch nor transformers (``--help`` is
instant); a command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import EXIT_BROKEN_PIPE, EXIT_OK, EXIT_USAGE, Interrupted, OutcoreError
from .jsonout import json_stdout

PROG = "outcore"


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, help and how to parse and run it."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    accepts_overrides: bool = False  # free ``key=value`` words anywhere on the line


def commands() -> list[Command]:
    """Every subcommand, in the order ``--help`` lists them (add new ones here)."""
    from . import chat, doctor, eval, export, finetune, generate, plan, runs

    def command(name, module, accepts_overrides=False):
        return Command(name, module.HELP, module.DESCRIPTION, module.add_arguments, module.run,
                       accepts_overrides)

    return [
        command("finetune", finetune, accepts_overrides=True),
        command("plan", plan, accepts_overrides=True),
        command("doctor", doctor),
        command("export", export),
        command("eval", eval),
        command("generate", generate),
        command("chat", chat),
        command("runs", runs),
    ]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per :func:`commands` entry."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Fine-tune language models larger than the memory of the machine that trains them.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command. "
               f"'{PROG} finetune' with no options fine-tunes the embedded default "
               "(SmolLM2-135M-Instruct on Shakespeare).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in commands():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_command=cmd, _parser=p)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``key=value`` words go to ``args.overrides`` where a command takes them.

    Raises:
        SystemExit: on ``--help``/``--version`` (code 0) or a usage error (code 2).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    cmd: Command | None = getattr(args, "_command", None)
    if extra:
        # argparse stops filling a nargs='*' positional at the first option, so
        # ``lr=1e-4 --max-steps 3 seed=1`` leaves ``seed=1`` here: take it back.
        words = [w for w in extra if cmd is not None and cmd.accepts_overrides
                 and not w.startswith("-") and "=" in w]
        rest = [w for w in extra if w not in words]
        if rest:
            shown = " ".join(w if w.isprintable() else repr(w) for w in rest)  # the error stays one line
            (args._parser if cmd is not None else parser).error(f"unrecognized arguments: {shown}")
        args.overrides = list(getattr(args, "overrides", []) or []) + words
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the ``outcore`` command line.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring): 0 success, 2 bad input or usage, 3 disk
        full, 4 corrupt data, 5 a rank lost, 130 / 143 interrupted by SIGINT / SIGTERM, 141
        stdout closed by its reader.
    """
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        build_parser().print_help(sys.stderr)
        return EXIT_USAGE
    try:
        # --json: stdout holds the command's JSON document alone (cli/jsonout.py)
        with json_stdout(getattr(args, "json", False) is True):
            return int(cmd.run(args) or EXIT_OK)
    except OutcoreError as e:
        # one write, newline included: under torchrun every rank may say it at once, and
        # print's two writes (unbuffered stderr) would splice the ranks' lines together
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return e.exit_code
    except KeyboardInterrupt as e:
        # The trainer has already closed its sink and kept its last checkpoint;
        # say so in one line instead of a traceback.
        stop = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        sys.stderr.write(f"{PROG}: interrupted: {stop}\n")
        return stop.exit_code
    except BrokenPipeError:
        # stdout was closed by the reader (``outcore doctor --json | head``): not an error
        # of ours; silence the flush at exit that would raise again.
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests, notebooks)
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
