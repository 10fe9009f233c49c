"""The family matrix: every family outcore claims trains out of core exactly as in memory.

Per family a tiny random config of its own class (2 layers, hidden 64) is saved as a
real Hugging Face directory (safetensors + a tokenizer) and trained through the
recipe (``outcore.recipes.full_finetune.finetune``): the out-of-core run loads the
directory lazily (meta device, weights read unit by unit), streams everything
through NVMe and must give the in-memory run's losses and exported weights, bit for
bit (fp32, AdamW); the export must load back in transformers. LoRA out of core must
equal LoRA in memory. The special parts of each family (Gemma's scaled embeddings,
norms with offsets and final-logit soft-capping, sliding-window / alternating
attention, Phi-3's fused projections, OLMo-2's post-norms, the routers and fused
expert weights of the mixture-of-experts families and their auxiliary loss) go
through the general mechanism: no test here knows a family's internals.

GGUF: the families are tested from safetensors directories only. Writing a GGUF of
each family needs llama.cpp's per-family converter (tensor names, q/k permutations),
which the ``gguf`` package does not ship; the GGUF path itself is tested on Llama in
``test_gguf_tiny.py``.
"""
from __future__ import annotations

import pytest
import torch

from outcore.models import SUPPORTED_MODEL_TYPES
from outcore.training.config import load_config
from outcore.recipes.full_finetune import finetune
from tests._helpers import exported_weights

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
#: family -> (config class, what its tiny config needs beyond SHAPE); sliding windows of
#: 8 tokens so that 32-token sequences really use them
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "tie_word_embeddings": True}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "tie_word_embeddings": True,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, **MOE}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16, **MOE}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "head_dim": 16, "sliding_window": 8, **MOE}),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")


def family_config(family: str):
    """The tiny random config of ``family`` (use_cache off, as in training)."""
    import transformers

    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(**{**SHAPE, **extra})
    config.use_cache = False
    return config


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tiny_tokenizer):
    """``family_dir(family)``: the family's tiny model saved as an HF directory (safetensors)."""
    from transformers import AutoModelForCausalLM

    root, made = tmp_path_factory.mktemp("families"), {}

    def make(family: str):
        if family not in made:
            torch.manual_seed(0)
            path = root / family
            AutoModelForCausalLM.from_config(family_config(family)).save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            made[family] = path
        return made[family]
    return make


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("families_data") / "data.txt"
    path.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind "
                    "to suffer the slings and arrows of outrageous fortune. " * 40)
    return path


def _run(model_dir, data, out, **kw):
    base = dict(model=str(model_dir), data=str(data), seq_len=32, batch_size=2, max_steps=3,
                eval_every=0, eval_batches=1, lr=1e-3, warmup_steps=1, output=str(out), ui="none",
                val_fraction=0.1, offload="none", max_grad_norm=1.0, log_every=1)
    return finetune(load_config(overrides={**base, **kw}))  # no sink: the recipe's NullSink


def test_the_matrix_is_the_supported_list():
    """One list: the families outcore claims are exactly the families tested here."""
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)
    for family in FAMILIES:
        assert family_config(family).model_type == family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lazy_load_builds_the_eager_model(family, family_dir):
    """Meta-device parameters, every weight read as stored, and the computed buffers (rotary
    tables, embedding scales) equal to the eagerly loaded model's."""
    from transformers import AutoModelForCausalLM

    from outcore.models import load_model_lazily

    path = family_dir(family)
    model, _, fill = load_model_lazily(str(path), tokenizer=False)
    eager = AutoModelForCausalLM.from_pretrained(path)
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == dict(eager.named_buffers()).keys()
    for name, want in eager.named_buffers():
        assert torch.equal(buffers[name], want), name
    for name, want in eager.named_parameters():
        out = torch.empty_like(want)
        fill(name, out)
        assert torch.equal(out, want), name


