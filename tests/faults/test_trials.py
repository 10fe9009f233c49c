"""The CI subset of ``scripts/trial_faults.py``: the real CLI in subprocesses, out of core.

Each test runs a few trials of one kind and asserts that every one lost nothing (see the
script's docstring for what that means per kind).
~20 CLI runs in all: about two minutes on two quiet cores.
"""
from __future__ import annotations

import random
import signal

import pytest

from .conftest import trial_module



@pytest.fixture(scope="module")
def kinds():
    yield trial_module("_trial_kinds")
    trial_module("_trial_disk").unmount_all()


def _all_ok(trials) -> None:
    trials = list(trials)
    assert trials
    lost = [f"{t.name}: {t.detail}" for t in trials if not t.ok]
    assert not lost, lost


@pytest.mark.slow(ci=True)
def test_kill_at_chosen_points_then_resume_is_bit_identical(kinds, trial_inputs, tmp_path):
    """kill -9 inside a unit's write-back, between checkpoint files, and between export's
    removal of the old final/ and the rename of the new one."""
    assert len(kinds.QUICK_KILL_POINTS) >= 3
    assert sum(map(len, kinds.KILL_POINTS.values())) + 2 * kinds.RANDOM_KILLS >= 20
    _all_ok(kinds.kill_trials(trial_inputs, tmp_path, ("nvme",), True, random.Random(0)))


@pytest.mark.slow(ci=True)
def test_second_run_on_a_live_runs_output_or_swap_dir_is_refused(kinds, trial_inputs, tmp_path):
    _all_ok(kinds.two_runs_trials(trial_inputs, tmp_path, ("nvme",), True, random.Random(0)))


@pytest.fixture
def disk():
    """The disk trials' module, where this machine can loop-mount small file systems."""
    module = trial_module("_trial_disk")
    why = module.unavailable("disk")
    if why:
        pytest.skip(why)
    yield module
    module.unmount_all()


@pytest.mark.slow(ci=True)
def test_full_disk_before_the_run_is_refused_in_one_line(disk, trial_inputs, tmp_path):
    _all_ok(disk.disk_trials(trial_inputs, tmp_path, ("nvme",), True, random.Random(0)))


@pytest.mark.slow(ci=True)
def test_full_output_disk_in_memory_is_refused_in_one_line(disk, trial_inputs, tmp_path):
    """In memory no swap reservation stands guard: the first checkpoint meets the full disk."""
    _all_ok([disk._full_before(trial_inputs, tmp_path, "none", "output")])


@pytest.mark.slow(ci=True)
def test_damaged_checkpoint_falls_back_to_the_previous_one(kinds, trial_inputs, tmp_path):
    _all_ok(kinds._checkpoint_trials(trial_inputs, tmp_path, "nvme", True, random.Random(0)))


@pytest.mark.slow(ci=True)
def test_sigterm_checkpoints_removes_the_swap_dir_and_exits_distinctly(kinds, trial_inputs, tmp_path):
    _all_ok([kinds._signal_trial(trial_inputs, tmp_path, "nvme", signal.SIGTERM, False, ())])


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory, trial_inputs):
    """200 steps from NVMe, watched (see scripts/_trial_soak.py)."""
    result = trial_module("_trial_soak").soak(trial_inputs, tmp_path_factory.mktemp("soak"), 200)
    assert result["rc"] == 0 and result["samples_after_warmup"] >= 10, result
    return result


@pytest.mark.slow
def test_short_soak_holds_memory_descriptors_threads_and_leaves_nothing(short_soak):
    r = short_soak
    assert r["rss_drift"] <= 0.02, r
    assert r["fds_end"] <= r["fds_after_warmup"] and r["threads_end"] <= r["threads_after_warmup"], r
    assert r["swap_files"]["extents.bin"]["end"] == r["swap_files"]["extents.bin"]["after_warmup"], r
    assert not r["swap_dir_left"] and not r["tmp_left"], r


@pytest.mark.slow
def test_short_soak_swap_journal_does_not_grow(short_soak):
    """The journal gets a line per write and is compacted as it fills: bounded, not growing."""
    from outcore.offload.store.nvme import JOURNAL_COMPACT_MIN

    assert short_soak["swap_files_grown"] == [], short_soak["swap_files"]
    assert short_soak["swap_files_max"]["extents.idx"] <= (JOURNAL_COMPACT_MIN + 1) * 160, short_soak


@pytest.mark.slow(ci=True)
def test_overwrite_of_a_live_runs_output_dir_is_refused(kinds, trial_inputs, tmp_path):
    _all_ok([kinds._two_runs_trial(trial_inputs, tmp_path, "nvme", "output dir --overwrite")])
