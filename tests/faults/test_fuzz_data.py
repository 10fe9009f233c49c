"""Fuzzed training data: binary garbage, wrong keys, empty and huge lines, wrong encodings.

``build_datasets`` either builds the rows or raises a ``DataError`` naming the file (and
line): never another exception. A few of the refusals go through the whole command line
too (exit code 2, one line). ~200 examples, a few seconds."""
from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outcore.errors import DataError
from outcore.data import build_datasets

from .conftest import assert_user_error, run_cli

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(trial_inputs):
    """The trial model's tokenizer without a chat template (Alpaca prompts) and with one."""
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(trial_inputs.model)
    chat = copy.deepcopy(plain)
    chat.chat_template = TEMPLATE
    return plain, chat


ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                        lambda kids: (st.lists(kids, max_size=3)
                                      | st.dictionaries(st.text(max_size=10), kids, max_size=3)),
                        max_leaves=8)
ROW = st.one_of(
    st.fixed_dictionaries({"instruction": st.text(max_size=30), "output": st.text(max_size=30)},
                          optional={"input": st.text(max_size=10)}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "robot", ""]), "content": st.text(max_size=20)}),
        max_size=4)}),
    st.dictionaries(st.sampled_from(["instruction", "output", "messages", "input", "text", "prompt"]), ANY_JSON,
                    max_size=3),
    ANY_JSON)
LINE = st.one_of(ROW.map(json.dumps), st.just(""), st.just("   "), st.text(max_size=30), st.just("{\"instruction\": "),
                 st.just("x" * 300_000))
ENCODINGS = ["utf-8", "latin-1", "utf-16", "utf-32", "cp1252"]


def _build(path, tok, seq_len=16):
    try:
        build_datasets(str(path), tok, seq_len, seed=0, val_fraction=0.1, use_cache=False)
    except DataError as e:
        msg = str(e)
        assert "\n" not in msg.strip() and path.name in msg, msg


@SETTINGS
@given(lines=st.lists(LINE, max_size=8), encoding=st.sampled_from(ENCODINGS), chat=st.booleans())
def test_fuzzed_jsonl(tmp_path, tokenizers, lines, encoding, chat):
    f = tmp_path / "data.jsonl"
    f.write_bytes("\n".join(lines).encode(encoding, errors="replace"))
    _build(f, tokenizers[chat])


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda t: t.encode("utf-16"))),
       suffix=st.sampled_from([".txt", ".jsonl", ".md"]))
def test_binary_garbage(tmp_path, tokenizers, raw, suffix):
    f = tmp_path / f"data{suffix}"
    f.write_bytes(raw)
    _build(f, tokenizers[0])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.sampled_from([b"\xff\xfe\x00\x00garbage", b"", b"\n\n\n", b'{"instruction": 1}\n',
                                b'[1, 2]\n', "caf\u00e9 ".encode("latin-1") * 50]),
       suffix=st.sampled_from([".txt", ".jsonl"]))
def test_bad_data_through_the_cli(tmp_path, trial_inputs, content, suffix):
    f = tmp_path / f"bad{suffix}"
    f.write_bytes(content)
    rc, err = run_cli(["finetune", "--model", str(trial_inputs.model), "--data", str(f), "--max-steps", "1",
                       "--seq-len", "32", "--offload", "none", "--output", str(tmp_path / "out"), "--overwrite",
                       "--ui", "none", "export=false", "eval_batches=1", "threads=1"])
    assert_user_error(rc, err, f.name)
