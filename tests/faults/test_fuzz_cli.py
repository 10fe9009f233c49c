"""Fuzzed command lines and YAML configs: a one-line error naming the value, exit code 2,
never a traceback (``outcore finetune --dry-run``: the config is resolved and checked,
nothing is loaded). Examples are bounded: ~300 in all, a few seconds."""
from __future__ import annotations

import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outcore.training.config import _FIELDS
from outcore.cli.finetune import FLAGS

from .conftest import run_cli

KEYS = sorted(_FIELDS) + ["optim_args.rank", "no_such_key", "max-steps"]
TRICKY = ["nan", "inf", "-inf", "-1", "0", "1e400", "-0.5", "true", "null", "~", "[1, 2]", "{a: 1}", "",
          "2GiB", "-5GiB", "1.5XB", "0x10", "1_000", "'quoted'", "é", "\x00", "3,4", "1e-400"]
VALUES = st.one_of(st.sampled_from(TRICKY), st.text(max_size=12), st.integers(-10**20, 10**20).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
WORDS = st.lists(st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: [f"{kv[0]}={kv[1]}"]),
    st.tuples(st.sampled_from([f for f, *_ in FLAGS if f not in ("--resume", "--config")]), VALUES).map(list),
    st.text(max_size=10).map(lambda w: [w])), max_size=4).map(lambda ws: [w for pair in ws for w in pair])
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LINE = re.compile(r"^outcore(?: finetune)?: error: ")


def check_refusal(rc: int, err: str, words: list[str]) -> None:
    """0, or 2 with the error as the last line naming one of the words given; never a traceback.
    An outcore error is exactly one line; argparse's usage errors keep their usage line."""
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err, err
    if rc == 0:
        return
    lines = [ln for ln in err.split("\n") if ln.strip()]  # (a word may hold a \r: not a line break here)
    assert lines and LINE.match(lines[-1]), err
    if lines[-1].startswith("outcore: error: "):
        assert len(lines) == 1, err
    named = {w.split("=", 1)[0].strip().replace("-", "_").lstrip("_") for w in words} | set(words)
    named |= {v for w in words for v in w.split("=", 1)[1:]} | {repr(w) for w in words}
    named |= {"config", "argument", "unrecognized"}
    assert any(n and n in lines[-1] for n in named), (lines[-1], words)


@SETTINGS
@given(WORDS)
def test_fuzzed_command_line(words):
    rc, err = run_cli(["finetune", "--dry-run", *words])
    check_refusal(rc, err, words)


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(), st.text(max_size=8))
YAML_VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=5), kids, max_size=3), max_leaves=6)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), YAML_VALUES, max_size=4))
def test_fuzzed_yaml_config(tmp_path, values):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(values))
    rc, err = run_cli(["finetune", "--dry-run", "--config", str(f)])
    check_refusal(rc, err, [*values, *map(str, values.values()), str(f)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                 st.sampled_from([b"\xff\xfe\x00x", b"- a\n- b", b"a: [", b"\t- x", b"{",
                                  b"!!python/object:os.system {}"])))
def test_garbage_yaml_file(tmp_path, raw):
    f = tmp_path / "run.yaml"
    f.write_bytes(raw)
    rc, err = run_cli(["finetune", "--dry-run", "--config", str(f)])
    check_refusal(rc, err, [str(f)])
