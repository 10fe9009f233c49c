"""Generation (``recipes/generate.py``): the tokens transformers' ``generate`` gives, in memory and
with the weights streamed through the tiers; streaming, stopping, run directories, bad input."""
from __future__ import annotations

import threading

import pytest
import torch

import outcore
from outcore.errors import CheckpointError, ConfigError, ModelError
from outcore.offload.engine.units import WEIGHTS, Part
from outcore.recipes.generate import STOP, Completion, load_generator, resolve_model_or_run

PROMPTS = ["Hello there", "To be, or not to be: that is the question"]  # two lengths: left padding


def _reference(model_dir, texts: list[str], max_new_tokens: int, add_special_tokens: bool = True,
               device: torch.device = torch.device("cpu")) -> list[list[int]]:
    """Greedy tokens of the prompts from transformers alone (one left-padded batch, in memory on
    ``device``), cut after an EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    rows = out[:, batch["input_ids"].shape[1]:].tolist()
    return [row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row for row in rows]


@pytest.mark.parametrize("offload", ["none", "nvme", "cpu"])
def test_greedy_tokens_equal_transformers_generate(tiny_chat_model, tmp_path, offload, compute_device):
    want = _reference(tiny_chat_model, PROMPTS, 12, device=compute_device)
    assert len(set(want[0])) > 3  # a model that says something: the check can fail
    with load_generator(tiny_chat_model, offload=offload, swap_dir=tmp_path / "swap",
                        device=compute_device.type) as gen:
        assert gen.offload == offload
        got = gen.generate(PROMPTS, max_new_tokens=12, chat=False)
        if offload == "nvme":  # every token read the weights again (2 blocks: the window holds them all)
            assert gen.tier_stats()["NVME"].read_bytes > 0
    assert [c.token_ids for c in got] == want
    assert [c.prompt for c in got] == PROMPTS
    assert all(c.finish_reason in (STOP, "length") for c in got)


def test_chat_template_and_sampling_are_the_same_streamed(tiny_chat_model, tmp_path, compute_device):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    templated = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=False) for p in PROMPTS]
    want = _reference(tiny_chat_model, templated, 10, add_special_tokens=False, device=compute_device)
    kw = dict(max_new_tokens=10, temperature=0.9, seed=7)
    with load_generator(tiny_chat_model, offload="none", device=compute_device.type) as gen:
        assert [c.token_ids for c in gen.generate(PROMPTS, max_new_tokens=10)] == want  # chat by default
        sampled = gen.generate(PROMPTS, **kw)
        assert sampled == gen.generate(PROMPTS, **kw)  # the seed decides
        assert sampled != gen.generate(PROMPTS, **{**kw, "seed": 8})
    with load_generator(tiny_chat_model, offload="nvme", swap_dir=tmp_path / "swap", device=compute_device.type) as gen:
        assert gen.generate(PROMPTS, **kw) == sampled


def test_stream_yields_the_text_and_stopping_leaves_the_model_usable(tiny_chat_model, tmp_path):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "How are you?"}]
    with load_generator(tiny_chat_model, offload="nvme", swap_dir=tmp_path / "swap") as gen:
        (whole,) = gen.generate([conversation], max_new_tokens=16)
        assert "".join(gen.stream(conversation, max_new_tokens=16)) == whole.text
        # stop after the first piece (what Ctrl-C does in a chat): the worker ends, nothing is left held
        pieces = gen.stream(conversation, max_new_tokens=3000)
        next(pieces)
        pieces.close()
        assert [t.name for t in threading.enumerate() if t.name == "outcore-generate"] == []
        assert gen.generate([conversation], max_new_tokens=16) == [whole]


def test_a_run_directory_gives_its_final_model_or_its_newest_checkpoint(tiny_run_inputs, tmp_path):
    run = tmp_path / "run"
    outcore.finetune(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                     batch_size=2, max_steps=2, eval_every=0, eval_batches=1, output=str(run), ui="none",
                     val_fraction=0.1, offload="none", export=False)
    spec, temporary = resolve_model_or_run(run)  # no final/: the checkpoint, exported aside
    assert temporary is not None and spec.startswith(str(run))
    with load_generator(run, offload="none") as gen:
        (from_checkpoint,) = gen.generate(["To be"], max_new_tokens=4, chat=False)
    temporary.cleanup()
    assert [p.name for p in run.glob("generate-*")] == []  # the temporary export is gone
    outcore.finetune(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                     batch_size=2, max_steps=2, eval_every=0, eval_batches=1, output=str(run), ui="none",
                     val_fraction=0.1, offload="none", overwrite=True)
    assert resolve_model_or_run(run) == (str(run / "final"), None)
    (from_final,) = outcore.generate(run, "To be", max_new_tokens=4, chat=False, offload="none")
    assert isinstance(from_final, Completion) and from_final.token_ids == from_checkpoint.token_ids


def test_bad_input_is_one_clear_error(tiny_chat_model, tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        outcore.generate(tmp_path / "missing", "Hi")
    with pytest.raises(ConfigError, match="prompt 2 is empty"):
        outcore.generate(tiny_chat_model, ["Hi", "  "])
    with pytest.raises(ConfigError, match="temperature"):
        outcore.generate(tiny_chat_model, "Hi", temperature=-1)
    with pytest.raises(ConfigError, match="offload"):
        outcore.generate(tiny_chat_model, "Hi", offload="gpu")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("max_steps: 1\n")
    with pytest.raises(CheckpointError, match="no final/ model and no complete checkpoint"):
        outcore.generate(tmp_path / "run", "Hi")


@pytest.mark.slow(ci=True)
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_the_default_model_answers_as_transformers_does(tmp_path, offload):
    from outcore.models import load_model

    model, tok = load_model("default")
    batch = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
    want = model.generate(**batch, max_new_tokens=6, do_sample=False)[0, batch["input_ids"].shape[1]:].tolist()
    del model
    (got,) = outcore.generate("default", "What is the capital of France?", max_new_tokens=6, offload=offload,
                              swap_dir=tmp_path / "swap")
    assert got.token_ids == want and got.text.startswith("The capital of France")


def test_each_token_streams_the_weights_again_with_the_same_tokens(tiny_llama_factory, tmp_path, compute_device):
    from outcore.offload.engine import StreamedInference

    ids = torch.tensor([[1, 5, 9, 33, 70]], device=compute_device)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = tiny_llama_factory(layers=8).to(compute_device).generate(ids, **kw)
    model = tiny_llama_factory(layers=8)  # 8 blocks: more than the DEVICE window of k=2 holds
    streamed = StreamedInference(model, offload="nvme", swap_dir=tmp_path / "swap", prefetch=2, device=compute_device)
    try:
        assert torch.equal(model.generate(ids, **kw), want)
        nvme = streamed.tier_stats()["NVME"]
        assert nvme.read_bytes > 4 * nvme.held_bytes  # read again for each of the 12 forwards, not once
    finally:
        streamed.close()
    assert not (tmp_path / "swap").exists()


def test_nf4_streamed_generation_equals_the_nf4_rounded_model(tiny_llama_factory, tmp_path):
    """QLoRA's base streamed for inference (how a 70B model generates here): the blocks' matrices
    stored and read as NF4 (0.56 B a weight) give the tokens of the model with them NF4-rounded."""
    from outcore.offload.engine import StreamedInference
    from outcore.offload.engine.nf4 import nf4_round_trip

    ids = torch.tensor([[1, 5, 9, 33, 70]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = tiny_llama_factory(layers=4)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.copy_(nf4_round_trip(p, p.dtype))
    want = ref.generate(ids, **kw)
    model = tiny_llama_factory(layers=4)
    streamed = StreamedInference(model, offload="nvme", swap_dir=tmp_path / "swap", prefetch=1,
                                 device="cpu", quantize_frozen=True)
    try:
        block = streamed.engine.units[1]
        assert block.layout.nf4 is not None and block.layout.handles[Part(WEIGHTS)].nbytes < 0.2 * block.numel * 4
        assert torch.equal(model.generate(ids, **kw), want)
    finally:
        streamed.close()
