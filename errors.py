"""Errors a user can act on, and the exit code each one gives.

Every error outcore raises for bad input or a failing environment derives from
:class:`OutcoreError`. The CLI prints ``str(err)`` as one line on stderr and
exits with the error's :attr:`~OutcoreError.exit_code`, so a message must name the
offending value and say what to do. The exit codes are defined here, once:

====  ==============================================================
code  meaning
====  ==============================================================
0     success
2     bad input: config, model, data, checkpoint, budget, swap dir
3     a disk is full (:class:`DiskFullError`): free space, then ``--resume``
4     corrupt bytes read back (:class:`IntegrityError`): a disk or file fault
5     another rank of a distributed run died or stopped answering (:class:`RankLostError`)
130   interrupted by SIGINT (Ctrl-C): 128 + the signal number
143   terminated by SIGTERM: 128 + the signal number
141   stdout closed by its reader (a pipe)
====  ==============================================================
"""
import signal

EXIT_OK, EXIT_USAGE, EXIT_DISK_FULL, EXIT_CORRUPT, EXIT_RANK_LOST = 0, 2, 3, 4, 5
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class OutcoreError(Exception):
    """Base class for errors caused by input, configuration or environment."""

    exit_code = EXIT_USAGE


class ConfigError(OutcoreError):
    """A config value is missing, unknown or out of range."""


class ModelError(OutcoreError):
    """A model cannot be found or loaded."""


class DataError(OutcoreError):
    """Training data is missing, unreadable, malformed or empty."""


class BudgetError(OutcoreError):
    """A tier's byte budget cannot hold what is asked of it."""


class IntegrityError(OutcoreError):
    """Bytes read back do not match their checksum (corrupt or truncated file)."""

    exit_code = EXIT_CORRUPT


class SwapDirError(OutcoreError):
    """The swap directory is missing, locked, read-only, unsafe or too small."""


class CheckpointError(OutcoreError):
    """A checkpoint is missing, incomplete or does not match the run."""


class DiskFullError(SwapDirError, CheckpointError):
    """A disk cannot hold what the run must write (the swap dir or a checkpoint).

    A subclass of both :class:`SwapDirError` and :class:`CheckpointError` (the two
    places that write large files), with its own exit code.
    """

    exit_code = EXIT_DISK_FULL


class RankLostError(OutcoreError):
    """Another rank of a distributed run died or stopped answering within the collective timeout."""

    exit_code = EXIT_RANK_LOST


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT or SIGTERM) at a step boundary.

    A ``KeyboardInterrupt`` so that every ``except KeyboardInterrupt`` path runs for
    SIGTERM too. ``exit_code`` is the shell's convention, 128 + the signal number.

    Args:
        signum: the signal received.
        step: the step the run stopped after (None: not known).
        output: the run's output directory, which ``--resume`` continues (None: nothing to resume).
    """

    def __init__(self, signum: int, step: int | None = None, output: str | None = None):
        super().__init__(signum)
        self.signum, self.step, self.output = int(signum), step, output

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = f" after step {self.step}" if self.step is not None else ""
        then = f"; continue with --resume {self.output}" if self.output else ""
        return f"stopped by {name}{where}{then}"
