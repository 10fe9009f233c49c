"""GGUF export: a trained model as one ``.gguf`` file for llama.cpp and Ollama, and a ``Modelfile``.

:func:`export_gguf` converts a Hugging Face directory (a run's ``final/``, an
``outcore export`` directory, or any model outcore trains) the way llama.cpp's
``convert_hf_to_gguf.py`` does, through the ``gguf`` package's own writer, name map,
quantizers and vocabularies:

* names: ``gguf.get_tensor_name_map`` (``model.layers.0.self_attn.q_proj.weight`` ->
  ``blk.0.attn_q.weight``); a tied LM head is left out (llama.cpp reuses ``token_embd``);
* Llama and Mistral (one llama.cpp architecture, ``llama``): the q and k rows permuted
  into llama.cpp's rotary layout (``LlamaModel.permute``); Gemma 3: its norms stored as
  ``1 + w`` (llama.cpp's ``norm_shift``); Qwen2 as it is. transformers' GGUF reader
  inverts exactly these, so the file loads back with ``gguf_file=``;
* types: 1-D tensors (norms, biases) in F32, matrices in F16, BF16 or Q8_0 (a row not a
  multiple of Q8_0's 32-value block falls back to F16, as the converter does);
* the tokenizer: ``gguf.BpeVocab`` / ``gguf.LlamaHfVocab`` for the tokens, the
  tokenizer's added special tokens typed CONTROL so llama.cpp parses them in prompts,
  ``gguf.SpecialVocab`` for merges, special ids and the chat template.

Bounded memory: the tensors are planned from the safetensors headers, then read,
converted and written one at a time, so an out-of-core model is never whole in RAM.
The file is written as ``OUT.tmp`` and renamed once complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, ModelError

#: The GGUF tensor types ``--gguf-type`` offers (llama.cpp's ``--outtype`` names).
GGUF_TYPES = ("f16", "bf16", "q8_0")
#: transformers ``model_type`` -> llama.cpp architecture (``gguf.MODEL_ARCH`` member); Mistral is
#: llama.cpp's ``llama`` (transformers reads it back as Llama: the same weights and forward).
ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "gemma3_text": "GEMMA3"}


@dataclass
class _Tensor:
    """One tensor to write: where it comes from and what it becomes."""

    hf_name: str
    gguf_name: str
    file: Path
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType


def export_gguf(model_dir: str | Path, out_file: str | Path, gguf_type: str = "f16",
                tokenizer_pre: str | None = None, name: str | None = None) -> Path:
    """Write the Hugging Face model in ``model_dir`` as one GGUF file, tensor by tensor, and an
    Ollama ``Modelfile`` beside it (:func:`write_modelfile`).

    Args:
        model_dir: a directory with ``config.json``, ``model.safetensors`` (or its index and
            shards) and the tokenizer (``tokenizer.json``).
        out_file: the ``.gguf`` file to write (replaced once complete).
        gguf_type: the matrices' type, one of :data:`GGUF_TYPES`.
        tokenizer_pre: llama.cpp's pre-tokenizer name (``tokenizer.ggml.pre``), e.g. the base
            GGUF's; None writes ``default``.
        name: ``general.name`` (default: the directory's name).

    Returns:
        ``out_file``.

    Raises:
        ConfigError: an unknown ``gguf_type``.
        ModelError: a family llama.cpp / transformers cannot read back from GGUF, rope
            scaling, or a directory without safetensors or ``tokenizer.json``.
    """
    import gguf
    from transformers import AutoConfig

    _check_type(gguf_type)
    directory = Path(model_dir)
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read the model config in '{directory}': {str(err).strip().splitlines()[0]}; "
                         "pass a Hugging Face directory (with config.json)") from err
    arch = _architecture(config)
    tensors = _plan(directory, config, arch, gguf_type)
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    try:
        _add_hparams(writer, config, arch, gguf_type, name=name or directory.resolve().name)
        tokens, special = _add_vocab(writer, directory, config.vocab_size, tokenizer_pre)
        for t in tensors:
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype)  # every type written as raw bytes
            writer.add_tensor_info(t.gguf_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:  # one tensor in memory at a time
            data = _converted(t, config, arch)
            writer.write_tensor_data(gguf.quants.quantize(data, t.qtype).view(np.uint8))
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(tmp, out)
    write_modelfile(out, special.chat_template, _stop_tokens(tokens, special))
    return out


def _check_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")


def _architecture(config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ModelError(f"GGUF export supports the families {', '.join(ARCHITECTURES)}, not "
                         f"{model_type!r}; export it with --format hf")
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = {p.get("rope_type", "default") for p in (rope.values() if model_type == "gemma3_text" else [rope])}
    if kinds - {"default"}:  # transformers' GGUF reader restores no rope scaling
        raise ModelError(f"GGUF export of a model with rope scaling ({', '.join(sorted(kinds))}) would not "
                         "load back the same; export it with --format hf")
    return ARCHITECTURES[model_type]


def _rope_theta(config: Any) -> float:
    """The rotary base; Gemma 3's global-attention one (its local one is a fixed default)."""
    rope = config.rope_parameters
    return float((rope.get("full_attention") or rope)["rope_theta"])


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hparams(writer: Any, config: Any, arch: str, gguf_type: str, name: str) -> None:
    """The model's hyper-parameters under the keys ``convert_hf_to_gguf.py`` writes."""
    import gguf

    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_vocab_size(config.vocab_size)
    head_dim = _head_dim(config)
    if arch == "LLAMA":
        writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "GEMMA3" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(writer: Any, directory: Path, vocab_size: int, pre: str | None) -> tuple[list[str], Any]:
    """Tokens, their types and scores, merges, special ids and the chat template.

    Returns:
        The token list and the ``gguf.SpecialVocab`` written (its special ids and chat template).

    Raises:
        ModelError: no ``tokenizer.json``, or a tokenizer llama.cpp reads neither as GPT-2 BPE
            nor as Llama's byte-fallback BPE.
    """
    import gguf

    vocab = None
    for kind in (gguf.BpeVocab, gguf.LlamaHfVocab):
        try:
            vocab = kind(directory)
            break
        except (FileNotFoundError, TypeError):
            continue
    if vocab is None:
        raise ModelError(f"'{directory}' has no tokenizer.json that GGUF can hold (a GPT-2 style BPE or "
                         "Llama byte-fallback BPE); export it with --format hf")
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():  # BpeVocab yields str, LlamaHfVocab bytes
        tokens.append(text.decode("utf-8") if isinstance(text, bytes) else text)
        scores.append(score)
        types.append(kind)
    for token_id, token in _added_tokens(directory).items():  # what the HF tokenizer parses whole
        if token_id < len(types):
            types[token_id] = gguf.TokenType.CONTROL if token["special"] else gguf.TokenType.USER_DEFINED
    for i in range(len(tokens), vocab_size):  # rows of the embedding with no token: llama.cpp's padding
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    return tokens, special


def _added_tokens(directory: Path) -> dict[int, dict[str, Any]]:
    """``tokenizer.json``'s added tokens by id."""
    definition = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    return {t["id"]: t for t in definition.get("added_tokens", [])}


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ModelError(f"'{directory}' has no model.safetensors(.index.json); pass a run directory or a "
                         "Hugging Face directory saved with safetensors")
    return [single]


def _plan(directory: Path, config: Any, arch: str, gguf_type: str) -> list[_Tensor]:
    """Every tensor to write, in the safetensors files' order, from their headers only."""
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), config.num_hidden_layers)
    matrix = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan = []
    for path in _weight_files(directory):
        with safe_open(str(path), "np") as f:
            for hf_name in f.keys():
                if tied and hf_name == "lm_head.weight":
                    continue  # llama.cpp reads the head from token_embd when output.weight is absent
                gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise ModelError(f"weight {hf_name!r} of '{directory}' has no GGUF name for "
                                     f"{config.model_type}; export it with --format hf")
                shape = tuple(f.get_slice(hf_name).get_shape())
                qtype = matrix if len(shape) > 1 else gguf.GGMLQuantizationType.F32
                if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % block:
                    qtype = gguf.GGMLQuantizationType.F16  # convert_hf_to_gguf.py's fallback
                plan.append(_Tensor(hf_name, gguf_name, path, shape, qtype))
    return plan


