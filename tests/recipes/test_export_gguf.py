"""GGUF export: the file loads back through transformers (``gguf_file=``) with the exported weights.

Each supported family is exported as f16, bf16 and Q8_0 and read back by transformers'
GGUF reader, which inverts llama.cpp's conventions (the Llama q/k permutation, Gemma's
``1 + w`` norms). The weights read back must equal the exported model's rounded to the
file's type by the ``gguf`` package's own quantizers, bit for bit, so the logits equal those
of the exported model with its weights so rounded (atol 1e-6: Mistral reads back as Llama,
the same forward). Against the unrounded model, the logits stay within what the rounding
costs, measured on these models (max |logit difference|, logits of magnitude ~1):
f16 1.3e-3, bf16 1.3e-2, Q8_0 3.1e-2; the bounds below are those with some headroom.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from outcore.errors import ConfigError, ModelError
from outcore.recipes.export_gguf import GGUF_TYPES, export_gguf, export_run_gguf, write_modelfile
from tests._helpers import ROOT, load_module

# the tiny family models and tokenizer of tests/models (conftest fixtures do not cross folders)
_models = load_module(ROOT / "tests" / "models" / "conftest.py", "_models_conftest")

FAMILIES = _models.FAMILIES
LOGIT_BOUND = {"f16": 5e-3, "bf16": 5e-2, "q8_0": 1e-1}  # vs the unrounded model (measured, see above)


def _rounded(name: str, w: torch.Tensor, gguf_type: str, family: str) -> torch.Tensor:
    """What the file holds for ``w``, read back: matrices rounded to ``gguf_type`` by gguf's
    quantizers, 1-D tensors in f32 (Gemma's norms through its ``+1`` / ``-1``)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    a = w.detach().float().numpy()
    if a.ndim == 1:
        if family == "gemma3_text" and name.endswith("norm.weight"):
            a = (a + np.float32(1.0)) - np.float32(1.0)
        return torch.from_numpy(a)
    qtype = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[gguf_type]
    return torch.from_numpy(dequantize(quantize(a, qtype), qtype).reshape(a.shape).astype(np.float32))


def _saved(tmp_path: Path, family: str, tie: bool = True, **save_kw):
    model = _models.make_family_model(family, tie=tie)
    with torch.no_grad():  # norms away from 1, so a norm convention mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf", **save_kw)
    _models.make_tokenizer().save_pretrained(tmp_path / "hf")
    return model


def _load_back(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _tokens():
    return torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_with_the_rounded_weights(tmp_path, family, gguf_type):
    model = _saved(tmp_path, family)
    path = export_gguf(tmp_path / "hf", tmp_path / "out" / "m.gguf", gguf_type)
    back = _load_back(path)
    loaded = back.state_dict()
    expected = type(model)(model.config).eval()
    expected.load_state_dict({n: _rounded(n, w, gguf_type, family) for n, w in model.state_dict().items()})
    for name, w in expected.state_dict().items():
        assert torch.equal(loaded[name], w), name
    with torch.no_grad():
        logits = back(_tokens()).logits
        torch.testing.assert_close(logits, expected(_tokens()).logits, rtol=0, atol=1e-6)
        assert (logits - model(_tokens()).logits).abs().max() < LOGIT_BOUND[gguf_type]


@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_untied_head_and_shards(tmp_path, gguf_type):
    model = _saved(tmp_path, "llama", tie=False, max_shard_size="40KB")  # several shards and an index
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    back = _load_back(export_gguf(tmp_path / "hf", tmp_path / "out" / "m.gguf", gguf_type))
    assert not back.config.tie_word_embeddings
    want = _rounded("lm_head.weight", model.lm_head.weight, gguf_type, "llama")
    assert torch.equal(back.lm_head.weight, want)
    with torch.no_grad():
        assert (back(_tokens()).logits - model(_tokens()).logits).abs().max() < LOGIT_BOUND[gguf_type]


def test_tokenizer_and_modelfile(tmp_path):
    from transformers import AutoTokenizer

    _saved(tmp_path, "qwen2")
    path = export_gguf(tmp_path / "hf", tmp_path / "out" / "tiny.gguf", "q8_0")
    original, back = _models.make_tokenizer(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "To be, or not to be<eos>"
    assert back(text)["input_ids"] == original(text)["input_ids"]
    assert back.chat_template == original.chat_template
    modelfile = (path.parent / "Modelfile").read_text()
    # the tiny tokenizer's template is no family outcore maps: no TEMPLATE, eos still stops
    assert modelfile.splitlines()[0] == "FROM ./tiny.gguf" and "TEMPLATE" not in modelfile.replace("# no TEMPLATE", "")
    assert 'PARAMETER stop "<eos>"' in modelfile


def test_modelfile_maps_chatml(tmp_path):
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    text = write_modelfile(tmp_path / "x.gguf", chatml, ["<|im_end|>"]).read_text()
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>' in text
    assert text.count('PARAMETER stop "<|im_end|>"') == 1 and 'PARAMETER stop "<|im_start|>"' in text


def test_bad_input_is_one_line(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from outcore.cli import main

    _saved(tmp_path, "llama")
    with pytest.raises(ConfigError, match="--gguf-type 'q4_0' is not one of f16, bf16, q8_0"):
        export_gguf(tmp_path / "hf", tmp_path / "m.gguf", "q4_0")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelError, match="GGUF export supports the families .* not 'gpt2'; export it with --format hf"):
        export_gguf(tmp_path / "gpt2", tmp_path / "m.gguf")
    with pytest.raises(ModelError, match="does not exist"):
        export_run_gguf(tmp_path / "nowhere", tmp_path / "o")
    with pytest.raises(ModelError, match="cannot read the model config in"):
        export_gguf(tmp_path, tmp_path / "m.gguf")
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["export", str(tmp_path / "gpt2"), "--format", "gguf", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("outcore: error: GGUF export supports the families")
    assert not list(tmp_path.rglob("*.gguf*"))  # nothing half-written left behind


def _finetune(inputs: Path, out: Path, **kw):
    from outcore.api import finetune

    return finetune(model=str(inputs / "model"), data=str(inputs / "data.txt"), seq_len=32, batch_size=2,
                    max_steps=2, eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out),
                    ui="none", val_fraction=0.1, **kw)


@pytest.mark.slow(ci=True)
def test_run_exports_from_final_or_its_checkpoint(tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    from outcore.cli import main

    run = tmp_path / "run"
    _finetune(tiny_run_inputs, run, offload="nvme")  # out of core: the checkpoint holds one file per unit
    assert main(["export", str(run), "--format", "gguf", "--gguf-type", "f16"]) == 0
    from_final = (run / "gguf" / "run-f16.gguf").read_bytes()
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    back = _load_back(run / "gguf" / "run-f16.gguf")
    ids = torch.randint(0, final.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(ids).logits - final(ids).logits).abs().max() < LOGIT_BOUND["f16"]
    # a checkpoint newer than final/ (a resumed run cut short) is exported instead, with the same result here
    newer = time.time() + 5
    os.utime(run / "checkpoints" / "step_000002", (newer, newer))
    assert export_run_gguf(run, gguf_type="f16").read_bytes() == from_final
    assert not [p for p in (run / "gguf").iterdir() if p.is_dir()]  # the temporary HF directory is gone


@pytest.mark.slow(ci=True)
def test_embedded_default_round_trips(tmp_path):
    """SmolLM2-135M (the embedded default, a Q8_0/Q4_1 GGUF) exported as f16 reads back with the
    logits of the model it was exported from up to f16's rounding (measured: max |difference|
    0.04 on logits up to 32, the same top-1 token at every position), with its tokenizer,
    special tokens, pre-tokenizer and ChatML template."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from outcore.models import load_model

    model, tokenizer = load_model("default")
    path = export_run_gguf("default", tmp_path, "f16")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1-f16.gguf"
    back = _load_back(path)
    ids = tokenizer("To be, or not to be, that is the question:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(ids).logits, back(ids).logits
    assert (a - b).abs().max() < 0.1, float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    back_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert back_tok(chat)["input_ids"] == tokenizer(chat)["input_ids"]  # <|im_start|> etc. parsed whole
    assert GGUFReader(str(path)).fields["tokenizer.ggml.pre"].contents() == "smollm"
    modelfile = (tmp_path / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{path.name}\nTEMPLATE \"\"\"") and "<|im_start|>assistant" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
