"""``torchrun --nproc-per-node 2 -m outcore finetune``: real 2-process gloo runs on a tiny model.

The runs that compare 2 ranks with 1 run on each compute device (``compute_device``): on the
simulated accelerator each rank computes on sim and joins the group over ``simgloo``
(``offload/simdist.py``), so the tensors' devices where they meet a collective are checked.

2 ranks with micro-batch B == 1 rank accumulating 2 micro-batches of B over the same
sequences, bit for bit (two gradients summed: a + b is b + a); DCP checkpoints resume at
another world size (2 → 1, 1 → 2) with the same bits; a killed rank stops the other with
one line; ZO exchanges (seed, loss) pairs and writes the one-rank log.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from outcore.training import checkpoint as ckpt
from outcore.training.config import load_config
from outcore.recipes.full_finetune import finetune
from tests._helpers import exported_weights

# A killed rank's peer must be out within this: gloo fails at once on a closed socket; the rest
# is the survivor finishing its backward up to the all-reduce, its exit, and torchrun's. Measured
# 2.0 s (load average ~20 on 2 cores) and 11.9 s (load average ~27); dist_timeout_s is 300 s.
LOST_RANK_EXIT_S = 60.0

FAULT_WRAPPER = """\
import os, sys, time
if os.environ["RANK"] == "1":  # only rank 1 dies, in step 3's gradient all-reduce
    os.environ["OUTCORE_FAULT_AT"] = "grad_all_reduce:3"  # read by outcore._faults at its import
    import outcore._faults as faults
    kill = faults.fault_point

    def noted(name):  # when it dies, for the test to time the survivor
        if name == "grad_all_reduce" and faults._hits == 2:
            open(os.environ["KILLED_AT"], "w").write(repr(time.time()))
        kill(name)
    faults.fault_point = noted
from outcore.cli import main
sys.exit(main(sys.argv[1:]))
"""

RESTART_WRAPPER = """\
import os, sys
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":  # the first attempt only
    os.environ["OUTCORE_FAULT_AT"] = os.environ["DIE_AT"]
from outcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _args(inputs: Path, out: Path, device: torch.device | None = None, **kw) -> dict:
    """A run's config words; ``device``: the compute device (the ranks' too: they are torchrun's
    children, each with ``device=sim`` joins the group over simgloo)."""
    base = dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                max_steps=4, eval_every=0, eval_batches=2, lr=1e-3, warmup_steps=1, output=str(out),
                ui="none", val_fraction=0.1, offload="none", save_every=2, threads=1)
    return {**base, **({"device": device.type} if device is not None else {}), **kw}


def _torchrun(args: dict, *, script: list[str] | None = None, env: dict | None = None, timeout: float = 600,
              launcher: tuple[str, ...] = ()):
    """Run ``outcore finetune`` under ``torchrun --nproc-per-node 2`` (key=value words)."""
    words = [f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in args.items()]
    entry = script or ["-m", "outcore"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher,
           *entry, "finetune", *words]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CI": "1", **(env or {})})


def _one_rank(args: dict):
    return finetune(load_config(overrides=args))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff == 0.0, f"max |difference| {diff}"


@pytest.mark.slow(ci=True)
def test_two_ranks_equal_one_rank_accumulating_and_resume_on_one(tiny_run_inputs, tmp_path, compute_device):
    """AdamW, full fine-tune in memory: the acceptance run, its files, and 2 → 1."""
    two, one = tmp_path / "two", tmp_path / "one"
    res = _torchrun(_args(tiny_run_inputs, two, compute_device))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("outcore: output in") == 1  # rank 0 alone says it
    _one_rank(_args(tiny_run_inputs, one, compute_device, grad_accum=2))
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))

    # rank 0 writes metrics.jsonl with every rank's row; rank 1 its own file
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "ranks.1.step_s" in rows[0]
    own = [json.loads(x) for x in (two / "metrics.rank1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in own] == [1, 2, 3, 4] and own[0]["loss"] == rows[0]["loss"]
    assert (two / "checkpoints" / "step_000002" / "dcp" / ".metadata").is_file()

    # outcore export of the 2-rank run == the 1-rank run's
    from outcore.recipes.export import export_run

    _assert_same(load_file(str(export_run(two, tmp_path / "x2") / "model.safetensors")),
                 exported_weights(one / "final"))

    # 2 → 1: step 2's DCP checkpoint, resumed by one rank with grad_accum 2 (the same 2 micro-batches a step)
    shutil.rmtree(two / "checkpoints" / "step_000004")
    shutil.rmtree(two / "final")
    _one_rank(_args(tiny_run_inputs, two, compute_device, grad_accum=2, resume=str(two)))
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))


