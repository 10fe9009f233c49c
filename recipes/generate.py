"""Generation: text from a model or a fine-tuning run, with transformers' ``generate``.

:func:`load_generator` loads what ``outcore finetune --model`` takes (the embedded
``default``, a Hugging Face directory, a ``.gguf``, a hub id), or a run directory (its
``final/`` model, or its newest checkpoint exported to a temporary directory), either in
memory or with its weights streamed through the tiers (``offload.engine.inference``, the
training engine's hooks and prefetch). A :class:`Generator` then runs
``model.generate`` — its KV cache, greedy (``temperature=0``) or sampled — on a batch of
prompts (:meth:`Generator.generate`, ``outcore generate``) or on one conversation with
the text streamed as it is generated (:meth:`Generator.stream`, ``outcore chat``).

Streamed, every generated token is one forward, and so one pass of all the weights
through the tiers: a batch of prompts shares each pass (they are generated together,
left-padded), which is why ``generate`` takes several.
"""
from __future__ import annotations

import copy
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from ..dtypes import DTYPES, torch_dtype
from ..errors import ConfigError
from ..offload.device import resolve_device
from ..offload.modes import AUTO, NONE, OFFLOAD_MODES
from .export import resolve_model_or_run

#: a prompt: plain text, or a conversation (``[{"role": "user", "content": "..."}, ...]``)
Prompt = Union[str, Sequence[dict]]

STOP, LENGTH, INTERRUPTED = "stop", "length", "interrupted"  # why a completion ended
_FITS_FRACTION = 0.5  # `auto` keeps a model in memory when its weights take at most this share of free RAM


@dataclass(frozen=True)
class Completion:
    """One prompt's generated text.

    Attributes:
        prompt: the prompt as given (a conversation's last message).
        text: the generated text, special tokens removed.
        token_ids: the generated tokens (an end-of-sequence token included, padding not).
        finish_reason: ``"stop"`` (an end-of-sequence token), ``"length"`` (``max_new_tokens``)
            or ``"interrupted"``.
    """

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str


