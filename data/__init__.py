"""Data: text, JSONL instruction and chat data → fixed-length token rows, split and batched.

Public API::

    train, val = build_datasets("default", tokenizer, seq_len=256, seed=0, val_fraction=0.02)
    loader = BatchLoader(train, batch_size=2, seed=0)
    batch = loader.next_batch()          # {"input_ids", "labels", "attention_mask"}: [B, seq_len]
    build_datasets(..., padding_free=True)  # text rows with "position_ids" restarting at each document
    state = loader.state_dict(); loader.load_state_dict(state)
    for batch in eval_batches(val, batch_size=2, max_batches=8): ...
"""
from ..models._structure import check_seq_len
from ._chat import IGNORE_INDEX, assistant_spans, encode_rows, has_chat_template
from ._dataset import SequenceDataset, build_datasets, split_rows
from ._preference import PreferenceDataset, build_preference_datasets, encode_pair
from ._prompts import Prompt, PromptDataset, build_prompt_datasets, encode_prompt
from ._unpaired import UnpairedDataset, build_unpaired_datasets, encode_unpaired
from ._loader import BatchLoader, eval_batches
from ._sources import DataSource, default_data_path, iter_jsonl, read_text_files, resolve_data_spec
from ._text import document_positions, load_text_tokens, pack_sequences, tokenize_documents, tokenizer_fingerprint

__all__ = [
    "IGNORE_INDEX", "BatchLoader", "DataSource", "PreferenceDataset", "build_preference_datasets", "encode_pair",
    "Prompt", "PromptDataset", "build_prompt_datasets", "encode_prompt",
    "SequenceDataset", "UnpairedDataset", "assistant_spans", "build_unpaired_datasets", "encode_unpaired",
    "build_datasets", "check_seq_len", "default_data_path", "document_positions", "encode_rows", "eval_batches",
    "has_chat_template", "iter_jsonl", "load_text_tokens", "pack_sequences", "read_text_files",
    "resolve_data_spec", "split_rows", "tokenize_documents", "tokenizer_fingerprint",
]
