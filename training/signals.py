"""SIGINT and SIGTERM during a run: the run stops at a step boundary, never inside a step."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ..errors import Interrupted


class StopOnSignal:
    """SIGINT and SIGTERM during a run: stop cleanly at the next step boundary.

    A signal in the middle of a step would leave it half applied (some units updated,
    the step counter and the data position not), so while :attr:`deferring` the handler
    only notes the signal and :meth:`check`, called between steps, raises
    :class:`~outcore.errors.Interrupted`. Outside the loop (setup, the final export) it
    raises at once, as Ctrl-C always did. A second signal exits at once with 128 + its
    number: checkpoints are written to ``.tmp`` and renamed, so that never corrupts one.

    Handlers are installed only in the main thread (Python delivers signals there) and
    restored on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: the user wants out now
            os.write(2, f"outcore: {signal.Signals(signum).name} again: exiting at once "
                        "(complete checkpoints are intact)\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferring:
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise :class:`~outcore.errors.Interrupted` if a signal came since the run began."""
        if self.signum is not None:
            raise Interrupted(self.signum)