def _converted(t: _Tensor, config: Any, arch: str) -> np.ndarray:
    """One tensor read from its file in fp32, in llama.cpp's layout."""
    from safetensors import safe_open

    with safe_open(str(t.file), "pt") as f:  # memory-mapped: only this tensor's pages are read
        data = f.get_tensor(t.hf_name).float().numpy()
    if arch == "LLAMA" and t.gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in t.gguf_name else config.num_key_value_heads
        data = _permute(data, heads)
    if arch == "GEMMA3" and t.hf_name.endswith("norm.weight"):
        data = data + 1.0  # Gemma's RMSNorm scales by (1 + w); llama.cpp stores 1 + w
    return data


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``):
    each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- Ollama Modelfile
#: Ollama (Go template) forms of the chat templates outcore recognises, by a marker of the
#: Jinja template, with the tokens that end a turn.
_OLLAMA_TEMPLATES = (
    ("<|im_start|>", "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
                     "{{ end }}<|im_start|>assistant\n", ("<|im_start|>", "<|im_end|>")),
    ("<|start_header_id|>", "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
                            "{{ .Content }}<|eot_id|>\n{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
     ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    ("<start_of_turn>", "{{- range .Messages }}<start_of_turn>{{ if eq .Role \"assistant\" }}model"
                        "{{ else }}{{ .Role }}{{ end }}\n{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
     ("<start_of_turn>", "<end_of_turn>")),
    ("[INST]", "{{- range .Messages }}{{- if eq .Role \"user\" }}[INST] {{ .Content }}[/INST]"
               "{{- else if eq .Role \"assistant\" }}{{ .Content }}</s>{{- end }}{{- end }}", ("[INST]",)),
)


def _stop_tokens(tokens: list[str], special: Any) -> list[str]:
    """The end-of-sequence token's text (a chat family adds its turn markers)."""
    eos = special.special_token_ids.get("eos")
    return [tokens[eos]] if eos is not None and eos < len(tokens) else []


def write_modelfile(gguf_file: str | Path, chat_template: Any, stop: list[str]) -> Path:
    """Write an Ollama ``Modelfile`` beside ``gguf_file`` (``ollama create NAME -f Modelfile``).

    Args:
        gguf_file: the GGUF the Modelfile names (``FROM ./<file>``).
        chat_template: the tokenizer's Jinja chat template (None: none); a ChatML, Llama 3,
            Gemma or Mistral one becomes Ollama's ``TEMPLATE`` and adds its turn markers to
            the stop tokens. Any other is left to Ollama, which reads the GGUF's own.
        stop: tokens that end generation (``PARAMETER stop``).

    Returns:
        The Modelfile's path.
    """
    path = Path(gguf_file)
    lines = [f"FROM ./{path.name}"]
    template = chat_template if isinstance(chat_template, str) else ""
    for marker, ollama, turn_tokens in _OLLAMA_TEMPLATES:
        if marker in template:
            lines.append(f'TEMPLATE """{ollama}"""')
            stop = [*stop, *turn_tokens]
            break
    else:
        lines.append("# no TEMPLATE: the model's chat template is not ChatML, Llama 3, Gemma or Mistral; "
                     "Ollama uses the GGUF's tokenizer.chat_template where it recognises it")
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in dict.fromkeys(stop)]
    modelfile = path.with_name("Modelfile")
    modelfile.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return modelfile


