"""model_parts / decoder_layers / max_positions on tiny models of every supported family."""
from __future__ import annotations

import pytest
import torch

from outcore.errors import ModelError
from outcore.models import (count_parameters, decoder_layers, max_positions, model_parts,
                            parameter_bytes)

FAMILIES = ("llama", "qwen2", "mistral", "gemma3_text")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [True, False])
def test_parts_are_the_models_own_modules(family_model, family, tie):
    model = family_model(family, tie=tie, layers=3)
    parts = model_parts(model)
    assert parts.layers is model.model.layers and len(parts.layers) == 3
    assert decoder_layers(model) is parts.layers
    assert parts.embed is model.get_input_embeddings()
    assert parts.lm_head is model.get_output_embeddings()
    assert parts.final_norm is model.model.norm
    assert parts.rotary is model.model.rotary_emb
    assert parts.tied is tie
    assert (parts.lm_head.weight is parts.embed.weight) is tie
    assert max_positions(model) == 256


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_forward_through_the_parts_equals_the_model(family_model, family):
    # The out-of-core engine runs exactly this loop, block by block.
    model = family_model(family)
    parts = model_parts(model)
    x = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(x).logits
        h = parts.embed(x)
        positions = torch.arange(12)[None].expand(2, -1)
        rope = parts.rotary(h, positions)
        for layer in parts.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        logits = parts.lm_head(parts.final_norm(h))
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_multimodal_gemma3_uses_its_language_model():
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=128)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    model = AutoModelForCausalLM.from_config(Gemma3Config(text_config=text, vision_config=vision))
    parts = model_parts(model)
    assert parts.layers is model.model.language_model.layers and len(parts.layers) == 2
    assert parts.embed is model.get_input_embeddings()
    assert max_positions(model) == 128


def test_parameter_counts_count_tied_weights_once(family_model):
    tied, untied = family_model("llama", tie=True), family_model("llama", tie=False)
    embed = 320 * 64
    assert count_parameters(untied) - count_parameters(tied) == embed
    assert parameter_bytes(tied) == 4 * count_parameters(tied)


def test_unsupported_layout_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ModelError, match=r"GPT2LMHeadModel has no '\.model' decoder"):
        model_parts(gpt2)
    with pytest.raises(ModelError, match=r"GPT2LMHeadModel has no '\.model' decoder"):
        decoder_layers(gpt2)


def test_missing_max_positions_is_named():
    with pytest.raises(ModelError, match=r"Linear's config has no max_position_embeddings"):
        max_positions(torch.nn.Linear(2, 2))