@pytest.mark.slow(ci=True)
def test_out_of_core_two_ranks_shard_the_state_equal_one_rank_and_resume_on_one(tiny_run_inputs, tmp_path,
                                                                                compute_device):
    """A full fine-tune out of core on 2 ranks (each holds half of every unit's state: the
    engine reduce-scatters, updates its range and all-gathers) == 1 rank accumulating; its
    sharded DCP checkpoint resumes on one rank with the same bits."""
    two, one = tmp_path / "two", tmp_path / "one"
    kw = dict(offload="nvme", max_grad_norm=0.0, device=compute_device)  # (clipping: the norm's order differs)
    res = _torchrun(_args(tiny_run_inputs, two, **kw))
    assert res.returncode == 0, res.stderr[-3000:]
    _one_rank(_args(tiny_run_inputs, one, grad_accum=2, **kw))
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))
    assert any((two / "checkpoints" / "step_000002" / "units_dcp").iterdir())
    from outcore.recipes.export import export_run  # outcore export of the sharded checkpoint == 1 rank's

    exported = export_run(two, tmp_path / "x2")
    _assert_same(exported_weights(exported), exported_weights(one / "final"))

    shutil.rmtree(two / "checkpoints" / "step_000004")
    shutil.rmtree(two / "final")
    _one_rank(_args(tiny_run_inputs, two, grad_accum=2, resume=str(two), **kw))
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))


@pytest.mark.slow
@pytest.mark.parametrize("method,optim,offload", [("full", "adamw8bit", "none"), ("lora", "adamw", "none"),
                                                   ("lora", "adamw", "cpu")])  # cpu: the base streamed read-only
def test_two_ranks_equal_one_rank_for_adamw8bit_and_lora(tiny_run_inputs, tmp_path, method, optim, offload,
                                                         compute_device):
    two, one = tmp_path / "two", tmp_path / "one"
    kw = dict(method=method, optim=optim, offload=offload, save_every=0, device=compute_device)
    res = _torchrun(_args(tiny_run_inputs, two, **kw))
    assert res.returncode == 0, res.stderr[-3000:]
    _one_rank(_args(tiny_run_inputs, one, grad_accum=2, **kw))
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))


@pytest.mark.parametrize("offload", [pytest.param("none", marks=pytest.mark.slow),
                                     pytest.param("nvme", marks=pytest.mark.slow(ci=True))])
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tiny_run_inputs, tmp_path, offload, compute_device):
    """1 → 2: a one-process checkpoint (out of core: whole units in ``units/``, each rank keeps
    its range of the state) resumed by 2 ranks == the one-process run going on."""
    one, ref = tmp_path / "one", tmp_path / "ref"
    kw = dict(optim="adamw8bit", offload=offload, max_grad_norm=0.0, device=compute_device)
    _one_rank(_args(tiny_run_inputs, ref, grad_accum=2, **kw))
    _one_rank(_args(tiny_run_inputs, one, grad_accum=2, **kw))
    shutil.rmtree(one / "checkpoints" / "step_000004")
    shutil.rmtree(one / "final")
    res = _torchrun(_args(tiny_run_inputs, one, grad_accum=1, resume=str(one), **kw))  # 1 × 2 ranks
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_same(exported_weights(one / "final"), exported_weights(ref / "final"))


