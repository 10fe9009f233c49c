"""outcore plan: a tiny model sized from its config.json alone, budgets from flags."""
from __future__ import annotations

import json

import pytest

from outcore.cli import main

pytest.importorskip("outcore.planner.plan")


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory):
    """A directory holding only a config.json (no weights): planning never loads weights."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny_cfg")
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=True).save_pretrained(d)
    return d


def _plan(argv, capsys):
    rc = main(["plan", "--no-measure", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_plan_json(tiny_config_dir, capsys):
    rc, out, _ = _plan(["--model", str(tiny_config_dir), "--seq-len", "32", "--json",
                        "--device-mem", "1GiB", "--host-mem", "1GiB", "--offload", "nvme"], capsys)
    assert rc == 0
    plan = json.loads(out)
    assert plan["model_type"] == "llama" and plan["offload"] == "nvme" and plan["seq_len"] == 32
    # every parameter counted: embeddings (tied head) + 4 blocks + final norm
    attn = 2 * 64 * 64 + 2 * 64 * 32  # q, o: 64x64; k, v: 64x32 (2 kv heads of 16)
    blocks = 4 * (attn + 3 * 64 * 128 + 2 * 64)  # + gate/up/down, + 2 norms
    assert plan["params"] == 256 * 64 + blocks + 64
    assert set(plan["tiers"]) == {"DEVICE", "HOST", "NVME"}


def test_plan_table(tiny_config_dir, capsys):
    rc, out, _ = _plan(["--model", str(tiny_config_dir), "--seq-len", "32", "key_not_a_flag=1"], capsys)
    assert rc == 2  # unknown key: a config error, before anything is probed
    rc, out, _ = _plan(["--model", str(tiny_config_dir), "--seq-len", "32", "batch_size=1"], capsys)
    assert rc == 0
    assert out.startswith("outcore plan: llama") and "DEVICE" in out and "step (estimate)" in out


def test_plan_that_cannot_fit_is_one_line(tiny_config_dir, capsys):
    rc, _, err = _plan(["--model", str(tiny_config_dir), "--offload", "none", "--device-mem", "4KiB"], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("outcore: error: offload=none: the DEVICE budget")


def test_missing_model_is_one_line(tmp_path, capsys):
    rc, _, err = _plan(["--model", str(tmp_path / "nope")], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("outcore: error: model path")
    assert str(tmp_path / "nope") in err


def test_seq_len_max_takes_the_longest_context_and_too_long_is_refused(tiny_config_dir, capsys):
    budget = ["--model", str(tiny_config_dir), "--device-mem", "256MiB", "--host-mem", "256MiB", "--offload", "nvme",
              "--batch-size", "1"]
    rc, out, err = _plan([*budget, "--seq-len", "max", "--json"], capsys)
    assert rc == 0
    plan = json.loads(out)
    longest = plan["longest_context"]
    assert plan["seq_len"] == longest["seq_len"] > 512 and plan["activations"] == longest["activations"]
    assert err.startswith(f"outcore: --seq-len max: {longest['seq_len']} tokens") and "trained at" in err
    rc, out, err = _plan([*budget, "seq_len=max"], capsys)  # the key=value spelling too
    assert rc == 0 and f"seq {longest['seq_len']} x batch 1" in out
    rc, _, err = _plan([*budget, "--seq-len", str(4 * longest["seq_len"])], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"the longest context that fits is {longest['seq_len']} tokens: --seq-len {longest['seq_len']}" in err
