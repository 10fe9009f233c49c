"""GRPO's rollouts (reward and its spread, KL, completion length, generate vs train time) and its
held-out reward in metrics.jsonl, the plain log, the end-of-run summary and the dashboard."""
from __future__ import annotations

import io

from outcore.events import EvalEvent, GRPOStepEvent, RewardEvalEvent, RunFinished, RunStarted
from outcore.tui import make_sink
from outcore.tui.metrics import read_metrics


def _events(out, make_step):
    """A 2-step GRPO run scored before training and at the end, in the recipe's order."""
    return [RunStarted("grpo-run", "tiny", 1000, 1000, 2, out, config={"objective": "grpo"}),
            EvalEvent(0, -0.125, 0.88), RewardEvalEvent(0, 16, 0.125, 0.33, 40.0),
            make_step(1, 2), GRPOStepEvent(1, 0.25, 0.43, 0.0, 41.5, 3.0, 1.0),
            make_step(2, 2), EvalEvent(2, -0.5625, 0.57), RewardEvalEvent(2, 16, 0.5625, 0.4961, 38.25),
            GRPOStepEvent(2, 0.5, 0.5, 0.0012, 39.0, 2.5, 1.5),
            RunFinished(2, 5.0, 1 << 30, out, -0.125, -0.5625, False, None)]


def test_rollouts_and_held_out_reward_in_metrics_and_plain_log(tmp_path, make_step):
    out = tmp_path / "run"
    stream = io.StringIO()
    sink = make_sink("plain", None, stream=stream)
    for ev in _events(str(out), make_step):
        sink.emit(ev)
    sink.close()
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0] == {"step": 0, "eval_loss": -0.125, "eval_reward": 0.125, "eval_reward_std": 0.33,
                       "time": rows[0]["time"]}
    assert rows[1]["step"] == 1 and rows[1]["reward"] == 0.25 and rows[1]["generate_s"] == 3.0
    last = rows[-1]
    assert last["step"] == 2 and last["eval_reward"] == 0.5625 and last["kl"] == 0.0012
    assert last["completion_length"] == 39.0 and last["train_s"] == 1.5
    text = stream.getvalue()
    assert ("rollouts @ step 2: reward 0.5000 ± 0.5000, kl 0.0012, 39.0 tokens/completion, generate 2.5s, "
            "train 1.5s") in text
    assert "held-out reward @ step 2: 0.5625 ± 0.4961 over 16 prompts (38.2 tokens/completion)" in text
    assert "held-out reward  base 0.1250 -> final 0.5625" in text and "eval perplexity" not in text
    assert "eval @" not in text  # (the eval loss is minus the held-out reward: no line of its own)


def test_dashboard_shows_rollouts_and_held_out_reward(tmp_path, make_step, dashboard_text):
    text = dashboard_text(_events(str(tmp_path / "run"), make_step)[:-1], tmp_path / "run")
    assert "rollout  reward 0.5000 ± 0.5000  kl 0.0012  39 tok  gen 62% / train 38%" in text
    assert "reward   held-out 0.1250 -> 0.5625  @2" in text