# ---------------------------------------------------------------- runs and model specs
def export_run_gguf(source: str | Path, out_dir: str | Path | None = None, gguf_type: str = "f16") -> Path:
    """``outcore export SOURCE --format gguf``: a run's trained model, or a model, as GGUF + Modelfile.

    A run (a directory with ``config.yaml``) is read from its ``final/`` when that is at
    least as new as its latest checkpoint, else its latest checkpoint is exported first
    (``export_run``: out of core, streamed one unit at a time) into a temporary directory.
    Anything else is a model spec (``default``, a Hugging Face directory, a ``.gguf``).
    A GGUF base lends its ``tokenizer.ggml.pre`` (llama.cpp's pre-tokenizer name).

    Args:
        source: a run's output directory or a model spec.
        out_dir: the directory for ``<name>-<type>.gguf`` and ``Modelfile`` (default
            ``RUN/gguf``, or ``./<name>-gguf`` for a model).
        gguf_type: one of :data:`GGUF_TYPES`.

    Returns:
        The GGUF file written.

    Raises:
        ConfigError: an unknown ``gguf_type``.
        CheckpointError: a run with neither ``final/`` nor a complete checkpoint.
        ModelError: a model spec that does not resolve to local files, or that GGUF cannot hold.
    """
    from ..training.config import load_config
    from .export import resolve_model_or_run

    _check_type(gguf_type)
    path = Path(source)
    if (path / "config.yaml").is_file():
        name = path.resolve().name
        pre = _base_pre(load_config(path / "config.yaml", resume=None, overwrite=True).model)
        out = Path(out_dir) if out_dir is not None else path / "gguf"
        out.mkdir(parents=True, exist_ok=True)  # the temporary directory below goes in it
        hf_dir, temporary = resolve_model_or_run(path, scratch=out)  # final/, or a newer checkpoint
        try:
            return export_gguf(hf_dir, out / f"{name}-{gguf_type}.gguf", gguf_type, pre, name)
        finally:
            if temporary is not None:
                temporary.cleanup()
    directory, name, pre = _model_dir(source)
    out = Path(out_dir) if out_dir is not None else Path(f"{name}-gguf")
    return export_gguf(directory, out / f"{name}-{gguf_type}.gguf", gguf_type, pre, name)


def _model_dir(spec: str | Path) -> tuple[Path, str, str | None]:
    """A model spec's local Hugging Face directory (a GGUF's dequantized cache), its name, and
    its GGUF's pre-tokenizer."""
    from ..models import build_gguf_cache, resolve_model_spec

    source = resolve_model_spec(spec)
    if source.kind == "hub":
        raise ModelError(f"GGUF export reads local files; download '{source.location}' first "
                         "(huggingface-cli download) and pass its directory")
    if source.kind == "gguf":
        return build_gguf_cache(source.location), Path(source.location).stem, _gguf_pre(source.location)
    return Path(source.location), Path(source.location).name, None


def _base_pre(spec: str) -> str | None:
    """The pre-tokenizer of a run's base model when it is a GGUF file, else None."""
    from ..models import resolve_model_spec

    try:
        source = resolve_model_spec(spec)
    except ModelError:  # the base moved since the run: the name is only a hint
        return None
    return _gguf_pre(source.location) if source.kind == "gguf" else None


def _gguf_pre(gguf_file: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_file).fields.get("tokenizer.ggml.pre")
    return None if field is None else str(field.contents())
