"""scripts/bench_big.py: the shapes are the planner's, ``--fast-init`` is seeded, and ``--generate``
streams an NF4 base through ``Generator`` (one pass of every weight per token)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._helpers import ROOT, load_module

SCRIPT = ROOT / "scripts" / "bench_big.py"


@pytest.fixture(scope="module")
def bench():
    return load_module(SCRIPT)


def test_shapes_are_the_planners_reference_shapes(bench):
    from outcore.planner.largest import REFERENCE_SHAPES

    assert bench.SHAPES is REFERENCE_SHAPES and bench.SHAPES["llama3-70b"]["num_hidden_layers"] == 80


def test_fast_init_is_a_seeded_window_per_name(bench):
    a, b, c = torch.empty(3, bench.POOL_NUMEL // 2), torch.empty(3, bench.POOL_NUMEL // 2), torch.empty(7, 64)
    bench._fast_init("model.layers.0.mlp.up_proj.weight", a)
    bench._fast_init("model.layers.0.mlp.up_proj.weight", b)
    bench._fast_init("model.layers.1.mlp.up_proj.weight", c)
    assert torch.equal(a, b) and not torch.equal(a.view(-1)[:448], c.view(-1))
    assert abs(a.std().item() - 0.02) < 1e-3  # wraps around the pool: still N(0, 0.02) values


@pytest.mark.slow
def test_generate_streams_the_nf4_base_again_for_each_token(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--shape", "smollm2-1.7b", "--layers", "4", "--generate", "3",
                          "--method", "qlora", "--dtype", "bfloat16", "--fast-init", "--swap-dir", str(tmp_path),
                          "--json"], capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(out.stdout)
    assert got["base"] == "nf4" and got["new_tokens"] == 3 and len(got["token_ids"]) == 3
    # what the swap holds: the tied bf16 embedding and four blocks' matrices at 0.5625 B a weight
    block = 4 * 2048 * 2048 + 3 * 2048 * 8192
    stored = 49152 * 2048 * 2 + 4 * block * 9 // 16
    assert got["bytes_read"] > 1.5 * stored  # read again for later tokens, not loaded once (DEVICE: 4 units)
    assert list(tmp_path.iterdir()) == []  # the swap went with the run