@pytest.mark.slow(ci=True)
def test_a_killed_rank_stops_the_other_with_one_line_and_the_checkpoint_is_intact(tiny_run_inputs, tmp_path):
    run = tmp_path / "run"
    wrapper = tmp_path / "fault_rank1.py"
    wrapper.write_text(FAULT_WRAPPER)
    killed_at = tmp_path / "killed_at"
    res = _torchrun(_args(tiny_run_inputs, run), script=[str(wrapper)], env={"KILLED_AT": str(killed_at)})
    after_kill = time.time() - float(killed_at.read_text())  # until torchrun itself has exited
    print(f"torchrun exited {after_kill:.1f} s after rank 1 was killed")
    assert after_kill < LOST_RANK_EXIT_S  # not dist_timeout_s (300 s): gloo fails at once
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("outcore: error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "rank 0 of 2: rank 1 died or stopped answering during the gradient all-reduce" in lines[0]
    assert f"--resume {run}" in lines[0]
    newest = ckpt.latest_checkpoint(run)
    assert newest is not None and newest.name == "step_000002"
    ckpt.verify_checkpoint(newest)
    # resumable, here on one rank with the same 2 micro-batches a step
    res = _one_rank(_args(tiny_run_inputs, run, grad_accum=2, resume=str(run)))
    assert res.steps_done == 4


@pytest.mark.slow(ci=True)
@pytest.mark.parametrize("die_at,continued", [("grad_all_reduce:3", "continuing from step_000002"),
                                              ("grad_all_reduce:1", "no complete checkpoint yet: starting over")])
def test_torchrun_restarts_continue_the_launch_s_own_run(tiny_run_inputs, tmp_path, die_at, continued):
    """``--max-restarts 1``: rank 1 dies in step 3 (or 1) of the first attempt; the restarted ranks
    continue from step 2's checkpoint (or start over) and end with the uninterrupted run's weights."""
    run, one = tmp_path / "run", tmp_path / "one"
    wrapper = tmp_path / "die_once.py"
    wrapper.write_text(RESTART_WRAPPER)
    res = _torchrun(_args(tiny_run_inputs, run), script=[str(wrapper)], env={"DIE_AT": die_at},
                    launcher=("--max-restarts", "1", "--monitor-interval", "0.5"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"outcore: torchrun restart 1 of 1: {continued} in {run}" in res.stderr, res.stderr[-3000:]
    _one_rank(_args(tiny_run_inputs, one, grad_accum=2))
    _assert_same(exported_weights(run / "final"), exported_weights(one / "final"))


@pytest.mark.slow
def test_zo_under_torchrun_writes_the_one_rank_log(tiny_run_inputs, tmp_path, compute_device):
    two, one = tmp_path / "two", tmp_path / "one"
    kw = dict(method="zo", optim="mezo", save_every=0, optim_args={"n_samples": 2}, lr=1e-4, device=compute_device)
    args = _args(tiny_run_inputs, two, **kw)
    args["optim_args.n_samples"] = args.pop("optim_args")["n_samples"]
    res = _torchrun(args)
    assert res.returncode == 0, res.stderr[-3000:]
    from outcore.recipes.zo_finetune import finetune as zo_finetune

    zo_finetune(load_config(overrides=_args(tiny_run_inputs, one, **kw)))
    assert (two / "zo_log.jsonl").read_bytes() == (one / "zo_log.jsonl").read_bytes()
    _assert_same(exported_weights(two / "final"), exported_weights(one / "final"))


@pytest.mark.slow
def test_a_second_launch_on_a_live_run_is_refused_on_every_rank(tiny_run_inputs, tmp_path):
    from outcore.offload.store import hold_lock
    from outcore.training.output_dir import RUN_LOCK

    run = tmp_path / "run"
    run.mkdir()
    lock = hold_lock(run / RUN_LOCK)  # a live run holds it
    try:
        res = _torchrun(_args(tiny_run_inputs, run))
    finally:
        os.close(lock)
    assert res.returncode != 0
    errors = [x for x in res.stderr.splitlines() if x.startswith("outcore: error:")]
    assert len(errors) == 2 and all("is in use by another outcore run" in x for x in errors), res.stderr[-2000:]
