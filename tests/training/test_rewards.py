"""GRPO's reward functions: the built-ins' answers, TRL's calling convention, and the one-line
errors of a function that cannot be loaded, raises or returns the wrong thing."""
from __future__ import annotations

import math

import pytest

from outcore.errors import ConfigError, DataError
from outcore.training.rewards import final_answer, load_reward_functions, score


@pytest.mark.parametrize("text,answer", [
    ("so the sum is 12.", "12"), ("first 3 then 4\n#### 1,234", "1,234"), (r"thus \boxed{7} and 9", "7"),
    ("no number here", None),
])
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_builtins_score_as_documented():
    funcs = load_reward_functions(["exact_answer", "format", "regex"], pattern=r"^\s*\d+")
    completions = [" 12", "It is #### 12.0", r"\boxed{13}", [{"role": "assistant", "content": "12"}]]
    rewards = score(funcs, ["p"] * 4, completions, [[1]] * 4, {"answer": ["12", "12", "12", "12"]})
    assert rewards == [[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]


def test_user_function_gets_trl_arguments(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def f(prompts, completions, completion_ids, answer, level, **kw):\n"
        "    return [None if l == 'skip' else float(len(i)) for l, i in zip(level, completion_ids)]\n")
    funcs = load_reward_functions([f"{tmp_path / 'mine.py'}:f"])
    got = score(funcs, ["a", "a"], ["x", "y"], [[1, 2], [3]], {"answer": ["1", "1"], "level": ["skip", "ok"]})
    assert math.isnan(got[0][0]) and got[0][1] == 1.0


def test_errors_are_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("def boom(completions, **kw):\n    raise KeyError('answer')\n"
                                     "def nan(completions, **kw):\n    return 3\n")
    with pytest.raises(ConfigError, match="needs reward_pattern"):
        load_reward_functions(["regex"])
    with pytest.raises(ConfigError, match=r"reward_pattern='\(' is not a valid regular expression"):
        load_reward_functions(["regex"], pattern="(")
    with pytest.raises(ConfigError, match="no file"):
        load_reward_functions([f"{tmp_path / 'none.py'}:f"])
    with pytest.raises(DataError, match=r"reward function '.*bad.py:boom' raised KeyError: 'answer'"):
        score(load_reward_functions([f"{tmp_path / 'bad.py'}:boom"]), ["p"], ["c"], [[1]], {})
    with pytest.raises(DataError, match=r"returned int, not a list of 1 numbers"):
        score(load_reward_functions([f"{tmp_path / 'bad.py'}:nan"]), ["p"], ["c"], [[1]], {})
    with pytest.raises(DataError, match="'exact_answer' compares with the data's 'answer' column"):
        score(load_reward_functions(["exact_answer"]), ["p"], ["c"], [[1]], {})
