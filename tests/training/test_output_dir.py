"""The output directory of a run: locked for the run's life, checked before it is reused."""
from __future__ import annotations

import os

import pytest

from outcore.errors import CheckpointError, ConfigError
from outcore.training.output_dir import holding_output_dir, prepare_output_dir
from outcore.training.config import FinetuneConfig


def test_a_live_runs_output_dir_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "run"
    first_path, first_lock = prepare_output_dir(FinetuneConfig(output=str(out)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=f"in use by another outcore run \\(pid {os.getpid()}\\)"):
        prepare_output_dir(FinetuneConfig(output=str(out), overwrite=True))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the live run's files untouched
    os.close(first_lock)  # the first run ends
    path, lock = prepare_output_dir(FinetuneConfig(output=str(out), overwrite=True))
    assert path == first_path and not (out / "metrics.jsonl").exists()  # now it may be replaced
    os.close(lock)


def test_the_lock_is_released_however_the_run_ends(tmp_path):
    class Recipe:
        pass

    recipe = Recipe()
    with pytest.raises(RuntimeError), holding_output_dir(recipe):
        recipe.out, recipe.out_lock = prepare_output_dir(FinetuneConfig(output=str(tmp_path / "run")))
        raise RuntimeError("the run failed")
    assert recipe.out_lock is None
    _, lock = prepare_output_dir(FinetuneConfig(output=str(tmp_path / "run"), overwrite=True))
    os.close(lock)


def test_resume_of_a_missing_directory_creates_nothing(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="no run found there"):
        prepare_output_dir(FinetuneConfig(output=str(missing), resume=str(missing)))
    assert not missing.exists()