class _StopWhenSet:
    """A ``StoppingCriteria``: stop every sequence once ``event`` is set (Ctrl-C in a chat),
    at the end of the token being generated, so the forward in progress completes."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class Generator:
    """A loaded model, ready to generate (build it with :func:`load_generator`).

    Args:
        model: a causal LM (in memory, or its weights streamed by ``streamed``).
        tokenizer: its tokenizer.
        streamed: the ``offload.engine.inference.StreamedInference`` streaming its weights (None: in memory).
        temporary: a directory to remove on :meth:`close` (a run's checkpoint exported for this).
        device: where it computes (in memory the model is moved there; streamed, the engine's).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, streamed: Any = None,
                 temporary: tempfile.TemporaryDirectory | None = None, device: torch.device | None = None):
        self.model, self.tokenizer, self.streamed = model, tokenizer, streamed
        self.device = streamed.engine.device if streamed is not None else (device or torch.device("cpu"))
        if streamed is None:
            model.to(self.device)
        self._temporary = temporary
        # a decoder generates after the prompt's last token: pad on the left
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model.config.use_cache = True  # (a model loaded for streaming has it off)

    @property
    def offload(self) -> str:
        """Where the weights are: ``none`` (in memory), ``cpu`` or ``nvme`` (streamed)."""
        if self.streamed is None:
            return NONE
        return "nvme" if self.streamed.engine.store.has_tier("nvme") else "cpu"

    @property
    def has_chat_template(self) -> bool:
        """Does the tokenizer carry a chat template?"""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _texts(self, prompts: Sequence[Prompt], chat: bool | None) -> tuple[list[str], list[str], bool]:
        """Each prompt as the text the model reads, and as shown; whether the template applied."""
        chat = self.has_chat_template if chat is None else chat
        if chat and not self.has_chat_template:
            raise ConfigError("this model's tokenizer has no chat template; generate with chat=False "
                              "(--no-chat) or use a chat model")
        texts, shown = [], []
        for i, prompt in enumerate(prompts, 1):
            if not chat and not isinstance(prompt, str):
                raise ConfigError(f"prompt {i} is a conversation: it needs the chat template (chat=True)")
            messages = _messages(prompt)
            shown.append(messages[-1]["content"])
            texts.append(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                         if chat else prompt)
        return texts, shown, chat

    def _run(self, prompts: Sequence[Prompt], *, max_new_tokens: int, temperature: float, seed: int,
             chat: bool | None, streamer: Any = None, stop: threading.Event | None = None
             ) -> list[Completion]:
        """``model.generate`` on the prompts, left-padded into one batch (one pass of the weights
        per token for all of them)."""
        from transformers import StoppingCriteriaList

        check_request(prompts, max_new_tokens, temperature)
        texts, shown, chat = self._texts(prompts, chat)
        # the template writes its own special tokens (the BOS among them)
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat).to(self.device)
        config = _generation_config(self.model, self.tokenizer, max_new_tokens, temperature)
        stop = stop or threading.Event()
        torch.manual_seed(seed)
        out = self.model.generate(**batch, generation_config=config, streamer=streamer,
                                  stopping_criteria=StoppingCriteriaList([_StopWhenSet(stop)]))
        eos = config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        completions = []
        for prompt, row in zip(shown, out[:, batch["input_ids"].shape[1]:].tolist()):
            end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
            reason = STOP if end is not None else INTERRUPTED if stop.is_set() else LENGTH
            ids = row[:end]
            completions.append(Completion(prompt, self.tokenizer.decode(ids, skip_special_tokens=True), ids, reason))
        return completions

    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int = 64, temperature: float = 0.0,
                 seed: int = 0, chat: bool | None = None) -> list[Completion]:
        """Complete every prompt, all together (each token one forward for the whole batch).

        Args:
            prompts: texts, or conversations (lists of ``{"role", "content"}``).
            max_new_tokens: the most tokens generated per prompt.
            temperature: 0 decodes greedily; above 0 samples (with the model's own top-k /
                top-p from its generation config).
            seed: the sampling seed (``torch.manual_seed``).
            chat: apply the tokenizer's chat template (default: when it has one).

        Returns:
            One :class:`Completion` per prompt, in order.

        Raises:
            ConfigError: no prompt, an empty one, a bad ``max_new_tokens`` or ``temperature``,
                or ``chat`` asked of a model without a chat template.
        """
        return self._run(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat)

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
               chat: bool | None = None) -> Iterator[str]:
        """Generate from one prompt, yielding the text as it is decoded.

        ``generate`` runs on a worker thread and hands text over through transformers'
        ``TextIteratorStreamer``. When the caller stops iterating — it breaks, or Ctrl-C
        raises ``KeyboardInterrupt`` in it — the worker is told to stop after the token in
        progress and is waited for, so a streamed model is never left mid-forward.

        Args:
            prompt, max_new_tokens, temperature, seed, chat: as :meth:`generate`, one prompt.

        Yields:
            Pieces of text, as soon as they decode to whole characters.

        Raises:
            ConfigError: as :meth:`generate`.
        """
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        stop, failed = threading.Event(), []

        def work() -> None:
            try:
                self._run([prompt], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat,
                          streamer=streamer, stop=stop)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
                failed.append(err)
                streamer.end()  # wake the reader

        worker = threading.Thread(target=work, name="outcore-generate", daemon=True)
        worker.start()
        try:
            yield from streamer
        finally:
            stop.set()
            worker.join()
        if failed:
            raise failed[0]

    def tier_stats(self) -> dict[str, Any]:
        """Per-tier ``TierStats`` of the streamed weights (bytes held and moved; {} in memory)."""
        return {} if self.streamed is None else self.streamed.tier_stats()

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for streamed weights (0 in memory)."""
        return 0.0 if self.streamed is None else self.streamed.stall_s

    def close(self) -> None:
        """Free the streamed weights' arenas and swap directory, and any temporary export."""
        try:
            if self.streamed is not None:
                self.streamed.close()
                self.streamed = None
        finally:
            if self._temporary is not None:
                self._temporary.cleanup()
                self._temporary = None

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _messages(prompt: Prompt) -> list[dict]:
    """A prompt as a conversation: plain text is one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def check_request(prompts: Sequence[Prompt], max_new_tokens: int, temperature: float) -> None:
    """Check a generation request before a model is loaded for it.

    Args:
        prompts: texts or conversations; each must end in a non-empty message.
        max_new_tokens: a positive integer.
        temperature: >= 0.

    Raises:
        ConfigError: no prompt, an empty one, or a bad ``max_new_tokens`` / ``temperature``.
    """
    if not prompts:
        raise ConfigError("no prompt given; pass at least one prompt")
    for i, prompt in enumerate(prompts, 1):
        messages = _messages(prompt)
        last = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
        if not isinstance(last, str) or not last.strip():
            raise ConfigError(f"prompt {i} is empty; pass some text")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not temperature >= 0:
        raise ConfigError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")


def _generation_config(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int, temperature: float) -> Any:
    """The model's own generation config (its end-of-sequence tokens, top-k / top-p) set to
    decode greedily or sample at ``temperature``."""
    config = copy.deepcopy(model.generation_config)
    sampling = temperature > 0
    config.update(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=tokenizer.pad_token_id)
    if sampling:
        config.temperature = temperature
    else:  # unset what only sampling reads, so transformers does not warn about it
        config.temperature = config.top_p = config.top_k = None
    if config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    return config


def load_generator(model: str | Path = "default", *, offload: str = AUTO, dtype: str = "float32",
                   swap_dir: str | Path | None = None, prefetch: int = 2, device: str = "auto") -> Generator:
    """Load a model (or a run's trained model) to generate with.

    Args:
        model: ``default``, a Hugging Face directory, a ``.gguf`` file, a hub id, or a run
            directory of ``outcore finetune`` (its ``final/``, or its newest checkpoint).
        offload: ``none`` (in memory), ``cpu`` (weights in RAM, streamed to the device),
            ``nvme`` (streamed from ``swap_dir``), or ``auto`` (in memory when the weights
            take at most half the free RAM, else ``nvme``).
        dtype: the weights' dtype (``float32``, ``bfloat16``, ``float16``).
        swap_dir: the NVMe swap directory (default: a fresh one under the outcore cache).
        prefetch: units read ahead of the one computing when streamed.
        device: where it computes (``auto``: the GPU when there is one, ``cuda``, ``cpu``).

    Returns:
        The :class:`Generator` (``close()`` it, or use it in a ``with``).

    Raises:
        ConfigError: an unknown ``offload`` or ``dtype``.
        ModelError: the model cannot be found or loaded.
        CheckpointError: a run with nothing to load.
    """
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"offload={offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    spec, temporary = resolve_model_or_run(model)
    try:
        return _load(spec, offload, torch_dtype(dtype), swap_dir, prefetch, temporary, resolve_device(device))
    except BaseException:
        if temporary is not None:
            temporary.cleanup()
        raise


def _load(spec: str, offload: str, dtype: torch.dtype, swap_dir: str | Path | None, prefetch: int,
          temporary: tempfile.TemporaryDirectory | None, device: torch.device) -> Generator:
    from ..models import load_model, load_model_lazily, plain_name, resolve_model_spec

    if offload == NONE or (offload == AUTO and resolve_model_spec(spec).kind == "hub"):
        return Generator(*load_model(spec, dtype=dtype), temporary=temporary, device=device)
    # built on the meta device: streamed, its weights go from the files into the store unit by unit
    model, tokenizer, fill = load_model_lazily(spec, dtype=dtype)
    if offload == AUTO:
        if _fits_in_memory(model):
            return Generator(*load_model(spec, dtype=dtype), temporary=temporary, device=device)
        offload = "nvme"
    from ..models import default_cache_dir
    from ..offload.engine import StreamedInference

    if swap_dir is None:
        (default_cache_dir() / "swap").mkdir(parents=True, exist_ok=True)
    swap = Path(swap_dir) if swap_dir else default_cache_dir() / "swap" / f"generate-{os.getpid()}"
    streamed = StreamedInference(model, offload=offload, swap_dir=swap, prefetch=prefetch, device=device,
                                 init_weights=lambda slot, t: fill(plain_name(slot.name), t))
    return Generator(model, tokenizer, streamed, temporary)


def _fits_in_memory(model: torch.nn.Module) -> bool:
    """Do the weights of ``model`` (on the meta device) take at most ``_FITS_FRACTION`` of free RAM?"""
    import psutil

    from ..models import parameter_bytes

    return parameter_bytes(model) <= _FITS_FRACTION * psutil.virtual_memory().available


def generate(model: str | Path, prompts: Prompt | Sequence[Prompt], *, max_new_tokens: int = 64,
             temperature: float = 0.0, seed: int = 0, chat: bool | None = None, offload: str = AUTO,
             dtype: str = "float32", swap_dir: str | Path | None = None, device: str = "auto") -> list[Completion]:
    """Load ``model``, complete ``prompts``, free the model: ``outcore.generate``.

    Args:
        model: as :func:`load_generator` (a run directory gives its trained model).
        prompts: one prompt or several: texts, or conversations (``[{"role", "content"}]``).
        max_new_tokens, temperature, seed, chat: as :meth:`Generator.generate`.
        offload, dtype, swap_dir, device: as :func:`load_generator`.

    Returns:
        One :class:`Completion` per prompt.

    Raises:
        OutcoreError: as :func:`load_generator` and :meth:`Generator.generate`.
    """
    one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], dict))
    prompts = [prompts] if one else list(prompts)
    check_request(prompts, max_new_tokens, temperature)
    with load_generator(model, offload=offload, dtype=dtype, swap_dir=swap_dir, device=device) as generator:
        return generator.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  chat=chat)
