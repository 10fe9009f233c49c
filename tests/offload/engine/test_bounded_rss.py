"""Bounded: an out-of-core run's peak RSS is its arenas plus a fixed overhead, however large the
model's training state (weights, gradients, AdamW moments) is."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# What a run holds beyond its arenas: the activations the backward needs (~80 MiB here: 32
# blocks x 64 tokens), one unit's gradient and update temporaries, the allocator's slack.
# Stated, and checked.
FIXED_OVERHEAD = 224 * 2**20

_CHILD = textwrap.dedent('''
    import json, sys, tempfile, zlib
    import psutil, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from outcore.models._lazy import materialize_buffers
    from outcore.offload.store.handle import Tier
    from outcore.offload.engine.assemble import offload_model
    from outcore.optim import AdamW

    torch.set_num_threads(2)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=32,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    materialize_buffers(model, cfg)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    base = psutil.Process().memory_info().rss  # interpreter, torch, transformers, the empty model

    def init(slot, out):
        out.normal_(0, 0.02, generator=torch.Generator().manual_seed(zlib.crc32(slot.name.encode())))

    om = offload_model(model, AdamW(model.parameters(), lr=1e-4), offload="nvme", prefetch=1,
                       swap_dir=tempfile.mkdtemp() + "/swap", init_weights=init, max_grad_norm=1.0)
    losses = [float(om.train_step(lambda m, b: m(input_ids=b, labels=b).loss, [ids], 1e-4)) for _ in range(3)]
    arenas = om.store.budget(Tier.DEVICE) + om.store.budget(Tier.HOST)
    om.close()
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec
    hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"base": base, "peak": hwm,
                      "arenas": arenas, "training_state": n * 16, "losses": losses}))
''')


@pytest.mark.slow(ci=True)
def test_peak_rss_is_arenas_plus_a_fixed_overhead():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    assert grown <= r["arenas"] + FIXED_OVERHEAD, r
    # the point: training state (weights, grads, two moments: 16 B/param) is several times that
    assert r["training_state"] >= 4 * grown, r
    assert r["losses"][-1] < r["losses"][0]
