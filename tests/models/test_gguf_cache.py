"""The GGUF → safetensors cache: reuse, invalidation, atomic publication, stale temps.

The dequantizer itself is replaced by a tiny model here (the real one is exercised
on the packaged SmolLM2 GGUF in test_default_model.py): everything else — key,
writing, fsync, rename, marker, cleanup — is the real code.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from outcore.errors import ModelError
from outcore.models import build_gguf_cache, default_cache_dir, gguf_cache_path, load_model
from outcore.models import _gguf_cache


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, family_model, tiny_tokenizer):
    """A ``.gguf`` path whose 'dequantization' yields a tiny Llama; counts the calls."""
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake")
    calls = []

    def dequantize(gguf_file):
        calls.append(gguf_file)
        return family_model("llama"), tiny_tokenizer

    monkeypatch.setattr(_gguf_cache, "_dequantize", dequantize)
    return path, calls


def _leftovers(cache):
    return sorted(p.name for p in (cache / "gguf").iterdir() if p.name.startswith(".tmp-"))


def test_second_load_reads_the_cache(fake_gguf, tmp_path, family_model):
    path, calls = fake_gguf
    cache = tmp_path / "cache"
    first, tok = load_model(str(path), cache_dir=cache)
    second, _ = load_model(str(path), cache_dir=cache)
    assert len(calls) == 1
    entry = gguf_cache_path(path, cache)
    assert entry.parent == cache / "gguf" and entry.name.startswith("tiny-")
    assert {"config.json", "model.safetensors", "tokenizer.json", _gguf_cache.MARKER} <= {
        p.name for p in entry.iterdir()}
    reference = family_model("llama").state_dict()
    for model in (first, second):
        assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tok.eos_token == "<eos>" and _leftovers(cache) == []


def test_changed_file_gets_a_new_entry(fake_gguf, tmp_path):
    path, calls = fake_gguf
    cache = tmp_path / "cache"
    old = build_gguf_cache(path, cache)
    os.utime(path, ns=(10**18, 10**18))
    new = build_gguf_cache(path, cache)
    assert new != old and len(calls) == 2
    assert build_gguf_cache(path, cache) == new and len(calls) == 2


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_interrupted_write_leaves_no_entry(fake_gguf, tmp_path, monkeypatch, failure):
    path, calls = fake_gguf
    cache = tmp_path / "cache"

    def interrupted(root):
        raise failure()

    monkeypatch.setattr(_gguf_cache, "_fsync_tree", interrupted)  # after writing, before rename
    with pytest.raises(failure):
        build_gguf_cache(path, cache)
    assert not gguf_cache_path(path, cache).exists() and _leftovers(cache) == []
    monkeypatch.undo()


def test_entry_without_marker_is_rebuilt(fake_gguf, tmp_path):
    path, calls = fake_gguf
    cache = tmp_path / "cache"
    entry = build_gguf_cache(path, cache)
    (entry / _gguf_cache.MARKER).unlink()
    (entry / "model.safetensors").write_bytes(b"truncated")
    assert not _gguf_cache.is_complete(entry)
    assert build_gguf_cache(path, cache) == entry  # damaged entry replaced, not trusted
    assert len(calls) == 2 and _gguf_cache.is_complete(entry) and _leftovers(cache) == []
    model, _ = load_model(str(path), cache_dir=cache)
    assert model.lm_head.weight.shape == (320, 64)


def test_losing_the_race_uses_the_winners_entry(fake_gguf, tmp_path, monkeypatch):
    path, calls = fake_gguf
    cache = tmp_path / "cache"
    entry = gguf_cache_path(path, cache)
    real_fsync = _gguf_cache._fsync_tree

    def other_process_wins(root):
        real_fsync(root)
        entry.mkdir(parents=True)
        (entry / _gguf_cache.MARKER).write_text("{}")

    monkeypatch.setattr(_gguf_cache, "_fsync_tree", other_process_wins)
    assert build_gguf_cache(path, cache) == entry
    assert _leftovers(cache) == []


def test_stale_temps_of_dead_processes_are_removed(fake_gguf, tmp_path):
    path, _ = fake_gguf
    cache = tmp_path / "cache"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = cache / "gguf" / f".tmp-tiny-abc-{dead}-x1"
    alive = cache / "gguf" / f".tmp-tiny-abc-{os.getpid()}-x2"
    stale.mkdir(parents=True)
    alive.mkdir()
    build_gguf_cache(path, cache)
    assert not stale.exists() and alive.exists()


def test_unreadable_gguf_is_a_model_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelError, match=r"cannot read GGUF file '.*broken\.gguf'"):
        load_model(str(bad), cache_dir=tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


def test_cache_root_follows_outcore_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTCORE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("OUTCORE_CACHE")
    assert str(default_cache_dir()).endswith(os.path.join(".cache", "outcore"))


def test_unwritable_cache_root(fake_gguf, tmp_path):
    path, _ = fake_gguf
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ModelError, match=r"cannot create the model cache directory"):
        build_gguf_cache(path, blocker / "cache")