@pytest.mark.slow(ci=True)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_out_of_core_equals_in_memory(family, family_dir, data_file, tmp_path):
    """Lazy load, everything through NVMe, 3 AdamW steps: the in-memory run, bit for bit,
    and the export loads back in transformers."""
    from transformers import AutoModelForCausalLM

    path = family_dir(family)
    mem = _run(path, data_file, tmp_path / "mem")
    ooc = _run(path, data_file, tmp_path / "ooc", offload="nvme")
    assert mem.losses == ooc.losses and len(ooc.losses) == 3
    a, b = exported_weights(mem.output_dir / "final"), exported_weights(ooc.output_dir / "final")
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(ooc.output_dir / "final")
    assert reloaded.config.model_type == family
    trained = reloaded.state_dict()
    changed = [n for n, t in b.items() if not torch.equal(t, AutoModelForCausalLM.from_pretrained(path)
                                                              .state_dict()[n])]
    assert changed  # the run really trained
    for name, t in b.items():
        assert torch.equal(trained[name], t), name


@pytest.mark.slow(ci=True)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_out_of_core_equals_lora_in_memory(family, family_dir, data_file, tmp_path):
    """LoRA: the frozen base streams from NVMe, the adapters stay resident; same losses and
    (merged in another order) the same export."""
    path = family_dir(family)
    kw = dict(method="lora", lr=1e-2)
    mem = _run(path, data_file, tmp_path / "mem", **kw)
    ooc = _run(path, data_file, tmp_path / "ooc", offload="nvme", **kw)
    assert mem.losses == ooc.losses
    a, b = exported_weights(mem.output_dir / "final"), exported_weights(ooc.output_dir / "final")
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, rtol=0, atol=1e-6, msg=name)


#: QLoRA in memory runs bitsandbytes' NF4 layers, whose CPU matmul fails on a biased
#: projection in training (Qwen2's and GPT-OSS's q/k/v): those two have no in-memory reference
QLORA_FAMILIES = [f for f in FAMILIES if f not in ("qwen2", "gpt_oss")]


@pytest.mark.slow
@pytest.mark.parametrize("family", QLORA_FAMILIES)
def test_qlora_out_of_core_matches_qlora_in_memory(family, family_dir, data_file, tmp_path):
    """QLoRA: the same NF4 codes in memory (bitsandbytes layers) and streamed (dequantized on
    fetch). bitsandbytes' CPU kernel rounds the block absmax to bf16 and the fp32 path does
    not, so the first loss (same weights) agrees closely and the later ones drift a little."""
    pytest.importorskip("bitsandbytes")
    path = family_dir(family)
    kw = dict(method="qlora", lr=1e-3)
    mem = _run(path, data_file, tmp_path / "mem", **kw)
    ooc = _run(path, data_file, tmp_path / "ooc", offload="nvme", **kw)
    assert len(mem.losses) == len(ooc.losses) == 3
    assert mem.losses[0] == pytest.approx(ooc.losses[0], rel=2e-3)
    assert mem.losses == pytest.approx(ooc.losses, rel=2e-2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zo_block_forward_is_the_model_loss(family):
    """ZO (in memory and out of core: the same block-wise forward) sees the model's own loss:
    each layer's mask and rotary table by its attention type, soft-capped logits, the
    model's own loss function. An MoE model is trained without its routers' auxiliary loss."""
    from transformers import AutoModelForCausalLM

    from outcore.offload.zo import CausalLMBlocks

    config = family_config(family)
    config.output_router_logits = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with torch.no_grad():
        assert torch.equal(CausalLMBlocks(model).loss(batch), model(**batch).loss)


def test_zo_refuses_a_router_loss_it_would_not_add():
    """ZO's block-wise loss has no routers' auxiliary loss: a config that asks for one is
    refused before any work, in one line naming the setting."""
    from transformers import AutoModelForCausalLM

    from outcore.errors import ConfigError
    from outcore.offload.zo import CausalLMBlocks

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("mixtral"))
    with pytest.raises(ConfigError, match="output_router_logits=True, router_aux_loss_coef=0.05"):
        CausalLMBlocks(model)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_aux_loss_reaches_the_loss_out_of_core(family, tmp_path):
    """The routers' load-balancing loss is part of the streamed loss, exactly as in memory."""
    from transformers import AutoModelForCausalLM

    from outcore.offload.engine import offload_model
    from outcore.optim import AdamW

    config = family_config(family)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).train()
    torch.manual_seed(0)
    ooc = AutoModelForCausalLM.from_config(config).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    om = offload_model(ooc, AdamW(ooc.parameters(), lr=1e-3), offload="nvme", swap_dir=tmp_path / "swap",
                       prefetch=1)
    aux: dict[str, list[torch.Tensor]] = {"mem": [], "ooc": []}

    def loss_of(key):
        def loss(model, ids):
            out = model(input_ids=ids, labels=ids)
            aux[key].append(out.aux_loss.detach())
            return out.loss
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)
        want = loss_of("mem")(ref, ids)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(om.train_step(loss_of("ooc"), [ids], 1e-3), want.detach())
    om.close()
    assert all(a > 0 for a in aux["mem"])
    assert [a.item() for a in aux["mem"]] == [a.item() for a in aux["ooc"][-len(aux["mem"]):]]


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_the_chunked_head_loss_skips_nothing(family, family_dir, data_file, tmp_path):
    """The recipe's loss is the model's own loss: soft-capped logits (Gemma2) and the router
    auxiliary loss (Mixtral) are not dropped by the chunked loss head."""
    from outcore.recipes.full_finetune import FullFinetune
    from outcore.training.lifecycle import Run

    path = family_dir(family)
    base = dict(model=str(path), data=str(data_file), seq_len=32, batch_size=2, max_steps=1,
                output=str(tmp_path / "run"), ui="none", offload="none", eval_every=0)
    recipe = FullFinetune(Run(load_config(overrides=base)))
    recipe.setup()
    batch = recipe.loader.next_batch()
    with torch.no_grad():
        assert torch.equal(recipe.loss(recipe.model, batch), recipe.model(**batch).loss)


