"""Small helpers to compose ``concurrent.futures.Future`` without blocking a thread."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable


def completed(value: Any = None) -> Future:
    """A Future that is already done with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def failed(exc: BaseException) -> Future:
    """A Future that is already done with ``exc``."""
    f: Future = Future()
    f.set_exception(exc)
    return f


def chain(inner: Future, convert: Callable[[BaseException], BaseException]) -> Future:
    """A Future with ``inner``'s result, whose exception is passed through ``convert``."""
    outer: Future = Future()
    outer.set_running_or_notify_cancel()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            outer.set_result(f.result())
        else:
            outer.set_exception(convert(exc))
    inner.add_done_callback(done)
    return outer


def then(inner: Future, fn: Callable[[Any], "Future | Any"],
         on_error: Callable[[BaseException], None] | None = None) -> Future:
    """Run ``fn(result)`` when ``inner`` succeeds; the outer Future follows what ``fn`` returns.

    ``fn`` may return a Future (its outcome is forwarded) or a value. ``fn`` runs
    on the thread that completed ``inner`` and must not block. ``on_error`` is
    called (before the outer Future fails) when ``inner`` or ``fn`` fails.
    """
    outer: Future = Future()
    outer.set_running_or_notify_cancel()

    def fail(exc: BaseException) -> None:
        if on_error is not None:
            try:
                on_error(exc)
            except BaseException as e:  # noqa: BLE001 - the original error matters more
                exc.__context__ = e
        outer.set_exception(exc)

    def forward(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            fail(exc)
        else:
            outer.set_result(f.result())

    def step(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            fail(exc)
            return
        try:
            nxt = fn(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fail(e)
            return
        if isinstance(nxt, Future):
            nxt.add_done_callback(forward)
        else:
            outer.set_result(nxt)
    inner.add_done_callback(step)
    return outer
