"""Fixtures for the data tests: small real tokenizers built in-process (no download)."""
from __future__ import annotations

import pytest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die-to sleep,",
    "Say hi. Hi there! What is two plus two? Four. The answer is 4.",
] * 4


def make_tokenizer(chat_template: str | None = CHATML, eos: bool = True):
    """A byte-level BPE tokenizer (~300 tokens) trained on a few lines, as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    kwargs = {"pad_token": "<pad>"}
    if eos:
        kwargs["eos_token"] = "<eos>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="session")
def tok():
    """Tiny fast tokenizer with a ChatML chat template, EOS ``<eos>`` and pad ``<pad>``."""
    return make_tokenizer()


@pytest.fixture(scope="session")
def tok_plain():
    """Tiny fast tokenizer without a chat template (instruction data uses the Alpaca prompt)."""
    return make_tokenizer(chat_template=None)


@pytest.fixture(scope="session")
def tokenizer_factory():
    """``make_tokenizer`` itself, for tests that need another template."""
    return make_tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer, read from the packaged GGUF (a few seconds)."""
    from outcore.models import load_tokenizer

    return load_tokenizer("default")
