"""The embedded default model (SmolLM2-135M-Instruct GGUF): real dequantization and its cache."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from outcore.models import (default_model_path, gguf_cache_path, load_model, load_tokenizer,
                            max_positions, model_parts)


@pytest.mark.slow(ci=True)
def test_default_model_loads_and_caches(tmp_path):
    start = time.perf_counter()
    model, tokenizer = load_model("default", cache_dir=tmp_path)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    again, tokenizer2 = load_model("default", cache_dir=tmp_path)
    second_s = time.perf_counter() - start
    print(f"default model: first load (dequantize + write cache) {first_s:.1f} s, "
          f"second load (safetensors cache) {second_s:.1f} s")  # noisy, shared machine
    assert second_s < first_s

    assert type(model).__name__ == "LlamaForCausalLM"
    parts = model_parts(model)
    assert len(parts.layers) == 30 and parts.tied and max_positions(model) == 8192
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values()))
    assert tokenizer2.chat_template == tokenizer.chat_template and tokenizer2.eos_token == "<|im_end|>"
    assert load_tokenizer("default", cache_dir=tmp_path).get_vocab() == tokenizer.get_vocab()

    # The dequantized values are exactly what the gguf library decodes (a Q4_1 tensor).
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(default_model_path()))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    reference = torch.from_numpy(np.ascontiguousarray(dequantize(raw.data, raw.tensor_type)))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, reference)

    # A real pretrained model: far below the loss of a uniform guess (ln 49152 ~ 10.8).
    ids = tokenizer("To be, or not to be, that is the question: Whether 'tis nobler in the mind "
                    "to suffer the slings and arrows of outrageous fortune", return_tensors="pt")
    with torch.no_grad():
        loss = model(**ids, labels=ids["input_ids"]).loss.item()
    assert loss < 5.0

    half, _ = load_model("default", dtype=torch.bfloat16, cache_dir=tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert gguf_cache_path(default_model_path(), tmp_path).is_dir()
