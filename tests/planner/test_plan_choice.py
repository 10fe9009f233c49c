"""The auto choice (planner/choice.py): the fastest that fits, or within 10% of it the one
writing least to the SSD; and the candidates the plan lists."""
from __future__ import annotations

import dataclasses
import json

import pytest

from outcore.offload.store import Tier
from outcore.planner import Budgets, make_plan
from outcore.planner.choice import NEAR_FASTEST, Candidate, choose

GiB = 1 << 30
BIG = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
              disk_read_gbps=2.0, disk_write_gbps=3.0, h2d_gbps=8.0, d2h_gbps=8.0, host_mem_gbps=8.0,
              flops=1e11, measured=True)


def _c(step_s: float, written: int, fits: bool = True, name: str = "x") -> Candidate:
    return Candidate(offload=name, activations="keep", fits=fits, step_s=step_s, written_bytes=written,
                     over=None if fits else "DEVICE 2 GiB > budget 1 GiB")


def test_none_fits():
    assert choose([]) is None
    assert choose([_c(1.0, 0, fits=False), _c(2.0, 5, fits=False)]) is None


def test_the_fastest_wins_when_writes_are_equal():
    assert choose([_c(2.0, 100), _c(1.0, 100), _c(1.05, 100)]) == 1


def test_within_ten_percent_the_one_writing_least_wins():
    assert NEAR_FASTEST == pytest.approx(0.10)
    assert choose([_c(1.00, 2 * GiB), _c(1.09, GiB), _c(1.10, 0)]) == 2  # 10% exactly is within
    assert choose([_c(1.00, 2 * GiB), _c(1.09, GiB), _c(1.11, 0)]) == 1  # 11% is not


def test_a_slower_one_beyond_ten_percent_does_not_win_by_writing_less():
    assert choose([_c(1.0, 2 * GiB), _c(1.2, 0)]) == 0


def test_one_that_does_not_fit_is_neither_chosen_nor_the_yardstick():
    # the 0.5 s candidate does not fit: 1.0 s is the fastest, so 1.15 s is beyond 10%
    assert choose([_c(0.5, 0, fits=False), _c(1.0, GiB), _c(1.15, 0)]) == 1


def test_ties():
    assert choose([_c(1.05, GiB), _c(1.0, GiB)]) == 1  # same writes: the faster
    assert choose([_c(1.0, GiB, name="a"), _c(1.0, GiB, name="b")]) == 0  # all equal: the first considered


@pytest.fixture
def tiny(tiny_llama_factory):
    return tiny_llama_factory(layers=4, hidden=64, vocab=256, heads=4, kv_heads=2, intermediate=128)


def test_auto_lists_every_configuration_and_takes_the_rules_choice(tiny):
    plan = make_plan(tiny, offload="auto", activations="auto", budgets=BIG, seq_len=32)
    names = {(c.offload, c.activations) for c in plan.candidates}
    assert {("none", "keep"), ("cpu", "keep"), ("nvme", "keep"), ("none", "recompute")} <= names
    assert plan.chosen == choose(plan.candidates)
    chosen = plan.candidates[plan.chosen]
    assert (chosen.offload, chosen.activations) == (plan.layout, plan.activations) == ("none", "keep")
    assert chosen.written_bytes == 0 and plan.written_per_step_bytes == 0


def test_tight_ram_lists_what_does_not_fit_and_why(tiny):
    need = make_plan(tiny, offload="none", budgets=BIG, seq_len=32).tier_total("DEVICE")
    tight = dataclasses.replace(BIG, device_bytes=need // 2, ram_bytes=2 * need, host_bytes=2 * need)
    plan = make_plan(tiny, offload="auto", activations="auto", budgets=tight, seq_len=32)
    none = [c for c in plan.candidates if c.offload == "none"]
    assert none and not any(c.fits for c in none) and all(c.over.startswith("DEVICE") for c in none)
    assert plan.candidates[plan.chosen].fits and plan.layout != "none"


def test_nvme_writes_per_step_are_the_write_backs(tiny):
    plan = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32, max_grad_norm=1.0)
    assert len(plan.candidates) == 1 and plan.chosen == 0
    units = plan.units
    # every step writes back the weights and the optimizer state; the gradients stay in RAM
    assert all(u.grads is Tier.HOST for u in units)
    expected = sum(u.weights_bytes + u.state_bytes for u in units)
    expected -= plan.tier_bytes["HOST"]["optimizer scales"]  # small state kinds stay in RAM
    assert plan.written_per_step_bytes == plan.time.io_bytes["nvme_write"] == expected


def test_offloaded_activations_count_as_writes(tiny):
    keep = make_plan(tiny, offload="cpu", budgets=BIG, seq_len=32)
    off = make_plan(tiny, offload="cpu", activations="offload", budgets=BIG, seq_len=32)
    assert keep.written_per_step_bytes == 0
    assert off.written_per_step_bytes == off.tier_bytes["HOST"]["activations"] > 0


def test_table_and_json_show_the_candidates(tiny):
    plan = make_plan(tiny, offload="auto", activations="auto", budgets=BIG, seq_len=32)
    text = plan.table()
    assert "configurations considered" in text and "SSD writes/step" in text
    starred = [line for line in text.splitlines() if line.startswith("* ")]
    assert len(starred) == 1 and starred[0].split()[1:3] == ["none", "keep"]
    d = json.loads(json.dumps(plan.to_dict()))
    assert len(d["candidates"]) == len(plan.candidates)
    assert [c["chosen"] for c in d["candidates"]].count(True) == 1
    assert {"offload", "activations", "fits", "step_s", "written_bytes", "over"} <= set(d["candidates"][0])
    assert d["written_per_step_bytes"] == 0
