"""StopOnSignal: a signal during a step waits for its end; outside the loop it stops at once."""
from __future__ import annotations

import os
import signal

import pytest

from outcore.errors import Interrupted
from outcore.training.signals import StopOnSignal


def test_a_signal_during_a_step_waits_for_the_boundary_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # the handler has run by now (Python runs it between bytecodes)
        assert stop.signum == signal.SIGTERM  # noted, nothing raised mid-step
        with pytest.raises(Interrupted) as e:
            stop.check()
    assert e.value.exit_code == 143 and str(e.value) == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_loop_a_signal_stops_at_once():
    with pytest.raises(Interrupted) as e:
        with StopOnSignal():
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
            pytest.fail("not interrupted")
    assert e.value.exit_code == 130
