"""The per-rank pieces of a torchrun run, without launching one: the data split, the global
batch kept on resume, the out-of-core refusal, per-rank metrics rows and files, the dashboard's
rank panel."""
from __future__ import annotations

import io
import json

import pytest

from outcore.errors import CheckpointError, ConfigError
from outcore.events import RankStats, RunStarted, StepEvent, TierStats
from outcore.offload.distributed import Ranks
from outcore.training.distributed import across_ranks as dist
from outcore.training.config import load_config


class _Loader:
    def __init__(self):
        self.pos = 0

    def next_batch(self):
        self.pos += 1
        return self.pos - 1

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_each_rank_takes_every_world_th_micro_batch_of_the_step():
    loaders = [_Loader(), _Loader()]
    steps = [dist.my_micro_batches(loaders[r], 2, Ranks(r, 2)) for r in range(2)]
    assert steps == [[0, 2], [1, 3]]  # one rank accumulating 4 takes 0, 1, 2, 3
    assert loaders[0].pos == loaders[1].pos == 4  # the same position on every rank
    assert dist.my_micro_batches(_Loader(), 3, Ranks()) == [0, 1, 2]


def test_resume_keeps_grad_accum_times_ranks():
    cfg = load_config(overrides={"grad_accum": 2, "resume": "runs/x"})
    loader = _Loader()
    dist.restore_loader(loader, {"loader": {"pos": 8}, "micro_batches": 4}, cfg, Ranks(0, 2))
    assert loader.pos == 8
    dist.restore_loader(loader, {"loader": {"pos": 6}}, load_config(overrides={"grad_accum": 2}), Ranks())
    assert loader.pos == 6  # a checkpoint from before: one rank
    with pytest.raises(CheckpointError, match=r"took 4 micro-batches .* take 2 \(grad_accum=2 × 1 rank\(s\)\); "
                                              r"pass grad_accum=4 with 1 rank\(s\) or launch 2 rank\(s\)"):
        dist.restore_loader(loader, {"loader": {"pos": 8}, "micro_batches": 4}, cfg, Ranks())


def test_a_bad_timeout_is_refused():
    with pytest.raises(ConfigError, match="dist_timeout_s=0"):
        load_config(overrides={"dist_timeout_s": 0})


def test_one_process_is_rank_zero_of_one(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    ranks, joined = dist.join_run(load_config())
    assert ranks == Ranks() and not joined
    assert dist.rank_swap_dir(tmp_path / "s", ranks) == tmp_path / "s"
    assert dist.rank_swap_dir(tmp_path / "s", Ranks(1, 2)) == tmp_path / "s" / "rank1"
    assert (tmp_path / "s").is_dir()  # the ranks' shared parent, made for them


def test_a_lost_peer_is_one_line_naming_the_rank_and_the_run():
    with pytest.raises(Exception) as e:
        with dist.peer_guard(Ranks(0, 2), "the gradient all-reduce", "runs/x"):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5: "
                               "Connection reset by peer. This is typically caused by a remote failure")
    assert e.value.exit_code == 5
    assert str(e.value) == ("rank 0 of 2: rank 1 died or stopped answering during the gradient all-reduce "
                            "(Read error [127.0.0.1]:5: Connection reset by peer); the newest complete "
                            "checkpoint is intact: launch again with --resume runs/x")
    with pytest.raises(RuntimeError):  # one process: not a lost rank
        with dist.peer_guard(Ranks(), "x"):
            raise RuntimeError("boom")


def _ranks_event() -> StepEvent:
    tier = TierStats(held_bytes=3 << 30, read_gbps=1.5, write_gbps=0.5)
    ranks = [RankStats(0, 0.5, 0.1, 2 << 30, {"HOST": tier}), RankStats(1, 0.8, 0.4, 2 << 30, {"HOST": tier})]
    return StepEvent(step=1, total_steps=4, loss=2.0, lr=1e-4, tokens_per_s=100.0, step_s=0.5, elapsed_s=0.5,
                     rss_bytes=2 << 30, ranks=ranks)


def test_rank_zero_rows_carry_every_rank_flat(tmp_path):
    from outcore.tui.metrics import step_row

    row = step_row(_ranks_event())
    assert row["ranks.1.step_s"] == 0.8 and row["ranks.1.stall_s"] == 0.4
    assert row["ranks.0.tiers.HOST.held_bytes"] == 3 << 30
    assert all(not isinstance(v, (list, dict)) for v in row.values())
    one = _ranks_event()
    one.ranks = []
    assert not any(k.startswith("ranks") for k in step_row(one)) and "ranks" not in one.to_json()


def test_other_ranks_write_their_own_metrics_file_and_no_view(tmp_path):
    from outcore.tui import make_sink
    from outcore.tui.metrics import MetricsWriter

    sink = make_sink("rich", tmp_path, rank=1)
    assert isinstance(sink, MetricsWriter)
    sink.emit(RunStarted("r", "m", 1, 1, 4, str(tmp_path)))
    sink.emit(_ranks_event())
    sink.close()
    assert json.loads((tmp_path / "metrics.rank1.jsonl").read_text())["step"] == 1
    assert not (tmp_path / "metrics.jsonl").exists()
    with pytest.raises(ConfigError):
        make_sink("fancy", tmp_path, rank=1)


def test_the_dashboard_shows_a_row_per_rank():
    from rich.console import Console

    from outcore.tui.dashboard import Dashboard

    dash = Dashboard(Console(file=io.StringIO(), force_terminal=True, width=112, color_system=None), live=False)
    dash.emit(RunStarted("r", "m", 1, 1, 4, "/tmp/r"))
    dash.emit(_ranks_event())
    c = Console(file=io.StringIO(), force_terminal=True, width=112, color_system=None)
    c.print(dash.render())
    text = c.file.getvalue()
    assert "ranks · 2 · slowest rank 1" in text
    rows = {line.split()[1]: line for line in text.splitlines() if line.split()[1:2] in (["0"], ["1"])}
    assert "800 ms" in rows["1"] and "50" in rows["1"]  # 0.4 s of 0.8 s stalled
    assert "HOST 3.0 GiB  r 1.50 GB/s  w 500 MB/s" in rows["0"]


def test_outcore_plan_says_what_one_rank_of_n_holds(capsys):
    from outcore.cli import main

    assert dist.plan_note(load_config(overrides={"offload": "none", "grad_accum": 2}), 2) == (
        "plan per rank (2 ranks, data parallel: every rank holds a replica of the model and optimizer state "
        "and trains on 2 of the step's 4 micro-batches)")
    assert "every rank holds the weights and 1/2 of the optimizer state" in dist.plan_note(
        load_config(overrides={"offload": "cpu"}), 2)
    assert main(["plan", "--ranks", "-1", "--no-measure"]) == 2
    assert "--ranks -1 must be >= 1" in capsys.readouterr().err


def test_the_ray_train_example_says_how_to_get_ray(monkeypatch):
    import sys

    from outcore.recipes.examples import ray_train

    monkeypatch.setitem(sys.modules, "ray", None)  # not installed (it is not, on the test machines)
    with pytest.raises(ConfigError, match=r"ray is not installed; pip install 'ray\[train\]'"):
        ray_train.main(["--workers", "2", "max_steps=2"])
