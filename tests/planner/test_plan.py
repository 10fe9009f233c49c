"""MemoryPlan: byte counts checked by hand against the model, each offload mode, errors."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from outcore.bytesize import format_bytes, parse_bytes
from outcore.errors import BudgetError, ConfigError
from outcore.offload.store import Tier
from outcore.optim import OutcoreOptimizer
from outcore.planner import Budgets, budgets_from_probe, make_plan, plan_for_config
from outcore.planner.sizes import model_spec

GiB = 1 << 30
BIG = Budgets(device_bytes=64 * GiB, host_bytes=64 * GiB, nvme_bytes=1 << 40, ram_bytes=64 * GiB,
              disk_read_gbps=2.0, disk_write_gbps=3.0, h2d_gbps=8.0, d2h_gbps=8.0, host_mem_gbps=8.0,
              flops=1e11, measured=True)


def _numels(model):
    """(embed, [per block], head) element counts, straight from the modules (tied counted once)."""
    inner = model.model
    embed = inner.embed_tokens.weight.numel()
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in inner.layers]
    head = sum(p.numel() for p in inner.norm.parameters())
    if model.lm_head.weight is not inner.embed_tokens.weight:
        head += model.lm_head.weight.numel()
    return embed, blocks, head


def _total(model):
    e, b, h = _numels(model)
    return e + sum(b) + h


#: every AdamW-family optimizer keeps one fp32 step count per parameter tensor (its state_spec)
STEP = 4


def _tensors(model):
    """Parameter tensors of the model (tied counted once): each has its own step count."""
    return len(list(model.parameters()))


@pytest.fixture
def tiny(tiny_llama_factory):
    return tiny_llama_factory(layers=4, hidden=64, vocab=256, heads=4, kv_heads=2, intermediate=128)


# ---------------------------------------------------------------------------------
# parse_bytes
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * GiB), ("512MB", 512 * 10**6), ("1.5G", 1_500_000_000), ("4096", 4096),
    ("64 kib", 64 * 1024), ("1e3", 1000), (1024, 1024), ("0", 0), ("3TiB", 3 << 40),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["2GiBs", "abc", "-1G", "", "1.5.2G", "G", True])
def test_parse_bytes_rejects_bad_values_naming_them(bad):
    with pytest.raises(ConfigError, match="--host-mem") as e:
        parse_bytes(bad, "--host-mem")
    assert repr(bad) in str(e.value)


def test_format_bytes():
    assert format_bytes(1536 << 20) == "1.50 GiB"
    assert format_bytes(10) == "10 B"


# ---------------------------------------------------------------------------------
# Byte counts (expected values computed here from the model's own parameters)
# ---------------------------------------------------------------------------------
def test_full_adamw_fp32_bytes_match_the_model(tiny):
    plan = make_plan(tiny, offload="none", budgets=BIG, seq_len=32, batch_size=2)
    e, blocks, h = _numels(tiny)
    n, t = _total(tiny), _tensors(tiny)
    assert plan.params == plan.trainable == n
    dev = plan.tier_bytes["DEVICE"]
    assert (dev["weights"], dev["grads"], dev["optimizer state"]) == (4 * n, 4 * n, 8 * n + STEP * t)
    assert [u.weights_bytes for u in plan.units] == [4 * e] + [4 * b for b in blocks] + [4 * h]
    assert [u.name for u in plan.units] == ["embed"] + [f"block.{i}" for i in range(4)] + ["head"]
    assert plan.tier_total("HOST") == plan.tier_total("NVME") == 0
    assert plan.layout == "none" and plan.prefetch_depth == 0


def test_mixed_precision_keeps_fp32_master_with_the_state(tiny):
    plan = make_plan(tiny, offload="none", dtype="bfloat16", budgets=BIG, seq_len=32)
    n, t = _total(tiny), _tensors(tiny)
    dev = plan.tier_bytes["DEVICE"]
    assert (dev["weights"], dev["grads"], dev["optimizer state"]) == (2 * n, 2 * n, 8 * n + STEP * t + 4 * n)


def test_adamw8bit_state_is_two_bytes_plus_block_scales(tiny):
    from outcore.kernels.quantize import SMALL_TENSOR_NUMEL

    plan = make_plan(tiny, offload="none", optim="adamw8bit", budgets=BIG, seq_len=32)
    # tensors under SMALL_TENSOR_NUMEL elements (the norms) keep fp32 moments
    expected = sum((2 * n + 8 * math.ceil(n / 256) if n >= SMALL_TENSOR_NUMEL else 8 * n) + STEP
                   for n in (p.numel() for p in tiny.parameters()))
    assert plan.tier_bytes["DEVICE"]["optimizer state"] == expected


def test_zeroth_order_has_no_grads_and_no_state(tiny):
    plan = make_plan(tiny, method="zo", optim="mezo", offload="none", budgets=BIG, seq_len=32)
    dev = plan.tier_bytes["DEVICE"]
    assert dev["weights"] == 4 * _total(tiny)
    assert "grads" not in dev and "optimizer state" not in dev


def test_lora_trains_only_adapters(tiny):
    r = 4
    plan = make_plan(tiny, method="lora", offload="none", budgets=BIG, seq_len=32, lora_r=r)
    adapters = sum(r * (getattr(layer.self_attn, t).in_features + getattr(layer.self_attn, t).out_features)
                   for layer in tiny.model.layers for t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert plan.trainable == adapters
    dev = plan.tier_bytes["DEVICE"]
    assert dev["weights"] == 4 * _total(tiny)  # the frozen base
    matrices = 2 * 4 * len(tiny.model.layers)  # A and B per targeted linear, each with its step count
    assert dev["adapters"] == 4 * adapters * 2 + 8 * adapters + STEP * matrices  # weights + grads + AdamW state
    assert all(u.grads_bytes == 0 and u.state_bytes == 0 for u in plan.units)


def test_qlora_stores_block_matrices_as_nf4(tiny):
    plan = make_plan(tiny, method="qlora", offload="none", budgets=BIG, seq_len=32)
    expected = 0
    for name, p in tiny.named_parameters():
        in_block = ".layers." in name and p.dim() == 2
        expected += p.numel() // 2 + 4 * math.ceil(p.numel() / 64) if in_block else 4 * p.numel()
    assert plan.tier_bytes["DEVICE"]["weights"] == expected


def test_qlora_streamed_counts_the_dequantized_block(tiny):
    """Out of core the block computing is dequantized beside its NF4 bytes: the plan's DEVICE
    holds one block in the compute dtype (a 70B block: 1.7 GB in bf16, more than its NF4 window)."""
    plan = make_plan(tiny, method="qlora", offload="nvme", budgets=BIG, seq_len=32)
    block = sum(p.numel() for n, p in tiny.named_parameters() if ".layers.0." in n)
    assert plan.tier_bytes["DEVICE"]["dequantized unit"] == 4 * block
    assert "dequantized unit" not in make_plan(tiny, method="lora", offload="nvme", budgets=BIG,
                                               seq_len=32).tier_bytes["DEVICE"]


def test_a_frozen_head_holds_no_weight_gradient(tiny):
    """The chunked loss allocates the head's fp32 weight gradient only where the head trains
    (kernels/linear_cross_entropy.py): under LoRA that is 4 GiB less at a 128K x 8192 head."""
    from outcore.planner.sizes import block_activation_bytes, chunked_head_bytes

    spec = model_spec(tiny)
    assert spec.chunked_loss
    (kept, loss_full), (kept_lora, loss_lora) = (chunked_head_bytes(spec, "float32", 4, trains)
                                                 for trains in (True, False))
    assert kept == kept_lora and loss_full - loss_lora == 4 * spec.vocab * spec.hidden
    # the loss runs in the forward, a phase apart from the blocks' backward (the last hidden
    # state's gradient and a block's recompute): the plan holds the larger (4 tokens: the full
    # head's loss holds more than the blocks, the frozen head's less)
    blocks = 4 * spec.hidden * 4 + block_activation_bytes(spec, "float32", 4)
    full, lora = (make_plan(tiny, method=m, offload="nvme", budgets=BIG, seq_len=4, activations="recompute")
                  .tier_bytes["DEVICE"]["activations"] for m in ("full", "lora"))
    assert kept + loss_lora < blocks < kept + loss_full
    assert full - lora == kept + loss_full - blocks


def test_activation_estimate_matches_what_autograd_saves(tiny):
    from outcore.planner.sizes import block_activation_bytes, head_activation_bytes

    b, s = 2, 48
    ids = torch.randint(0, 256, (b, s))
    params = {p.untyped_storage().data_ptr() for p in tiny.parameters()}
    seen = {}

    def pack(t):
        if t.is_floating_point():
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    tiny.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiny(input_ids=ids, labels=ids)
    saved = sum(v for k, v in seen.items() if k not in params)
    spec = model_spec(tiny)
    # The head estimate also holds the logits output and the logits' gradient (not "saved").
    head_saved = head_activation_bytes(spec, "float32", s) - s * 4 * 256 * 2
    expected = b * (4 * block_activation_bytes(spec, "float32", s) + head_saved)
    assert abs(saved - expected) / saved < 0.03, (saved, expected)


def test_smollm2_1_7b_sized_on_meta_without_weights():
    from transformers import LlamaConfig

    h, inter, L, V = 2048, 8192, 24, 49152
    cfg = LlamaConfig(vocab_size=V, hidden_size=h, intermediate_size=inter, num_hidden_layers=L,
                      num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True)
    expected = V * h + L * (4 * h * h + 3 * h * inter + 2 * h) + h
    plan = make_plan(cfg, offload="nvme", budgets=BIG, seq_len=256, batch_size=1)
    assert plan.params == expected == 1_711_376_384
    nvme = dict(plan.tier_bytes["NVME"])
    # The store's padding bound: per flat buffer 4 KiB (extent alignment) + 64 B per parameter;
    # weights + step counts + 2 AdamW moments = 4 buffers per unit; a block owns 9 parameters,
    # embed and head 1.
    assert nvme.pop("alignment") == 4 * ((L + 2) * 4096 + 64 * (9 * L + 2))
    assert nvme == {"weights": 4 * expected, "optimizer state": 8 * expected}
    assert plan.tier_bytes["HOST"]["optimizer scales"] == STEP * (9 * L + 2)  # step counts stay in RAM
    assert plan.units[-1].weights_bytes == 4 * h  # tied head: only the final norm is its own


# ---------------------------------------------------------------------------------
# Offload modes and placement policy
# ---------------------------------------------------------------------------------
def test_cpu_mode_puts_authoritative_copies_on_host(tiny):
    plan = make_plan(tiny, offload="cpu", budgets=BIG, seq_len=32)
    n, t = _total(tiny), _tensors(tiny)
    assert plan.layout == "cpu" and plan.prefetch_depth >= 1
    host = dict(plan.tier_bytes["HOST"])
    assert host.pop("alignment") > 0
    assert host == {"weights": 4 * n, "optimizer state": 8 * n + STEP * t}
    assert plan.tier_total("NVME") == 0
    assert "prefetch window" in plan.tier_bytes["DEVICE"] and "weights" not in plan.tier_bytes["DEVICE"]
    assert all(u.weights == Tier.HOST and u.state == Tier.HOST and u.grads is None for u in plan.units)


def test_nvme_mode_streams_everything_and_counts_the_traffic(tiny):
    plan = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32)
    e, blocks, h = _numels(tiny)
    n, t = _total(tiny), _tensors(tiny)
    nvme = dict(plan.tier_bytes["NVME"])
    assert 0 < nvme.pop("alignment") < 4 * 6 * (4096 + 64 * 9)  # weights, step counts, 2 moments
    assert nvme == {"weights": 4 * n, "optimizer state": 8 * n}
    assert plan.tier_bytes["HOST"]["optimizer scales"] == STEP * t  # step counts: RAM, not NVMe
    assert plan.tier_bytes["HOST"]["NVMe staging"] > 0
    assert plan.arena_bytes("HOST") == plan.tier_total("HOST")
    assert plan.arena_bytes("DEVICE") == plan.tier_total("DEVICE") - plan.tier_bytes["DEVICE"]["activations"]
    # Reads: weights for forward and backward but where the engine keeps them: the forward's
    # last k + 1 units for the backward, the backward's last k + 1 for the next forward, the
    # tied embedding (the head borrows it) throughout; plus state.
    own = [4 * e] + [4 * b for b in blocks] + [4 * h]
    k, last = plan.prefetch_depth, len(own) - 1
    weight_reads = sum(f * ((i > k) + (i < last - k)) for i, f in enumerate(own) if i > 0)
    io = plan.time.io_bytes
    assert io["nvme_read"] == weight_reads + 8 * n
    assert io["nvme_write"] == 4 * n + 8 * n  # updated weights and state, once (step counts: RAM)
    assert io["h2d"] == io["d2h"] == 0  # CPU-only: the disk reads into the DEVICE arena, grads are in RAM
    cuda = make_plan(tiny, offload="nvme", budgets=dataclasses.replace(BIG, device_kind="cuda"), seq_len=32)
    assert cuda.prefetch_depth == k
    # the update runs on the GPU: its state crosses to it and back (step counts too), the
    # updated weights go home; weights reach it disk -> pinned HOST -> GPU
    state = 8 * n + STEP * t
    assert cuda.time.io_bytes["h2d"] == weight_reads + state
    assert cuda.time.io_bytes["d2h"] == 4 * n + state
    assert cuda.tier_bytes["DEVICE"]["state window"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_on_host_keeps_the_state_off_the_link(tiny, dtype):
    """On a GPU with ``update_on=host`` the state never crosses the link and needs no DEVICE
    window; each trained weight's gradient comes down once and its update goes up (fp32: the
    weights come down first, having no master). A bad value is one line."""
    gpu = dataclasses.replace(BIG, device_kind="cuda")
    device, host = (make_plan(tiny, offload="nvme", budgets=gpu, seq_len=32, dtype=dtype, update_on=where)
                    for where in ("device", "host"))
    c = 2 if dtype == "bfloat16" else 4  # bytes of a weight and of its gradient
    n = _total(tiny)
    state = sum(u.state_bytes for u in host.units)  # (bytes the device path moves each way)
    up, down = (host.time.io_bytes[k] - device.time.io_bytes[k] for k in ("h2d", "d2h"))
    assert state > c * n
    assert up == c * n - state  # the new weights go up instead of the state
    assert down == c * n + (c * n if dtype == "float32" else 0) - state  # the gradients (and fp32 weights)
    assert "state window" in device.tier_bytes["DEVICE"] and "state window" not in host.tier_bytes["DEVICE"]
    assert host.time.io_bytes["nvme_read"] == device.time.io_bytes["nvme_read"]
    assert any("update_on=host" in note for note in host.notes)
    with pytest.raises(ConfigError, match="update_on='gpu'"):
        make_plan(tiny, offload="nvme", budgets=gpu, seq_len=32, update_on="gpu")


def test_update_on_host_runs_beside_the_backward(tiny):
    """Updated on the host in the backward, a unit's CPU update overlaps the GPU's backward of the
    next: the step is at least the longer of the two and less than their sum. With gradients kept
    for clipping the updates run after the backward: the sum."""
    fast = dataclasses.replace(BIG, device_kind="cuda", disk_read_gbps=1e6, disk_write_gbps=1e6, h2d_gbps=1e6,
                               d2h_gbps=1e6, checksum_gbps=1e6, host_mem_gbps=0.5)
    beside, after = (make_plan(tiny, offload="nvme", budgets=fast, seq_len=32, update_on="host", max_grad_norm=clip)
                     for clip in (0.0, 1.0))
    t = beside.time
    assert t.compute_s > 0 and t.update_s > 0
    assert max(t.compute_s, t.update_s) <= t.step_s < t.compute_s + t.update_s
    assert after.time.step_s == pytest.approx(after.time.compute_s + after.time.update_s, rel=1e-3)


def test_clipping_keeps_gradients_in_ram_while_it_holds_them(tiny):
    plan = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32, max_grad_norm=1.0)
    n = _total(tiny)
    assert plan.grads_kept and plan.layout == "nvme"
    assert plan.tier_bytes["HOST"]["grads"] == 4 * n and "grads" not in plan.tier_bytes["NVME"]
    assert all(u.grads is Tier.HOST and u.state is Tier.NVME for u in plan.units)
    # a gradient lives one step: in RAM it is never written to the SSD (step counts stay in RAM)
    assert plan.time.io_bytes["nvme_write"] == 4 * n + 8 * n
    # a HOST budget that cannot hold them too: the gradients go to NVMe, written and read each step
    tight = dataclasses.replace(BIG, host_bytes=plan.tier_total("HOST") - 4 * n)
    plan = make_plan(tiny, offload="nvme", budgets=tight, seq_len=32, max_grad_norm=1.0)
    assert plan.layout == "nvme" and plan.tier_bytes["NVME"]["grads"] == 4 * n
    assert plan.time.io_bytes["nvme_write"] == 4 * n + 4 * n + 8 * n


def test_lora_never_writes_frozen_weights(tiny):
    plan = make_plan(tiny, method="lora", offload="nvme", budgets=BIG, seq_len=32)
    assert plan.time.io_bytes["nvme_write"] == 0
    assert plan.time.io_bytes["nvme_read"] > 0


def test_auto_keeps_everything_in_memory_when_it_fits(tiny):
    assert make_plan(tiny, offload="auto", budgets=BIG, seq_len=32).layout == "none"


def test_auto_spills_optimizer_state_before_weights(tiny):
    n = _total(tiny)
    need_none = make_plan(tiny, offload="none", budgets=BIG, seq_len=32).tier_total("DEVICE")
    # RAM for roughly the weights plus windows, not for the state: state must go to NVMe first.
    tight = dataclasses.replace(BIG, ram_bytes=need_none - 4 * n, host_bytes=need_none - 4 * n)
    plan = make_plan(tiny, offload="auto", budgets=tight, seq_len=32)
    assert plan.layout == "mixed"
    assert plan.tier_bytes["NVME"].get("optimizer state", 0) > 0
    for u in plan.units:  # weights only reach NVMe once all streamed state is there
        if u.weights == Tier.NVME:
            assert all(v.state in (Tier.NVME, Tier.DEVICE) for v in plan.units)
    assert plan.tier_total("DEVICE") + plan.tier_total("HOST") <= tight.ram_bytes


def test_auto_goes_to_nvme_when_ram_is_tiny(tiny):
    def auto(ram: int):
        return make_plan(tiny, offload="auto", seq_len=32,
                         budgets=dataclasses.replace(BIG, ram_bytes=ram, host_bytes=ram, device_bytes=ram))

    # The least RAM any plan fits in (to the byte: pinning the 1 KiB head on DEVICE would fit in
    # any coarser slack): then everything that can stream is on NVMe.
    lo, hi = 0, make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32).tier_total("DEVICE") * 4
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            auto(mid)
            hi = mid
        except BudgetError:
            lo = mid
    plan = auto(hi)
    assert plan.tier_bytes["NVME"]["weights"] > 0 and plan.tier_bytes["NVME"]["optimizer state"] > 0
    assert all(u.weights is Tier.NVME for u in plan.units)
    assert plan.tier_total("DEVICE") + plan.tier_total("HOST") <= hi
    with pytest.raises(BudgetError, match="RAM"):
        auto(lo)


def test_largest_micro_batch_is_tight(tiny):
    plan = make_plan(tiny, offload="none", budgets=BIG, seq_len=32)
    limit = dataclasses.replace(BIG, device_bytes=plan.tier_total("DEVICE") * 3)
    b = make_plan(tiny, offload="none", budgets=limit, seq_len=32).max_micro_batch
    assert b > 1
    make_plan(tiny, offload="none", budgets=limit, seq_len=32, batch_size=b)
    with pytest.raises(BudgetError, match=f"--batch-size {b}"):
        make_plan(tiny, offload="none", budgets=limit, seq_len=32, batch_size=b + 1)


def test_auto_activation_policy_falls_back_to_recompute(tiny):
    keep = make_plan(tiny, offload="none", budgets=BIG, seq_len=64, batch_size=4)
    acts = keep.tier_bytes["DEVICE"]["activations"]
    limit = dataclasses.replace(BIG, device_bytes=keep.tier_total("DEVICE") - acts // 2)
    plan = make_plan(tiny, offload="none", activations="auto", budgets=limit, seq_len=64, batch_size=4)
    assert plan.activations == "recompute"
    assert plan.time.compute_s > keep.time.compute_s  # recomputation costs a forward of the blocks


# ---------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------
def test_offload_none_that_does_not_fit_names_tier_budget_and_need(tiny):
    small = dataclasses.replace(BIG, device_bytes=1 << 20)
    with pytest.raises(BudgetError) as e:
        make_plan(tiny, offload="none", budgets=small, seq_len=32)
    msg = str(e.value)
    assert "DEVICE budget of 1.00 MiB" in msg and "--offload auto" in msg
    assert "optimizer state" in msg and "weights" in msg


def test_host_too_small_for_cpu_mode_suggests_nvme(tiny):
    small = dataclasses.replace(BIG, host_bytes=1 << 20)
    with pytest.raises(BudgetError, match=r"HOST budget of 1\.00 MiB.*--offload nvme"):
        make_plan(tiny, offload="cpu", budgets=small, seq_len=32)


def test_swap_dir_too_small(tiny):
    small = dataclasses.replace(BIG, nvme_bytes=1000)
    with pytest.raises(BudgetError, match=r"NVME budget of 1000 B.*--swap-dir"):
        make_plan(tiny, offload="nvme", budgets=small, seq_len=32)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(offload="disk"), "offload='disk'"), (dict(activations="lazy"), "activations='lazy'"),
    (dict(optim="sgd"), "optim='sgd'"), (dict(batch_size=0), "batch_size=0"),
    (dict(method="zo"), "method='zo'"), (dict(dtype="int8"), "dtype='int8'"),
])
def test_bad_arguments_are_config_errors(tiny, kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        make_plan(tiny, budgets=BIG, **kwargs)


# ---------------------------------------------------------------------------------
# Time model, config entry point, rendering
# ---------------------------------------------------------------------------------
def test_compute_estimate_counts_matmul_flops(tiny):
    s, b = 32, 2
    plan = make_plan(tiny, offload="none", budgets=BIG, seq_len=s, batch_size=b)
    matmul = sum(p.numel() for n, p in tiny.named_parameters() if p.dim() == 2 and ".layers." in n)
    matmul += tiny.lm_head.weight.numel()
    per_token = 2 * matmul + 4 * 2 * s * 64  # 4 blocks of causal attention, hidden 64
    assert plan.time.compute_s == pytest.approx(3 * b * s * per_token / BIG.flops)


def test_slow_disk_exposes_io(tiny):
    fast = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32)
    slow = make_plan(tiny, offload="nvme", seq_len=32,
                     budgets=dataclasses.replace(BIG, disk_read_gbps=0.001, disk_write_gbps=0.001))
    assert slow.time.step_s >= slow.time.disk_s > fast.time.disk_s
    assert slow.time.exposed_io_s > fast.time.exposed_io_s
    assert slow.prefetch_depth >= fast.prefetch_depth


def test_plan_for_config_uses_config_and_probe_budgets(tiny):
    from outcore.offload.store import HardwareProbe
    from outcore.training.config import FinetuneConfig

    probe = HardwareProbe(cpu_threads=2, ram_total_bytes=32 * GiB, ram_available_bytes=30 * GiB, devices=[],
                          swap_dir="/tmp", swap_free_bytes=100 * GiB, swap_fs_type="ext4", o_direct=True,
                          disk_read_gbps=2.2, disk_write_gbps=3.3, h2d_gbps=7.0, d2h_gbps=7.0)
    cfg = FinetuneConfig(offload="cpu", seq_len=32, batch_size=2, host_mem="1GiB", max_grad_norm=0.0)
    plan = plan_for_config(cfg, tiny, probe, budgets=None)
    assert plan.budgets.host_bytes == GiB and plan.budgets.disk_read_gbps == 2.2
    assert plan.budgets.device_kind == "cpu" and plan.budgets.measured
    assert (plan.offload, plan.layout, plan.batch_size, plan.seq_len) == ("cpu", "cpu", 2, 32)
    d = plan.to_dict()
    json.dumps(d)
    assert d["tiers"]["HOST"]["budget"] == GiB and d["units"][0]["weights"] == "HOST"


def test_budgets_from_probe_rejects_a_bad_budget_string():
    from types import SimpleNamespace

    probe = SimpleNamespace(devices=[], ram_available_bytes=8 * GiB, swap_free_bytes=GiB)
    with pytest.raises(ConfigError, match="device_mem='lots'"):
        budgets_from_probe(probe, device_mem="lots")


def test_table_shows_tiers_units_and_step(tiny):
    plan = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32)
    text = plan.table()
    for needle in ("DEVICE", "HOST", "NVME", "embed", "block.0-3 x4", "head", "NVMe -> HOST",
                   "step (estimate)", "prefetch depth"):
        assert needle in text, needle


def test_cuda_probe_budgets_do_not_share_ram(tiny):
    from types import SimpleNamespace

    probe = SimpleNamespace(devices=[{"name": "gpu", "total_bytes": 80 * GiB, "free_bytes": 40 * GiB}],
                            ram_available_bytes=16 * GiB, swap_free_bytes=100 * GiB, disk_read_gbps=None,
                            disk_write_gbps=None, h2d_gbps=None, d2h_gbps=None, swap_dir="/tmp")
    b = budgets_from_probe(probe, host_mem="4GiB", flops=1e14)
    assert b.device_kind == "cuda" and not b.shared_ram and not b.measured
    assert b.device_bytes == int(40 * GiB * 0.85) and b.host_bytes == 4 * GiB
    plan = make_plan(tiny, offload="cpu", budgets=b, seq_len=32)
    # the update runs on the GPU: the state streams through a DEVICE window, no gradient to HOST
    assert "state window" in plan.tier_bytes["DEVICE"] and "grad window" not in plan.tier_bytes["HOST"]
    assert any("fallbacks" in n for n in plan.notes)


def test_all_nvme_layout_is_named_nvme_when_grads_are_transient(tiny):
    nv = make_plan(tiny, offload="nvme", budgets=BIG, seq_len=32)
    assert nv.layout == "nvme"
    assert all(u.grads is None for u in nv.units)


@pytest.mark.gpu
def test_matmul_flops_measured_on_cuda():
    from outcore.planner.budget import measure_matmul_flops

    assert measure_matmul_flops("cuda") > measure_matmul_flops("cpu")


def test_peft_wrapped_model_plans_like_the_base(tiny_llama_factory):
    peft = pytest.importorskip("peft")
    base = make_plan(tiny_llama_factory(), method="lora", offload="none", budgets=BIG, seq_len=32, lora_r=4)
    wrapped = peft.get_peft_model(tiny_llama_factory(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    plan = make_plan(wrapped, method="lora", offload="none", budgets=BIG, seq_len=32, lora_r=4)
    assert plan.trainable == base.trainable == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert plan.params == base.params


# ---------------------------------------------------------------------------------
# Optimizer state comes from the optimizer's own state_spec
# ---------------------------------------------------------------------------------
class HalfMomentum(OutcoreOptimizer):
    """A toy optimizer defined only here (after the planner was written): one bfloat16
    momentum per element of a matrix, one per row of anything else, an int64 counter per tensor."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    def state_spec(self, p, group):
        rows = p.shape if p.dim() == 2 else p.shape[:1]
        return {"count": (torch.Size([]), torch.int64), "m": (torch.Size(rows), torch.bfloat16)}

    def update(self, params, grads, states, group):  # pragma: no cover - the planner never steps
        raise AssertionError("the planner must not step the optimizer")


