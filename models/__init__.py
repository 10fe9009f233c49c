"""Models: load causal LMs (HF directory, GGUF file, hub id, or the embedded default)
and find their parts (embedding, decoder blocks, final norm, LM head).

Public API::

    model, tokenizer = load_model("default", dtype=torch.float32, cache_dir=None)
    tokenizer = load_tokenizer("default")
    layers = decoder_layers(model)            # nn.ModuleList of blocks (any_layout=True: GPT-2 & co. too)
    parts = model_parts(model)                # ModelParts(embed, layers, final_norm, lm_head, rotary, tied)
    max_positions(model); check_seq_len(model, seq_len)
    check_streamable(model, ram_available=None)  # ModelError naming the part that cannot stream
    check_packed_documents(model)             # ModelError: a packed row's documents would see each other
    model = add_lora(model, r=8, alpha=16, dropout=0.0, targets=["q_proj"], seed=0)  # peft
"""
from ._gguf_cache import build_gguf_cache, default_cache_dir, gguf_cache_path
from ._lazy import load_model_lazily, meta_model, read_model_config
from ._lora import add_lora, is_adapter, merge_lora, plain_name, unwrap_peft
from ._loader import (ModelSource, default_model_path, hub_offline, load_model, load_tokenizer,
                      resolve_model_spec)
from ._packing import PACKED_DOCUMENT_ATTENTION, PACKED_DOCUMENT_MODEL_TYPES, check_packed_documents
from ._structure import (SUPPORTED_MODEL_TYPES, ModelParts, check_seq_len, check_streamable, count_parameters,
                         decoder_layers, max_positions, model_parts, parameter_bytes)

__all__ = [
    "PACKED_DOCUMENT_ATTENTION", "PACKED_DOCUMENT_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "ModelParts",
    "ModelSource", "add_lora", "build_gguf_cache", "check_packed_documents", "check_seq_len",
    "check_streamable",
    "count_parameters", "decoder_layers", "default_cache_dir", "default_model_path",
    "gguf_cache_path", "hub_offline", "is_adapter", "load_model", "load_model_lazily", "load_tokenizer",
    "max_positions", "merge_lora", "meta_model", "model_parts", "parameter_bytes", "plain_name", "read_model_config",
    "resolve_model_spec",
    "unwrap_peft",
]
