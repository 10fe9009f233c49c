"""Fuzzed memory budgets: too small, negative, absurd units. A size parses or is refused
in one line naming the option and the value; a run whose budget cannot hold its plan is
refused before training in one line (exit code 2), never with a traceback."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outcore.errors import ConfigError
from outcore.bytesize import parse_bytes

from .conftest import assert_user_error, run_cli

UNITS = ["", "b", "B", "k", "KB", "kib", "MiB", "M", "G", "GiB", "TiB", "T", "PiB", "XB", "bytes", "GIB", " GiB"]
SIZES = st.one_of(
    st.tuples(st.one_of(st.integers(-10**6, 10**6).map(str), st.floats().map(repr),
                        st.sampled_from(["1e400", "-0", ".5", "5.", "1e-9", "0x10", "1_0", "", "nan", "inf"])),
              st.sampled_from(UNITS)).map("".join),
    st.text(max_size=10))


@settings(max_examples=300, deadline=None)
@given(SIZES)
def test_parse_bytes_parses_or_names_the_value(text):
    try:
        n = parse_bytes(text, "--device-mem")
    except ConfigError as e:
        assert str(e).startswith(f"--device-mem={text!r} ") and "\n" not in str(e)
        return
    assert isinstance(n, int) and n >= 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--device-mem", "--host-mem"]), size=st.integers(0, 96 << 10))
def test_too_small_budget_is_refused_before_training(tmp_path, trial_inputs, flag, size):
    out = tmp_path / "run"
    rc, err = run_cli(["finetune", "--model", str(trial_inputs.model), "--data", str(trial_inputs.data),
                       "--offload", "nvme", flag, str(size), "--max-steps", "1", "--seq-len", "32",
                       "--output", str(out), "--overwrite", "--ui", "none", "export=false"])
    assert_user_error(rc, err, "budget", flag)
    assert not (out / "checkpoints").exists()
