"""Fixtures for the model tests: tiny models of each supported family, built in-process."""
from __future__ import annotations

import pytest

FAMILIES = ("llama", "qwen2", "mistral", "gemma3_text")


def make_family_model(family: str, tie: bool = True, layers: int = 2, seed: int = 0):
    """A small random causal LM of ``family`` (fp32, eval mode)."""
    import torch
    from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Qwen2Config)

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
              "gemma3_text": Gemma3TextConfig}[family]
    extra = {"head_dim": 16} if family == "gemma3_text" else {}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(**common, **extra)).float().eval()


def make_tokenizer():
    """A byte-level BPE tokenizer (320 tokens) with a ChatML template, as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["To be, or not to be, that is the question."] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


@pytest.fixture
def family_model():
    """``make_family_model(family, tie=True, layers=2, seed=0)``."""
    return make_family_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def saved_model(tmp_path, tiny_tokenizer):
    """Save a tiny model + tokenizer as a Hugging Face directory; returns ``(model, path)``."""
    def save(family: str = "llama", tie: bool = True):
        model = make_family_model(family, tie=tie)
        path = tmp_path / f"{family}-{'tied' if tie else 'untied'}"
        model.save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        return model, path
    return save
