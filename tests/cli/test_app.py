"""The outcore command line: flags -> FinetuneConfig, help, exit codes, one-line errors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import outcore
from outcore.errors import DataError, DiskFullError, IntegrityError, Interrupted, ModelError
from outcore.training.config import FIRST_RUN, METHODS, OPTIMIZERS, FinetuneConfig
from outcore.cli import main


@pytest.fixture
def fake_finetune(monkeypatch):
    """Replace outcore.finetune; records the configs it gets."""
    calls: list[FinetuneConfig] = []

    def fake(config):
        calls.append(config)
        return {"output_dir": config.output}

    monkeypatch.setattr(outcore, "finetune", fake, raising=False)
    return calls


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---- help ------------------------------------------------------------------------
def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "finetune" in out and "doctor" in out


def test_finetune_help_lists_methods_optimizers_and_flags(capsys):
    assert main(["finetune", "--help"]) == 0
    out = capsys.readouterr().out
    for name in METHODS + OPTIMIZERS:
        assert name in out
    for flag in ("--config", "--model", "--data", "--method", "--optim", "--max-steps", "--seq-len",
                 "--batch-size", "--lr", "--seed", "--output", "--resume", "--overwrite", "--offload",
                 "--device-mem", "--host-mem", "--swap-dir", "--activations", "--ui", "key=value"):
        assert flag in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"outcore {outcore.__version__}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "finetune" in capsys.readouterr().err


# ---- flags -> config --------------------------------------------------------------
def test_no_arguments_fine_tunes_the_default(fake_finetune, capsys):
    assert main(["finetune"]) == 0
    assert fake_finetune == [FinetuneConfig(**FIRST_RUN)]  # write-lean: bf16 + AdamW8bit
    assert capsys.readouterr().out.strip() == f"outcore: output in {os.path.abspath('runs/default')}"


def test_flags_and_overrides_map_to_fields(fake_finetune, tmp_path):
    argv = ["finetune", "lr=1e-3", "--max-steps", "3", "seed=7", "--seq-len", "64", "--batch-size", "4",
            "--model", "some/model", "--data", "d.txt", "--method", "lora", "--optim", "adamw8bit",
            "--output", str(tmp_path / "o"), "--resume", str(tmp_path / "o"), "--overwrite",
            "--offload", "nvme", "--device-mem", "2GiB", "--host-mem", "8GiB", "--swap-dir", "/tmp/sw",
            "--activations", "recompute", "--ui", "plain", "optim_args.rank=64"]
    assert main(argv) == 0
    (c,) = fake_finetune
    assert (c.lr, c.max_steps, c.seed, c.seq_len, c.batch_size) == (1e-3, 3, 7, 64, 4)
    assert (c.model, c.data, c.method, c.optim) == ("some/model", "d.txt", "lora", "adamw8bit")
    assert (c.output, c.resume, c.overwrite) == (str(tmp_path / "o"), str(tmp_path / "o"), True)
    assert (c.offload, c.device_mem, c.host_mem, c.swap_dir) == ("nvme", "2GiB", "8GiB", "/tmp/sw")
    assert (c.activations, c.ui, c.optim_args) == ("recompute", "plain", {"rank": 64})


def test_precedence_yaml_then_key_value_then_flags(fake_finetune, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_steps: 5\nlr: 1.0e-3\nseq_len: 32\n")
    assert main(["finetune", "--config", str(cfg), "lr=2e-3", "max_steps=6", "--max-steps", "7"]) == 0
    (c,) = fake_finetune
    assert (c.max_steps, c.lr, c.seq_len) == (7, 2e-3, 32)
    assert c.overwrite is False and c.batch_size == FinetuneConfig().batch_size  # untouched defaults


def test_resume_alone_resumes_that_directory(fake_finetune, tmp_path):
    assert main(["finetune", "--resume", str(tmp_path / "r")]) == 0
    assert [(c.resume, c.output) for c in fake_finetune] == [(str(tmp_path / "r"), str(tmp_path / "r"))]


def test_dry_run_prints_config_and_does_not_train(fake_finetune, capsys):
    import yaml

    assert main(["finetune", "--dry-run", "--max-steps", "9"]) == 0
    assert fake_finetune == []
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["max_steps"] == 9 and printed["model"] == "default"


# ---- errors -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["finetune", "--optim", "sgd"], "optim='sgd' is not one of: adamw"),
    (["finetune", "--method", "dpo"], "method='dpo' is not one of: full"),
    (["finetune", "optim=sgd"], "optim='sgd' is not one of"),
    (["finetune", "foo=1"], "unknown config key 'foo'"),
    (["finetune", "max_steps=abc"], "max_steps='abc' is not a valid int"),
    (["finetune", "activations_keep_last=-1"], "activations_keep_last=-1 must be >= 0"),
    (["finetune", "--ui", "fancy"], "ui='fancy' is not one of"),
    (["finetune", "--method", "zo"], "method='zo' does not go with optim='adamw'"),
    (["finetune", "--config", "/no/such/run.yaml"], "config file '/no/such/run.yaml' does not exist"),
])
def test_config_errors_are_one_line_exit_2(argv, message, fake_finetune, capsys):
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith("outcore: error: ") and message in line
    assert fake_finetune == []


def test_bad_yaml_names_file_and_line(fake_finetune, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max_steps: 5\nlr: 1e-4\n  seed: 1\n")  # line 3 is indented under a scalar
    assert main(["finetune", "--config", str(cfg)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"outcore: error: {cfg}:3: not valid YAML")


@pytest.mark.parametrize("exc", [
    DataError("data file 'x.jsonl':3: not valid JSON; fix the line or remove it"),
    ModelError("model path '/nope' does not exist;\npass a HF directory, a .gguf file or a hub id"),
])
def test_errors_from_the_run_are_one_line_exit_2(exc, monkeypatch, capsys):
    def boom(config):
        raise exc

    monkeypatch.setattr(outcore, "finetune", boom, raising=False)
    assert main(["finetune"]) == 2
    line = _one_error_line(capsys)
    assert line == "outcore: error: " + " ".join(str(exc).split())


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(outcore, "finetune", interrupted, raising=False)
    assert main(["finetune"]) == 130
    assert _one_error_line(capsys) == "outcore: interrupted: stopped by SIGINT"


@pytest.mark.parametrize("exc, code, line", [
    (DiskFullError("checkpoint directory /o/checkpoints needs 5.00 MiB but its disk has 1.00 MiB free; free space"), 3,
     "outcore: error: checkpoint directory /o/checkpoints needs 5.00 MiB but its disk has 1.00 MiB free; free space"),
    (IntegrityError("checksum mismatch in swap file /s/extents.bin, extent 'block1.w'"),
     4, "outcore: error: checksum mismatch in swap file /s/extents.bin, extent 'block1.w'"),
    (Interrupted(signal.SIGTERM, 7, "/o"),
     143, "outcore: interrupted: stopped by SIGTERM after step 7; continue with --resume /o"),
])
def test_each_kind_of_failure_has_its_exit_code_and_one_line(exc, code, line, monkeypatch, capsys):
    def fail(config):
        raise exc

    monkeypatch.setattr(outcore, "finetune", fail, raising=False)
    assert main(["finetune"]) == code == exc.exit_code
    assert _one_error_line(capsys) == line


def test_a_lost_rank_exits_5_with_one_line(monkeypatch, capsys):
    from outcore.errors import RankLostError

    def lost(config):
        raise RankLostError("rank 0 of 2: rank 1 died or stopped answering during the step")

    monkeypatch.setattr(outcore, "finetune", lost, raising=False)
    assert main(["finetune"]) == 5
    assert _one_error_line(capsys) == "outcore: error: rank 0 of 2: rank 1 died or stopped answering during the step"


def test_the_module_docstring_lists_every_exit_code():
    import re

    from outcore import errors
    from outcore.cli import app

    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")} | {130, 143}
    missing = [c for c in sorted(codes) if not re.search(rf"(?<![\w.]){c}(?![\w.])", app.__doc__)]
    assert missing == []


def test_bugs_keep_their_traceback(monkeypatch):
    def bug(config):
        raise RuntimeError("a bug")

    monkeypatch.setattr(outcore, "finetune", bug, raising=False)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["finetune"])


@pytest.mark.parametrize("argv, message", [
    (["finetune", "--max-steps", "many"], "invalid int value: 'many'"),
    (["finetune", "--nope"], "unrecognized arguments: --nope"),
    (["finetune", "lr"], "override 'lr' must look like key=value"),
    (["finetune", "optim_args=x", "optim_args.a=1"], "optim_args='x' is not a mapping"),
    (["doctor", "lr=1"], "unrecognized arguments: lr=1"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_usage_errors_exit_2(argv, message, fake_finetune, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert fake_finetune == []


# ---- the real entry points, in fresh interpreters ----------------------------------
def _run(args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kw)


def test_cli_and_views_import_no_torch():
    code = (
        "import io, sys\n"
        "import outcore.cli, outcore.tui\n"
        "from outcore.cli import main\n"
        "assert main(['finetune', '--help']) == 0\n"
        "assert main(['finetune', '--dry-run']) == 0\n"
        "from outcore.events import RunStarted, StepEvent\n"
        "for ui in ('plain', 'rich'):\n"
        "    s = outcore.tui.make_sink(ui, None, stream=io.StringIO())\n"
        "    s.emit(RunStarted('r', 'm', 1, 1, 1, ''))\n"
        "    s.emit(StepEvent(1, 1, 1.0, 1e-4, 1.0, 1.0, 1.0, 1))\n"
        "    s.close()\n"
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    res = _run(["-c", code])
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout


def test_python_m_outcore_help_is_fast():
    t0 = time.perf_counter()
    res = _run(["-m", "outcore", "--help"])
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0 and "finetune" in res.stdout
    assert elapsed < 10.0  # a shared machine; with torch imported it would take several seconds more


def test_python_m_outcore_error_is_one_line():
    res = _run(["-m", "outcore", "finetune", "--optim", "sgd"])
    assert res.returncode == 2
    assert res.stderr.splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith("outcore: error: optim='sgd' is not one of")


def test_closed_pipe_exits_quietly():
    code = ("import sys\n"
            "from outcore import cli\n"
            "from outcore.cli import doctor\n"
            "def run(args):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')\n"
            "doctor.run = run\n"
            "sys.exit(cli.main(['doctor']))\n")
    res = _run(["-c", code])
    assert res.returncode == 141 and res.stderr == ""
