"""A GGUF file, dequantized once and kept as a normal Hugging Face directory.

Dequantizing a GGUF through transformers + gguf costs seconds per hundred million
parameters (~13 s for SmolLM2-135M on 2 cores); loading safetensors costs well
under one. So the first load of a GGUF writes its dequantized weights (fp32,
the exact values GGUF's block formats decode to), config and tokenizer to

    <cache_dir>/gguf/<stem>-<key>/      key = hash(path, size, mtime, versions)

and every later load reads that directory. The directory is written under a
temporary name and renamed into place only once complete (with a marker file
written last), so an interrupted first load never leaves a half-written cache:
the next load sees no directory, or a complete one.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

from ..errors import ModelError

log = logging.getLogger(__name__)

#: Bump when the cache layout changes: old entries are then ignored (never misread).
#: 2: the tokenizer says what the GGUF says (:func:`reconciled_with_gguf`).
CACHE_FORMAT = 2
#: Written last into a cache entry; an entry without it is not used.
MARKER = "outcore-gguf-cache.json"
_TMP_PREFIX = ".tmp-"


def default_cache_dir() -> Path:
    """Where outcore keeps caches: ``$OUTCORE_CACHE``, else ``~/.cache/outcore``.

    Returns:
        The cache root (it may not exist yet).
    """
    env = os.environ.get("OUTCORE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outcore"


def _library_versions() -> dict[str, str]:
    import transformers  # lazy: ~2 s import

    try:
        from importlib.metadata import version
        gguf_version = version("gguf")
    except ImportError:  # pragma: no cover - metadata missing (PackageNotFoundError is an ImportError)
        gguf_version = "unknown"
    return {"transformers": transformers.__version__, "gguf": gguf_version}


def gguf_cache_path(gguf_file: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The cache directory for ``gguf_file`` (whether or not it exists yet).

    Args:
        gguf_file: path of an existing ``.gguf`` file.
        cache_dir: cache root; None means :func:`default_cache_dir`.

    Returns:
        ``<cache_dir>/gguf/<stem>-<key>``; the key changes when the file's path, size or
        mtime, the cache format or the transformers/gguf versions change.
    """
    path = Path(gguf_file).expanduser().resolve()
    st = path.stat()
    identity = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "format": CACHE_FORMAT, **_library_versions()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{path.stem}-{key}"


def is_complete(entry: Path) -> bool:
    """True when ``entry`` is a finished cache entry (its marker was written last)."""
    return (entry / MARKER).is_file()


def _remove_stale_temps(parent: Path) -> None:
    """Delete temporary entries left by processes that died mid-write."""
    import psutil

    for tmp in parent.glob(_TMP_PREFIX + "*"):
        try:
            pid = int(tmp.name.split("-")[-2])
        except (ValueError, IndexError):
            continue
        if not psutil.pid_exists(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Make the entry durable before it becomes visible (rename publishes it)."""
    for path in root.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_gguf_cache(gguf_file: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Return the cache entry of ``gguf_file``, dequantizing and writing it if needed.

    Args:
        gguf_file: path of an existing ``.gguf`` file.
        cache_dir: cache root; None means :func:`default_cache_dir`.

    Returns:
        A complete Hugging Face directory (``config.json``, ``model.safetensors``,
        tokenizer files) that ``from_pretrained`` loads.

    Raises:
        ModelError: transformers cannot read the GGUF (unsupported architecture or
            quantization), or the cache directory cannot be written.
    """
    gguf_file = Path(gguf_file).expanduser().resolve()
    entry = gguf_cache_path(gguf_file, cache_dir)
    if is_complete(entry):
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ModelError(f"cannot create the model cache directory '{entry.parent}': "
                         f"{err.strerror}; set OUTCORE_CACHE or cache_dir to a writable folder"
                         ) from err
    _remove_stale_temps(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-{os.getpid()}-",
                                dir=entry.parent))
    try:
        _dequantize_into(gguf_file, tmp)
        _fsync_tree(tmp)
        if entry.exists() and not is_complete(entry):
            # Entries appear only by rename with their marker inside, so one without a
            # marker was damaged after the fact (never "in progress"): replace it.
            log.warning("replacing damaged model cache entry %s", entry)
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)  # atomic publish: readers see nothing or a complete entry
        except OSError as err:
            if not is_complete(entry):  # not a lost race with another process: a real error
                raise ModelError(f"cannot publish the model cache entry '{entry}': "
                                 f"{err.strerror}; remove it and retry") from err
            log.info("another process cached %s first; using its entry", gguf_file.name)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


@contextlib.contextmanager
def _memoized_tensor_name_map():
    """Memoize ``gguf.get_tensor_name_map`` while transformers maps GGUF names to HF names.

    transformers rebuilds the (arch, n_blocks) name map once per module it visits
    (~400 times for a 30-block model, about a quarter of the whole GGUF load);
    the map is a pure function of its arguments, so one build per key suffices.
    """
    import gguf

    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:  # layout of the gguf package changed: nothing to speed up
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


