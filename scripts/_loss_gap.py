"""The loss cost of compressed activation offload: the recipe on the default model and data,
exact offload against ``activations_compress`` int8 / fp8 (``bench_memory.py --loss-gap``).

Each codec runs the real recipe (``outcore.recipes.full_finetune.finetune``) in its own
process with the same seed, hence the same batches: SmolLM2-135M on Shakespeare (the
embedded defaults), ``activations=offload`` (every block but the last offloaded to an
NVMe swap file), weights in memory (``offload=none``, so only the activations differ).
The gap of a codec is ``|loss_codec - loss_none| / loss_none`` of

- ``train_last``: the last step's training loss,
- ``train_last10``: the mean training loss of the last 10 steps,
- ``val_final``: the validation loss after the last step (``eval_batches`` batches).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CODECS = ("none", "int8", "fp8")


def run_one(codec: str, steps: int, dtype: str, out_dir: str) -> dict:
    """One recipe run (in this process); returns its losses and time."""
    import torch

    from outcore.training.config import load_config
    from outcore.recipes.full_finetune import finetune

    torch.set_num_threads(int(os.environ.get("OUTCORE_BENCH_THREADS", "0")) or os.cpu_count() or 1)
    cfg = load_config(overrides=dict(
        max_steps=steps, dtype=dtype, offload="none", activations="offload", activations_compress=codec,
        eval_every=0, output=out_dir, ui="none", export=False, seed=0))
    t0 = time.perf_counter()
    res = finetune(cfg)
    return {"codec": codec, "dtype": dtype, "steps": res.steps_done, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "eval_batches": cfg.eval_batches, "losses": res.losses,
            "val_base": res.base_eval_loss, "val_final": res.final_eval_loss,
            "wall_s": time.perf_counter() - t0}


def loss_gap(steps: int, dtype: str, codecs: tuple[str, ...] = CODECS, parallel: bool = True) -> dict:
    """Run every codec (``none`` first: the reference) in its own process; their gaps.

    Args:
        steps: optimizer steps per run.
        dtype: compute dtype of the runs.
        codecs: the codecs; must include ``none``.
        parallel: all processes at once (one thread each) rather than one after the other.

    Returns:
        ``{"runs": {codec: run}, "gaps": {codec: {train_last, train_last10, val_final}}}``.
    """
    procs = {}
    with tempfile.TemporaryDirectory(prefix="outcore-lossgap-") as tmp:
        env = dict(os.environ, TMPDIR=tmp)  # the private activation swap dirs go here too
        if parallel:
            env["OUTCORE_BENCH_THREADS"] = "1"
        runs = {}
        for codec in codecs:
            cmd = [sys.executable, os.path.abspath(__file__), codec, str(steps), dtype, os.path.join(tmp, codec)]
            procs[codec] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            if not parallel:
                runs[codec] = _result(codec, procs[codec])
        for codec, p in procs.items():
            if codec not in runs:
                runs[codec] = _result(codec, p)
    ref = runs["none"]
    gaps = {}
    for codec, r in runs.items():
        if codec == "none":
            continue
        pairs = {"train_last": (r["losses"][-1], ref["losses"][-1]),
                 "train_last10": (statistics.mean(r["losses"][-10:]), statistics.mean(ref["losses"][-10:])),
                 "val_final": (r["val_final"], ref["val_final"])}
        gaps[codec] = {k: abs(a - b) / abs(b) for k, (a, b) in pairs.items()}
    return {"runs": runs, "gaps": gaps}


def _result(codec: str, p: subprocess.Popen) -> dict:
    out, err = p.communicate()
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"loss-gap run {codec} failed (exit {p.returncode}):\n{out[-2000:]}{err[-4000:]}")
    return json.loads(line[-1][7:])


if __name__ == "__main__":  # a worker: CODEC STEPS DTYPE OUT_DIR
    print("RESULT " + json.dumps(run_one(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])))