@pytest.fixture
def half_momentum(monkeypatch):
    """Register the toy as ``--optim half-momentum``: how an optimizer is added to outcore."""
    from outcore import optim

    monkeypatch.setitem(optim.OPTIMIZERS, "half-momentum", f"{__name__}:HalfMomentum")


def test_a_new_optimizer_is_planned_from_its_state_spec(tiny, half_momentum):
    params = list(tiny.parameters())
    # by hand: 2 bytes per element of a matrix, per row of a vector; 8 bytes per tensor
    expected = sum(2 * (p.numel() if p.dim() == 2 else p.shape[0]) + 8 for p in params)
    plan = make_plan(tiny, optim="half-momentum", offload="none", budgets=BIG, seq_len=32)
    assert plan.tier_bytes["DEVICE"]["optimizer state"] == expected
    streamed = make_plan(tiny, optim="half-momentum", offload="nvme", budgets=BIG, seq_len=32)
    nvme = dict(streamed.tier_bytes["NVME"])
    assert nvme["optimizer state"] + streamed.tier_bytes["HOST"]["optimizer scales"] == expected
    # padding bound per unit: one flat buffer of weights + one per state kind (count, m)
    units = 2 + len(tiny.model.layers)
    assert nvme["alignment"] == 3 * (units * 4096 + 64 * len(params))
    # mixed precision adds the fp32 master (a third kind) to the same state
    mixed = make_plan(tiny, optim="half-momentum", dtype="bfloat16", offload="none", budgets=BIG, seq_len=32)
    assert mixed.tier_bytes["DEVICE"]["optimizer state"] == expected + 4 * _total(tiny)


def test_planned_state_matches_what_each_optimizer_allocates(tiny):
    """For every registered optimizer, the plan's state bytes are those of the state the
    optimizer really creates (no hard-coded table to drift)."""
    from outcore.optim import OPTIMIZERS, build_optimizer

    for name in OPTIMIZERS:
        opt = build_optimizer(name, tiny.parameters())
        group = opt.param_groups[0]
        real = sum(t.numel() * t.element_size() for p in tiny.parameters()
                   for t in opt.init_state(p, group).values() if isinstance(t, torch.Tensor))
        plan = make_plan(tiny, optim=name, offload="none", budgets=BIG, seq_len=32)
        assert plan.tier_bytes["DEVICE"]["optimizer state"] == real, name
