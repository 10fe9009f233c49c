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


def test_gguf_metadata_reads_what_the_gguf_package_reads():
    """outcore's metadata reader (it steps over the vocabulary's arrays) against ``gguf``'s own,
    on every number, boolean and string of the default GGUF; arrays are left out."""
    from gguf import GGUFReader, GGUFValueType

    from outcore.models._gguf_cache import gguf_metadata

    fields = GGUFReader(str(default_model_path())).fields
    plain = {k for k, f in fields.items() if f.types[0] != GGUFValueType.ARRAY
             and not k.startswith("GGUF.")}  # the reader's own: the header's version and counts
    assert {"tokenizer.ggml.eos_token_id", "llama.block_count", "tokenizer.ggml.model"} <= plain
    assert gguf_metadata(default_model_path(), plain) == {k: fields[k].contents() for k in plain}
    assert gguf_metadata(default_model_path(), {"tokenizer.ggml.tokens", "no.such.key"}) == {}


def test_the_tokenizer_says_what_the_gguf_says(tmp_path):
    """The tokenizer built from the GGUF has the file's special tokens (named there by id) and,
    the file's tokenizer being GPT-2 BPE, saves as one that ``gguf`` reads as GPT-2 BPE (what
    ``export --format gguf`` needs), whatever transformers made of it: 5.17 made SmolLM2's EOS
    ``<|im_start|>``, with no pad token, and a BPE with SentencePiece's byte fallback and decoder."""
    import gguf
    from tokenizers import decoders

    from outcore.models._gguf_cache import reconciled_with_gguf

    want = ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    tok = load_tokenizer("default", cache_dir=tmp_path)  # no cache entry: built from the GGUF
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == want
    tok.save_pretrained(tmp_path / "as_loaded")
    assert gguf.BpeVocab(tmp_path / "as_loaded").vocab_size == len(tok)

    # what transformers 5.17 gave, put right
    ids = tok("Hi there,\n  2024 — café")["input_ids"]
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    tok.backend_tokenizer.model.byte_fallback = True
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                       decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    tok.save_pretrained(tmp_path / "like_5_17")
    with pytest.raises(FileNotFoundError, match="GPT-2 BPE"):
        gguf.BpeVocab(tmp_path / "like_5_17")
    fixed = reconciled_with_gguf(tok, default_model_path())
    assert (fixed.bos_token, fixed.eos_token, fixed.pad_token, fixed.unk_token) == want
    assert (fixed.eos_token_id, fixed.pad_token_id) == (2, 2)
    assert fixed("Hi there,\n  2024 — café")["input_ids"] == ids
    assert fixed.decode(ids) == "Hi there,\n  2024 — café"
    fixed.save_pretrained(tmp_path / "fixed")
    assert gguf.BpeVocab(tmp_path / "fixed").vocab_size == len(tok)
