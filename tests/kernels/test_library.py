"""kernels/_library.py: op names, Triton usability, interpreter-safe configs."""
from __future__ import annotations

import torch

from outcore._optional import is_triton_available
from outcore.kernels._library import next_power_of_2, op_name, pick_config, triton_usable


def test_op_name():
    assert op_name("linear_cross_entropy_fwd") == "outcore::linear_cross_entropy_fwd"


def test_next_power_of_2():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]


def test_triton_usable_on_cpu_only_in_interpreter(monkeypatch):
    x = torch.zeros(2)
    assert not triton_usable()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_usable(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_usable(x) == is_triton_available()


def test_pick_config_uses_default_in_interpreter(monkeypatch):
    configs = [{"BLOCK": 128}, {"BLOCK": 256}]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_config(configs, {"BLOCK": 4096}) == {"BLOCK": 4096}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pick_config(configs, {"BLOCK": 4096}) == {"BLOCK": 128}
    assert pick_config([], {"BLOCK": 8}) == {"BLOCK": 8}
