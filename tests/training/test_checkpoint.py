"""Checkpoints under faults: a full disk, debris of a killed run, rotation, corruption, pickle."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from outcore.errors import EXIT_DISK_FULL, CheckpointError, DiskFullError
from outcore.training.checkpoint import files as ckpt
from outcore.training.checkpoint.run_state import rng_state, set_rng_state


def _save(out: Path, step: int, keep: int = 2, **kw) -> Path:
    model = {"w": torch.full((256,), float(step))}
    optim = {"state": {0: {"exp_avg": torch.ones(256) * step, "step": torch.tensor(float(step))}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}
    trainer = {"step": step, "rng": rng_state(), "loader": {"epoch": 0, "position": step}}
    return ckpt.save_checkpoint(out, step, model, optim, trainer, keep=keep, **kw)


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_round_trip_loads_without_pickle_and_files_are_private(tmp_path):
    d = _save(tmp_path, 3)
    model, optim, trainer = ckpt.load_checkpoint(d)
    assert torch.equal(model["w"], torch.full((256,), 3.0)) and trainer["step"] == 3
    assert optim["param_groups"][0]["betas"] == (0.9, 0.999)
    set_rng_state(trainer["rng"])  # NumPy's RNG state (an ndarray) comes back without pickle
    for p in [d.parent, d, *d.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickled_object_is_refused_never_run(tmp_path, monkeypatch):
    """Found: optimizer.pt / trainer.pt loaded with weights_only=False ran any code in them."""
    monkeypatch.chdir(tmp_path)
    d = ckpt.save_checkpoint(tmp_path / "run", 1, {"w": torch.ones(2)}, {}, {"step": 1, "evil": _Evil()})
    with pytest.raises(CheckpointError, match="holds objects outcore does not load"):
        ckpt.load_checkpoint(d)
    assert not (tmp_path / "PWNED").exists()


def test_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
    first = _save(tmp_path, 1)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(DiskFullError, match=r"checkpoints needs 4\.\d\d MiB but its disk has 1\.00 MiB free") as e:
        _save(tmp_path, 2)
    assert e.value.exit_code == EXIT_DISK_FULL
    assert _names(tmp_path) == ["latest", "step_000001"] and ckpt.latest_checkpoint(tmp_path) == first


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   Exception("Error while serializing: I/O error: No space left on device "
                                             "(os error 28)")])
def test_disk_filling_while_writing_stops_cleanly(tmp_path, monkeypatch, error):
    """Found: a full disk mid-checkpoint gave a safetensors traceback and left step_*.tmp behind."""
    first = _save(tmp_path, 1)

    def full(*a, **k):
        raise error
    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(DiskFullError, match=f"checkpoint directory {tmp_path / 'checkpoints'} needs"):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert _names(tmp_path) == ["latest", "step_000001"]  # no .tmp debris, the previous one intact
    assert ckpt.load_newest_valid(tmp_path)[0] == first


def test_debris_of_a_killed_run_is_cleared_and_never_loaded(tmp_path):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / "step_000002.tmp").mkdir()
    (root / "step_000002.tmp" / ckpt._COMPLETE).write_text("{}")  # even one that looks complete
    (root / "latest.tmp").write_text("step_000002.tmp")
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    _save(tmp_path, 3)
    assert _names(tmp_path) == ["latest", "step_000001", "step_000003"]


def test_keep_rotates_after_the_new_one_is_complete(tmp_path, monkeypatch):
    for step in range(1, 5):
        _save(tmp_path, step, keep=2)
    assert _names(tmp_path) == ["latest", "step_000003", "step_000004"]
    seen = []
    real = ckpt._discard

    def discard(old):
        seen.append((old.name, ckpt.latest_checkpoint(tmp_path).name))
        real(old)
    monkeypatch.setattr(ckpt, "_discard", discard)
    _save(tmp_path, 5, keep=1)
    assert seen == [("step_000003", "step_000005"), ("step_000004", "step_000005")]
    assert _names(tmp_path) == ["latest", "step_000005"]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.pt", "trainer.pt", "COMPLETE",
                                    "units/block0.safetensors"])
def test_damage_in_any_file_is_named_and_resume_falls_back(tmp_path, damage, victim):
    def units(d: Path) -> None:
        (d / "units").mkdir()
        from safetensors.torch import save_file
        save_file({"w": torch.ones(64)}, str(d / "units" / "block0.safetensors"))
    older = _save(tmp_path, 1, write_extra=units)
    newest = _save(tmp_path, 2, write_extra=units)
    f = newest / victim
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2:]
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(newest)
    named = "COMPLETE marker" if victim == "COMPLETE" else repr(str(f))
    assert named in str(e.value)
    if victim.startswith("units/"):
        assert "(unit block0)" in str(e.value)
    found, state, skipped = ckpt.load_newest_valid(tmp_path)
    assert found == older and state[2]["step"] == 1
    assert len(skipped) == 1 and named in skipped[0]


def test_no_valid_checkpoint_names_the_damage(tmp_path):
    d = _save(tmp_path, 1)
    (d / "trainer.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* loads: checkpoint file .*trainer.pt"):
        ckpt.load_newest_valid(tmp_path)


def test_a_checkpoint_written_before_the_self_digest_still_loads(tmp_path):
    import json
    d = _save(tmp_path, 2)
    body = json.loads((d / ckpt._COMPLETE).read_text())
    del body["self"]  # what checkpoints of earlier versions hold
    (d / ckpt._COMPLETE).write_text(json.dumps(body))
    assert ckpt.load_checkpoint(d)[2]["step"] == 2
