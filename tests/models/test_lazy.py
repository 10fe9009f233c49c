"""load_model_lazily: a meta-device model whose weights are read one at a time."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from outcore.errors import ModelError
from outcore.models import load_model_lazily, load_tokenizer


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lazy") / "m"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root)
    load_tokenizer("default").save_pretrained(root)
    return root


def test_lazy_model_is_meta_and_fill_reads_every_weight(saved_tiny):
    model, tok, fill = load_model_lazily(str(saved_tiny))
    eager = AutoModelForCausalLM.from_pretrained(saved_tiny)
    assert tok is not None
    named = dict(model.named_parameters())
    assert all(p.is_meta for p in named.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives the meta build
    for name, want in eager.named_parameters():
        out = torch.empty_like(want)
        fill(name, out)
        assert torch.equal(out, want), name
    assert not any(b.is_meta for b in model.buffers())  # rotary tables are real


def test_lazy_loading_errors_name_the_problem(saved_tiny, tmp_path):
    _, _, fill = load_model_lazily(str(saved_tiny))
    with pytest.raises(ModelError, match="nope.weight"):
        fill("nope.weight", torch.empty(1))
    with pytest.raises(ModelError, match="local files"):
        load_model_lazily("someone/some-model")
