"""Fuzzed model directories: missing shards, damaged files, wrong dtypes, a config.json that
disagrees with the weights, a tokenizer that disagrees with the model.

Loading (in memory and lazily, for out of core) either gives the model or raises an
``OutcoreError`` naming the directory's file or weight: never another exception, never a
model with weights made up (a layer the files lack) or dropped. ~50 examples, ~20 s."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from outcore.errors import OutcoreError
from outcore.models import load_model, load_model_lazily

from .conftest import assert_user_error, run_cli

CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "model_type", "head_dim"]
CONFIG_VALUES = st.one_of(st.integers(-2, 400), st.none(), st.booleans(), st.text(max_size=6), st.floats())
DTYPES = [torch.int32, torch.int8, torch.uint8, torch.bool, torch.float64, torch.float16, torch.bfloat16]
MUTATION = st.one_of(
    st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS), CONFIG_VALUES),
    st.tuples(st.just("dtype"), st.sampled_from(DTYPES), st.sampled_from(["all", "one"])),
    st.tuples(st.just("truncate"), st.sampled_from(["model.safetensors", "config.json", "tokenizer.json"]),
              st.floats(0, 0.999)),
    st.tuples(st.just("delete"), st.sampled_from(["model.safetensors", "config.json", "tokenizer.json"]), st.none()),
    st.tuples(st.just("drop_weight"), st.integers(0, 100), st.none()),
    st.tuples(st.just("tokenizer_larger"), st.integers(1, 300), st.none()),
    st.tuples(st.just("sharded_missing"), st.none(), st.none()))


def mutate(d: Path, mutation: tuple) -> None:
    """Apply one fuzzed change to the model directory ``d``."""
    kind, a, b = mutation
    weights = d / "model.safetensors"
    if kind == "config":
        cfg = json.loads((d / "config.json").read_text())
        cfg[a] = b
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind == "dtype":
        t = load_file(str(weights))
        first = sorted(t)[0]
        save_file({k: v.to(a) if b == "all" or k == first else v for k, v in t.items()}, str(weights))
    elif kind == "truncate":
        raw = (d / a).read_bytes()
        (d / a).write_bytes(raw[:int(len(raw) * b)])
    elif kind == "delete":
        (d / a).unlink()
    elif kind == "drop_weight":
        t = load_file(str(weights))
        del t[sorted(t)[a % len(t)]]
        save_file(t, str(weights))
    elif kind == "tokenizer_larger":  # the embedding loses rows the tokenizer still maps to
        cfg = json.loads((d / "config.json").read_text())
        t = load_file(str(weights))
        rows = cfg["vocab_size"] - a
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:rows].clone()
        save_file(t, str(weights))
        (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": rows}))
    elif kind == "sharded_missing":  # an index naming a second shard that is not there
        t = load_file(str(weights))
        names = sorted(t)
        save_file({n: t[n] for n in names[:3]}, str(d / "model-00001-of-00002.safetensors"))
        weights.unlink()
        index = {n: "model-00001-of-00002.safetensors" if i < 3 else "model-00002-of-00002.safetensors"
                 for i, n in enumerate(names)}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATION, lazily=st.booleans())
def test_fuzzed_model_directory(trial_inputs, mutation, lazily):
    d = Path(tempfile.mkdtemp(prefix="fuzz-model-"))
    try:
        shutil.copytree(trial_inputs.model, d, dirs_exist_ok=True)
        mutate(d, mutation)
        try:
            model = (load_model_lazily if lazily else load_model)(d)[0]
        except OutcoreError as e:
            assert "\n" not in str(e).strip() and str(d) in str(e), str(e)
            return
        # It loaded: then every parameter is in the files, in the shapes they hold.
        if not lazily:
            files = {}
            for f in d.glob("*.safetensors"):
                files.update(load_file(str(f)))
            for name, p in model.named_parameters():
                assert name in files, f"{name} was made up, not loaded"
                assert tuple(files[name].shape) == tuple(p.shape)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_disagreeing_model_through_the_cli(trial_inputs, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(trial_inputs.model, d)
    mutate(d, ("config", "num_hidden_layers", 3))
    for offload in ("none", "nvme"):
        rc, err = run_cli(["finetune", "--model", str(d), "--data", str(trial_inputs.data), "--offload", offload,
                           "--output", str(tmp_path / offload), "--ui", "none", "--max-steps", "1"])
        assert_user_error(rc, err, "model.layers.2", "config")
