"""SIGINT and SIGTERM during ``outcore finetune`` in a real subprocess, on a tiny model.

The run stops at the end of its step: a checkpoint (first order; the ZO log is one
already), the swap directory removed, exit 128 + the signal, one line and no traceback;
``--resume`` goes on from there. A second signal exits at once and corrupts nothing.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outcore.training import checkpoint as ckpt


def _start(inputs: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "outcore", "finetune", "--model", str(inputs / "model"),
           "--data", str(inputs / "data.txt"), "--max-steps", "100000", "--ui", "plain", "--output", str(out),
           "seq_len=32", "batch_size=2", "eval_every=0", "eval_batches=1", "threads=1", "export=false", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _after_first_step(p: subprocess.Popen) -> None:
    for line in p.stdout:
        if re.match(r"step +\d+/", line):  # the plain log's step line
            return
    pytest.fail(f"the run ended before its first step: {p.wait()} {p.stderr.read()[-2000:]}")


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("sig, args", [
    pytest.param(signal.SIGINT, ["--method", "zo", "--optim", "mezo", "--offload", "nvme"],  # Found: exit 1
                 id="zo-nvme-int", marks=pytest.mark.slow(ci=True)),
    pytest.param(signal.SIGTERM, ["--method", "zo", "--optim", "mezo", "--offload", "none"],
                 id="zo-memory-term", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, ["--offload", "nvme"], id="full-nvme-term", marks=pytest.mark.slow(ci=True)),
    pytest.param(signal.SIGINT, ["--offload", "none"], id="full-memory-int", marks=pytest.mark.slow),
])
def test_a_signal_stops_the_run_cleanly_and_it_resumes(tiny_run_inputs, tmp_path, sig, args):
    out = tmp_path / "run"
    p = _start(tiny_run_inputs, out, *args)
    _after_first_step(p)
    p.send_signal(sig)
    code, err = _finish(p)
    lines = [line for line in err.splitlines() if line.startswith("outcore") or "Error" in line]
    assert code == 128 + sig, err[-3000:]
    assert "Traceback" not in err
    said = re.fullmatch(f"outcore: interrupted: stopped by {sig.name} after step (\\d+); "
                        f"continue with --resume {re.escape(str(out))}", lines[0])
    assert len(lines) == 1 and said, err[-3000:]
    step = int(said.group(1))
    assert step >= 1 and not (out / "swap").exists()
    if "zo" in args:
        assert len((out / "zo_log.jsonl").read_text().splitlines()) == 1 + step  # header + one per step
        return
    assert ckpt.latest_checkpoint(out).name == f"step_{step:06d}"
    if "none" in args:
        return
    again = subprocess.run([sys.executable, "-m", "outcore", "finetune", "--resume", str(out),
                            "--max-steps", str(step + 1), "--ui", "none"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow(ci=True)
def test_a_second_signal_exits_at_once_and_corrupts_nothing(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    p = _start(tiny_run_inputs, out, "--offload", "nvme", "save_every=1")
    _after_first_step(p)
    _after_first_step(p)  # the second step's line: step 1's checkpoint is written
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    code, err = _finish(p)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert "outcore: SIGINT again: exiting at once" in err or "outcore: interrupted" in err
    found = ckpt.checkpoints(out)
    assert found and found[-1].name == "step_000001"
    for d in found:  # every checkpoint there is whole, whatever the second signal cut
        ckpt.verify_checkpoint(d)
    last = int(ckpt.latest_checkpoint(out).name.split("_")[1])
    again = subprocess.run([sys.executable, "-m", "outcore", "finetune", "--resume", str(out),
                            "--max-steps", str(last + 1), "--ui", "none"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]  # debris of the cut run trips nothing
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert not (out / "swap").exists()  # the killed run's swap dir went with the next run's
