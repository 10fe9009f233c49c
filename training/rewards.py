"""GRPO's reward functions: the user's, named ``module:function`` in the config, and built-ins.

A reward function is called as TRL's ``GRPOTrainer`` calls one::

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

one value per completion, ``prompts[i]`` repeated for each of its group's completions, and
``columns`` the prompt rows' other fields (``answer``, ...), one list per column, likewise
repeated. Conversational prompts get conversational completions
(``[{"role": "assistant", "content": text}]``). ``None`` marks a completion the function does
not score: it becomes NaN and the weighted sum skips it (TRL's ``nansum``); a completion no
function scores gets no advantage.

Built-ins (name them bare, e.g. ``reward_funcs=exact_answer,format``):

- ``exact_answer``: 1.0 when the completion's final answer equals the ``answer`` column — the
  ``#### X`` line, else the last ``\\boxed{X}``, else the last number — compared as numbers when
  both are, else as text; 0.0 otherwise;
- ``format``: 1.0 when the completion states its answer as ``#### X`` or ``\\boxed{X}``;
- ``regex``: 1.0 when the completion matches ``reward_pattern`` (``re.search``).

Torch-free: what calls them (``recipes/grpo.py``) turns the lists into tensors.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError, DataError

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion: Any) -> str:
    """A completion's text (a conversational one is a list of messages)."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def final_answer(text: str) -> str | None:
    """The final answer a completion states: after ``####``, else the last ``\\boxed{}``, else
    the last number; None when there is none."""
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(answer: str | None, expected: Any) -> bool:
    if answer is None:
        return False
    a, b = answer.replace(",", "").strip().rstrip("."), str(expected).replace(",", "").strip()
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def exact_answer(completions: Sequence[Any], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 per completion whose final answer equals its row's ``answer``, else 0.0."""
    if answer is None:
        raise DataError("reward function 'exact_answer' compares with the data's 'answer' column, which the prompt "
                        "rows lack; add an 'answer' field to every row")
    return [float(_same(final_answer(_text(c)), a)) for c, a in zip(completions, answer)]


def answer_format(completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 per completion that states its answer as ``#### X`` or ``\\boxed{X}``, else 0.0."""
    return [float(bool(_HASHES.search(_text(c)) or _BOXED.search(_text(c)))) for c in completions]


def regex_reward(pattern: str) -> Callable[..., list[float]]:
    """The built-in ``regex``: 1.0 per completion that ``pattern`` matches (``re.search``)."""
    compiled = re.compile(pattern)

    def regex(completions: Sequence[Any], **_: Any) -> list[float]:
        return [float(compiled.search(_text(c)) is not None) for c in completions]
    return regex


BUILTIN_REWARDS = ("exact_answer", "format", "regex")


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function and the name it was given by."""

    name: str
    func: Callable[..., Any]


def check_reward_spec(spec: str) -> None:
    """Check a ``reward_funcs`` entry's form (the config's check; the import waits for the run).

    Raises:
        ConfigError: neither a built-in nor ``module:function``.
    """
    if spec in BUILTIN_REWARDS:
        return
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise ConfigError(f"reward function {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                          f"'module:function' (or 'path/to/file.py:function')")


def load_reward_functions(specs: Sequence[str], pattern: str = "") -> list[RewardFunction]:
    """Import the configured reward functions (before any work of the run).

    Args:
        specs: built-in names, ``module:function`` or ``path/to/file.py:function``.
        pattern: the built-in ``regex``'s pattern.

    Raises:
        ConfigError: an unknown module or function, a non-callable, ``regex`` without a valid
            ``reward_pattern``.
    """
    loaded = []
    for spec in specs:
        check_reward_spec(spec)
        if spec == "regex":
            if not pattern:
                raise ConfigError("reward function 'regex' needs reward_pattern, e.g. reward_pattern='^\\d+$'")
            try:
                loaded.append(RewardFunction(spec, regex_reward(pattern)))
            except re.error as err:
                raise ConfigError(f"reward_pattern={pattern!r} is not a valid regular expression ({err})") from None
            continue
        if spec in BUILTIN_REWARDS:
            loaded.append(RewardFunction(spec, {"exact_answer": exact_answer, "format": answer_format}[spec]))
            continue
        loaded.append(RewardFunction(spec, _import(spec)))
    return loaded


def _import(spec: str) -> Callable[..., Any]:
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ConfigError(f"reward function {spec!r}: no file {str(path)!r}")
            module_spec = importlib.util.spec_from_file_location(f"outcore_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's module's
        raise ConfigError(f"reward function {spec!r}: cannot import {where!r} ({type(err).__name__}: {err}); put the "
                          f"module on PYTHONPATH or name its file") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ConfigError(f"reward function {spec!r}: {where!r} has no function {name!r}")
    return func


def score(funcs: Sequence[RewardFunction], prompts: list[Any], completions: list[Any],
          completion_ids: list[list[int]], columns: dict[str, list[Any]]) -> list[list[float]]:
    """Every function's rewards, ``[function][completion]``, None as NaN.

    Raises:
        DataError: a function raised, or returned other than one number (or None) per completion.
    """
    out = []
    for f in funcs:
        try:
            values = f.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's function: named in one line
            raise DataError(f"reward function {f.name!r} raised {type(err).__name__}: {err}") from None
        out.append(_checked(f.name, values, len(completions)))
    return out


def _checked(name: str, values: Any, n: int) -> list[float]:
    try:
        values = list(values)
    except TypeError:
        raise DataError(f"reward function {name!r} returned {type(values).__name__}, not a list of {n} "
                        f"numbers") from None
    if len(values) != n:
        raise DataError(f"reward function {name!r} returned {len(values)} rewards for {n} completions; return "
                        f"one number (or None) per completion")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, str) or not hasattr(v, "__float__"):
            raise DataError(f"reward function {name!r} returned {v!r:.40}, not a number; return floats (or None)")
        else:
            out.append(float(v))
    return out
