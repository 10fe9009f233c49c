"""The real GGUF path on a tiny GGUF written in the test: dequantization, name mapping, cache.

A random tiny Llama is converted the way llama.cpp's ``convert_hf_to_gguf.py``
does it (q/k rows permuted for its RoPE layout, Q8_0 matrices, f32 norms, tied
output), then loaded through ``load_model``: every weight must equal the Q8_0
round trip of the original, exactly, and the logits must match the model
rebuilt from those weights.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from outcore.models import gguf_cache_path, load_model, model_parts

HEADS, KV_HEADS = 4, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q8_roundtrip(w: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    return dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)


def write_tiny_gguf(path, model, tokenizer) -> None:
    """Write ``model`` (a tiny tied LlamaForCausalLM) + tokenizer as a Q8_0 GGUF."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in definition["model"]["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)

    def matrix(name, w):
        writer.add_tensor(name, quantize(w, GGMLQuantizationType.Q8_0),
                          raw_dtype=GGMLQuantizationType.Q8_0)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    matrix("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        matrix(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        matrix(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        matrix(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        matrix(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        matrix(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        matrix(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        matrix(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path, family_model, tiny_tokenizer):
    model = family_model("llama", tie=True)
    with torch.no_grad():  # non-trivial norms, so a mix-up of norm tensors would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path, model, tiny_tokenizer)
    return model, path


def test_tiny_gguf_dequantizes_to_the_q8_roundtrip(tiny_gguf, tmp_path):
    reference, path = tiny_gguf
    model, tokenizer = load_model(str(path), cache_dir=tmp_path / "cache")
    assert gguf_cache_path(path, tmp_path / "cache").is_dir()
    loaded = model.state_dict()
    for name, w in reference.state_dict().items():
        w = w.numpy()
        want = w if "norm" in name else _q8_roundtrip(w)  # norms are stored as f32
        assert np.array_equal(loaded[name].numpy(), want), name
    assert model_parts(model).tied

    expected = type(reference)(reference.config).eval()
    expected.load_state_dict({k: v.clone() for k, v in loaded.items()})
    x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, expected(x).logits, rtol=0, atol=1e-5)
    text = "To be, or not to be"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_tiny_gguf_second_load_comes_from_the_cache(tiny_gguf, tmp_path, monkeypatch):
    _, path = tiny_gguf
    first, _ = load_model(str(path), cache_dir=tmp_path / "cache")
    from outcore.models import _gguf_cache

    def must_not_run(gguf_file):
        raise AssertionError("dequantized again although the cache is complete")

    monkeypatch.setattr(_gguf_cache, "_dequantize", must_not_run)
    second, _ = load_model(str(path), dtype=torch.bfloat16, cache_dir=tmp_path / "cache")
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b), name
