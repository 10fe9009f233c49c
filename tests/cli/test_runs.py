"""``outcore runs``: each run's status from what its directory holds, on real tiny runs
(finished, cut by Ctrl-C after a checkpoint, cut before one) and hand-made broken ones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from outcore.training.config import load_config, save_config
from outcore.training.runs import describe_run, find_runs
from outcore.cli import main
from outcore.tui.metrics import MetricsWriter
from outcore.cli.runs import plain_table


class _MetricsThenCtrlC(MetricsWriter):
    """metrics.jsonl as ``outcore finetune`` writes it, and a Ctrl-C after step ``stop_at``."""

    def __init__(self, out: Path, stop_at: int | None):
        super().__init__(out)
        self.stop_at = stop_at

    def emit(self, event):
        super().emit(event)
        if type(event).__name__ == "StepEvent" and event.step == self.stop_at:
            raise KeyboardInterrupt


def _run(inputs: Path, out: Path, stop_at: int | None = None, **kw):
    from outcore.recipes.full_finetune import finetune

    cfg = load_config(overrides=dict(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32,
                                     batch_size=2, max_steps=4, eval_every=2, eval_batches=1, lr=1e-3,
                                     warmup_steps=1, output=str(out), ui="none", val_fraction=0.1,
                                     offload="none", save_every=2, **kw))
    try:
        return finetune(cfg, sink=_MetricsThenCtrlC(out, stop_at))
    except KeyboardInterrupt:
        return None


@pytest.fixture(scope="module")
def runs_root(tiny_run_inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _run(tiny_run_inputs, root / "done")
    _run(tiny_run_inputs, root / "cut", stop_at=3)  # the step-2 checkpoint stays
    _run(tiny_run_inputs, root / "early", stop_at=1)  # before the first checkpoint
    (root / "garbled").mkdir()
    (root / "garbled" / "config.yaml").write_text("lr: [unclosed\n")
    zo = load_config(overrides=dict(method="zo", optim="mezo", max_steps=5, output=str(root / "group" / "zo")))
    (root / "group" / "zo").mkdir(parents=True)
    save_config(zo, root / "group" / "zo" / "config.yaml")
    (root / "group" / "zo" / "zo_log.jsonl").write_text('{"format": "outcore-zo-log/1", "header": {}}\n{}\n{}\n')
    (root / "notarun").mkdir()
    return root


@pytest.mark.slow(ci=True)  # three tiny training runs
def test_statuses_from_what_each_run_holds(runs_root):
    infos = {p.name: describe_run(p, _rows(p)) for p in find_runs(runs_root)}
    assert sorted(infos) == ["cut", "done", "early", "garbled", "zo"]  # notarun has no config.yaml
    done, cut, early = infos["done"], infos["cut"], infos["early"]
    assert (done.status, done.steps_done, done.max_steps, done.resume_step) == ("finished", 4, 4, None)
    last = json.loads((runs_root / "done" / "metrics.jsonl").read_text().splitlines()[-1])
    assert done.eval_loss == last["eval_loss"] and done.method == "full/adamw"
    assert (cut.status, cut.steps_done, cut.resume_step) == ("interrupted", 3, 2)
    assert cut.note == f"outcore finetune --resume {runs_root / 'cut'}"
    assert (early.status, early.steps_done, early.resume_step) == ("failed", 1, None)
    assert early.note == "stopped at step 1 before its first checkpoint"
    assert infos["garbled"].status == "failed" and infos["garbled"].note.startswith("config.yaml unreadable")
    assert (infos["zo"].status, infos["zo"].steps_done, infos["zo"].resume_step) == ("interrupted", 2, 2)


@pytest.mark.slow(ci=True)
def test_a_finished_run_without_final_is_resumable(runs_root, tmp_path):
    import shutil

    run = tmp_path / "done"
    shutil.copytree(runs_root / "done", run)
    shutil.rmtree(run / "final")  # e.g. killed while exporting: --resume runs the export again
    info = describe_run(run, _rows(run))
    assert (info.status, info.resume_step) == ("interrupted", 4)


@pytest.mark.slow(ci=True)
def test_cli_table_and_json(runs_root, capsys):
    assert main(["runs", str(runs_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "STEPS", "EVAL", "LOSS", "METHOD", "MODEL"]
    by_run = {line.split()[0]: line for line in lines[1:]}
    assert list(by_run) == ["cut", "done", "early", "garbled", "group/zo"]
    assert "interrupted (resume from step 2)" in by_run["cut"] and " 3/4 " in by_run["cut"]
    assert by_run["done"].split()[1:3] == ["finished", "4/4"]
    assert "failed: stopped at step 1 before its first checkpoint" in by_run["early"]

    assert main(["runs", str(runs_root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [Path(r["path"]).name for r in rows] == ["cut", "done", "early", "garbled", "zo"]
    assert rows[1]["status"] == "finished" and rows[1]["steps_done"] == 4


def _hand_made(root: Path, name: str, checkpoint: int | None, final: bool, logged: int, export: bool = True):
    """A run directory laid out as the recipe leaves it, without training."""
    run = root / name
    run.mkdir(parents=True)
    save_config(load_config(overrides=dict(max_steps=4, output=str(run), export=export)), run / "config.yaml")
    if checkpoint is not None:
        (run / "checkpoints" / f"step_{checkpoint:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{checkpoint:06d}" / "COMPLETE").write_text("{}")
    (run / "checkpoints" / "step_000099.tmp").mkdir(parents=True)  # a checkpoint cut while written: ignored
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    rows = [{"step": s, "loss": 2.0} for s in range(1, logged + 1)]
    if rows:
        rows[-1]["eval_loss"] = 1.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')
    return run


@pytest.mark.parametrize("checkpoint, final, logged, export, status, resume", [
    (4, True, 4, True, "finished", None),
    (4, False, 4, False, "finished", None),  # export=false: no final/ to wait for
    (4, False, 4, True, "interrupted", 4),
    (2, False, 3, True, "interrupted", 2),
    (None, False, 1, True, "failed", None),
    (None, False, 0, True, "failed", None),
])
def test_hand_made_runs(tmp_path, checkpoint, final, logged, export, status, resume):
    run = _hand_made(tmp_path, "r", checkpoint, final, logged, export)
    info = describe_run(run, _rows(run))  # the torn last metrics line is skipped
    assert (info.status, info.steps_done, info.max_steps, info.resume_step) == (
        status, max(logged, checkpoint or 0), 4, resume)
    assert info.eval_loss == (1.5 if logged else None)


def test_a_swap_dir_held_by_a_live_process_is_a_running_run(tmp_path):
    import fcntl
    import os

    from outcore.offload.store import LOCK_NAME

    run = _hand_made(tmp_path, "r", 2, False, 3)
    (run / "swap").mkdir()
    (run / "swap" / LOCK_NAME).write_text("12345\n")
    assert describe_run(run).status == "interrupted"  # a lock nobody holds: a killed run's leftover
    fd = os.open(run / "swap" / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as SwapDir holds it while its run lives
        assert describe_run(run).status == "running"
    finally:
        os.close(fd)


def test_empty_and_missing_folders(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no runs under {tmp_path} (a run is a folder holding config.yaml)\n"
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("outcore: error: ") and "is not a directory" in err


def test_plain_table_pads_columns():
    text = plain_table([("a", "finished", "4/4", "2.0000", "full/adamw", "default")])
    assert text.splitlines() == ["RUN  STATUS    STEPS  EVAL LOSS  METHOD      MODEL",
                                 "a    finished  4/4    2.0000     full/adamw  default"]


def _rows(run: Path):
    from outcore.tui.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl")