def test_a_bf16_checkpoint_streams_as_stored(tmp_path, monkeypatch, tiny_tokenizer):
    """bf16 shards with dtype=bfloat16: the meta model is bf16 and each fill reads one stored
    tensor, in bf16, with no fp32 copy of it or of the model (Mixtral: converted experts too)."""
    import safetensors
    from transformers import AutoModelForCausalLM

    from outcore.models import load_model_lazily

    torch.manual_seed(0)
    stored = AutoModelForCausalLM.from_config(family_config("mixtral")).to(torch.bfloat16)
    stored.save_pretrained(tmp_path / "m")
    reads: list[torch.dtype] = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kw):
            self.f = real_open(*args, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            tensor = self.f.get_tensor(key)
            reads.append(tensor.dtype)
            return tensor

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    model, _, fill = load_model_lazily(str(tmp_path / "m"), dtype="bfloat16", tokenizer=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not reads
    for name, want in stored.named_parameters():
        out = torch.empty_like(want)
        fill(name, out)
        assert torch.equal(out, want), name
    layers = family_config("mixtral").num_hidden_layers
    # one read per parameter, but a layer's two fused expert tensors come from w1, w2, w3 of 4 experts
    assert len(reads) == len(list(stored.parameters())) - 2 * layers + 4 * 3 * layers
    assert set(reads) == {torch.bfloat16}


def test_an_moe_block_is_planned_with_all_its_experts():
    """The planner sizes a Mixtral-8x7B-shaped block with its 8 experts and router (from the
    config, on the meta device): ~6.7x a Mistral-7B block, which differs only in its MLP."""
    from transformers import MistralConfig, MixtralConfig

    from outcore.planner.sizes import model_spec_from_config

    shape = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                 num_attention_heads=32, num_key_value_heads=8)
    moe = model_spec_from_config(MixtralConfig(**shape, num_local_experts=8, num_experts_per_tok=2))
    dense = model_spec_from_config(MistralConfig(**shape))
    h, f = 4096, 14336
    attention = h * h * 2 + 2 * h * 1024 + 2 * h  # q, o; k, v (8 kv heads x 128); two norms
    (moe_block,), (dense_block,) = ([u for u in s.units if u.kind == "block"][:1] for s in (moe, dense))
    assert dense_block.numel == attention + 3 * h * f
    assert moe_block.numel == attention + 8 * 3 * h * f + 8 * h  # experts + router
    assert 6.5 < moe_block.numel / dense_block.numel < 6.8
    # ... and its compute with the 2 experts of 8 a token goes through (fused 3-D expert weights)
    from outcore.planner.sizes import unit_bytes

    matmul = [next(u.matmul_params for u in unit_bytes(s, method="full", optim="adamw", dtype="float32")
                  if u.kind == "block") for s in (moe, dense)]
    assert matmul == [attention - 2 * h + 2 * 3 * h * f + 8 * h, attention - 2 * h + 3 * h * f]