#: tokenizer attribute -> the GGUF metadata key holding its token id
_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "pad_token": "tokenizer.ggml.padding_token_id", "unk_token": "tokenizer.ggml.unknown_token_id"}
_TOKENIZER_MODEL = "tokenizer.ggml.model"  # "gpt2": byte-level BPE; "llama": SentencePiece-style BPE
#: GGUF metadata value types of a fixed size (type id -> struct format)
_GGUF_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(gguf_file: str | Path, keys: set[str] | frozenset[str]) -> dict[str, object]:
    """The GGUF metadata values of ``keys`` that are numbers, booleans or strings (arrays are
    left out, as are keys the file lacks).

    Reads the metadata section only, stepping over the vocabulary's arrays (~20 ms for a
    49k-token vocabulary; ``gguf.GGUFReader`` parses every field, ~2 s).

    Raises:
        ValueError: not a GGUF file of version 2 or 3, or one cut short.
    """
    with open(gguf_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
                raise ValueError(f"'{gguf_file}' is not a GGUF file of version 2 or 3")

            def string(at: int) -> tuple[str, int]:  # the string at ``at`` and the offset after it
                (size,) = struct.unpack_from("<Q", m, at)
                if at + 8 + size > len(m):
                    raise struct.error("a string runs past the end of the file")
                return bytes(m[at + 8:at + 8 + size]).decode("utf-8", "replace"), at + 8 + size

            def skip(kind: int, at: int) -> int:  # the offset after one value of ``kind``
                if kind in _GGUF_FIXED:
                    return at + struct.calcsize(_GGUF_FIXED[kind])
                if kind == _GGUF_STRING:
                    return at + 8 + struct.unpack_from("<Q", m, at)[0]
                if kind != _GGUF_ARRAY:
                    raise ValueError(f"'{gguf_file}': unknown GGUF value type {kind}")
                item, n = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in _GGUF_FIXED:
                    return at + n * struct.calcsize(_GGUF_FIXED[item])
                for _ in range(n):
                    at = skip(item, at)
                return at

            (count,), at, out = struct.unpack_from("<Q", m, 16), 24, {}
            for _ in range(count):
                key, at = string(at)
                (kind,) = struct.unpack_from("<I", m, at)
                at += 4
                if key in keys and kind in _GGUF_FIXED:
                    out[key] = struct.unpack_from(_GGUF_FIXED[kind], m, at)[0]
                elif key in keys and kind == _GGUF_STRING:
                    out[key] = string(at)[0]
                at = skip(kind, at)
            return out
        except struct.error as err:
            raise ValueError(f"'{gguf_file}' is cut short: {err}") from None


def reconciled_with_gguf(tokenizer, gguf_file: str | Path):
    """``tokenizer``, built by transformers from ``gguf_file``, made to say what the file says.

    transformers 5.24 reads a GGUF's tokenizer faithfully; 5.17 (the GPU image's) does not for
    a Llama-family file such as SmolLM2's, which is why both corrections exist:

    - special tokens: the file names them by id (``tokenizer.ggml.eos_token_id`` ...); 5.17
      made SmolLM2's EOS ``<|im_start|>`` (the BOS) and gave it no pad token, so chat turns
      were closed with the wrong token and padded batches were refused. The file's win.
    - byte-level BPE (``tokenizer.ggml.model`` ``gpt2``): 5.17 built it with SentencePiece's
      byte fallback and decoder. Token ids and text come out the same (every byte is a
      byte-level token, so the fallback never fires), but the saved ``tokenizer.json`` no
      longer reads as GPT-2 BPE, so ``outcore export --format gguf`` wrote a Llama
      tokenizer without merges. The byte-level model and decoder are put back.
    """
    try:
        meta = gguf_metadata(gguf_file, frozenset(_SPECIAL_IDS.values()) | {_TOKENIZER_MODEL})
    except (OSError, ValueError) as err:  # transformers has just read it: not expected
        log.warning("cannot read the tokenizer metadata of %s: %s", gguf_file, err)
        return tokenizer
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            token = tokenizer.convert_ids_to_tokens(token_id)
            if getattr(tokenizer, name) != token:
                setattr(tokenizer, name, token)
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
    if meta.get(_TOKENIZER_MODEL) == "gpt2" and backend is not None:
        from tokenizers import decoders, models

        if isinstance(backend.model, models.BPE) and backend.model.byte_fallback:
            backend.model.byte_fallback = False  # the model object is shared: set in place
        if not isinstance(backend.decoder, decoders.ByteLevel):
            backend.decoder = decoders.ByteLevel()
    return tokenizer


def _dequantize(gguf_file: Path):
    """Load ``gguf_file`` through transformers + gguf as a dense fp32 model and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5 may keep GGUF blocks packed (not trainable): ask for dense weights
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    try:
        tokenizer = reconciled_with_gguf(
            AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name), gguf_file)
        with _memoized_tensor_name_map():
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                         dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"cannot read GGUF file '{gguf_file}': {first}; outcore loads GGUF "
                         f"files of the Llama, Qwen2, Mistral and Gemma3 families") from err
    # The weights are now plain dense tensors; drop the GGUF quantizer so that
    # save_pretrained writes them (it refuses to serialize a "quantized" model).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _dequantize_into(gguf_file: Path, out: Path) -> None:
    """Dequantize ``gguf_file`` and save it as a Hugging Face directory in ``out``."""
    start = time.perf_counter()
    model, tokenizer = _dequantize(gguf_file)
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        meta = {"source": str(gguf_file), "size": gguf_file.stat().st_size,
                "mtime_ns": gguf_file.stat().st_mtime_ns, "format": CACHE_FORMAT,
                "dequantize_s": round(time.perf_counter() - start, 3), **_library_versions()}
        (out / MARKER).write_text(json.dumps(meta, indent=2))  # last: marks the entry complete
    except OSError as err:
        raise ModelError(f"cannot write the model cache '{out.parent}': {err.strerror}; free "
                         f"disk space or set OUTCORE_CACHE to another folder") from err
