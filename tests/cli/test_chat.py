"""``outcore generate`` (batch, ``--json``) and ``outcore chat`` driven through a pseudo-terminal."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pexpect
import pytest

from outcore.cli import main
from tests._helpers import ROOT


def test_generate_json_gives_each_completion(tiny_chat_model, tmp_path, capsys):
    code = main(["generate", str(tiny_chat_model), "Hello there", "To be", "--max-new-tokens", "5",
                 "--offload", "nvme", "--swap-dir", str(tmp_path / "swap"), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload"] == "nvme" and out["model"] == str(tiny_chat_model)
    assert out["tiers"]["NVME"]["read_bytes"] > 0 and out["seconds"] > 0
    assert [c["prompt"] for c in out["completions"]] == ["Hello there", "To be"]
    for c in out["completions"]:
        assert set(c) == {"prompt", "text", "token_ids", "finish_reason"}
        assert 1 <= len(c["token_ids"]) <= 5 and c["finish_reason"] in ("stop", "length")
    assert out["new_tokens"] == sum(len(c["token_ids"]) for c in out["completions"])


def test_generate_prints_the_completions(tiny_chat_model, capsys):
    from outcore.recipes.generate import generate

    assert main(["generate", str(tiny_chat_model), "To be", "--no-chat", "--max-new-tokens", "6",
                 "--offload", "none"]) == 0
    captured = capsys.readouterr()
    (want,) = generate(tiny_chat_model, "To be", max_new_tokens=6, chat=False, offload="none")
    assert captured.out == want.text.strip() + "\n"
    assert "new tokens in" in captured.err and "offload none" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["generate", "{missing}", "Hi"], "does not exist"),
    (["generate", "{model}", ""], "prompt 1 is empty"),
    (["generate", "{model}", "Hi", "--max-new-tokens", "0"], "max_new_tokens=0"),
    (["chat", "{missing}"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_chat_model, tmp_path, capsys, argv, message):
    argv = [a.format(missing=tmp_path / "missing", model=tiny_chat_model) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("outcore: error: ") and message in err and err.count("\n") == 1


def _spawn_chat(model: Path, *extra: str) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT.parent)), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    return pexpect.spawn(sys.executable, ["-m", "outcore", "chat", str(model), *extra], env=env,
                         encoding="utf-8", timeout=120, echo=False, dimensions=(24, 200))


def test_chat_streams_answers_and_keeps_the_conversation(tiny_chat_model, tmp_path):
    from outcore.recipes.generate import load_generator

    first = [{"role": "user", "content": "Hello"}]
    with load_generator(tiny_chat_model, offload="none") as gen:
        (a1,) = gen.generate([first], max_new_tokens=8)
        second = first + [{"role": "assistant", "content": a1.text.strip()}, {"role": "user", "content": "And?"}]
        (a2,) = gen.generate([second], max_new_tokens=8)
    child = _spawn_chat(tiny_chat_model, "--max-new-tokens", "8", "--offload", "nvme",
                        "--swap-dir", str(tmp_path / "swap"))
    try:
        child.expect_exact("offload nvme")
        child.expect_exact("you> ")
        for message, answer in (("Hello", a1), ("And?", a2)):  # the second answer sees the first turn
            child.sendline(message)
            child.expect_exact("model> ")
            child.expect_exact("you> ")  # the answer streamed, then the next prompt
            assert child.before.replace("\r\n", "\n").strip() == answer.text.strip()
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_session_and_ctrl_d_leaves(tiny_chat_model, tmp_path):
    child = _spawn_chat(tiny_chat_model, "--max-new-tokens", "4000", "--offload", "cpu")
    try:
        child.expect_exact("you> ")
        child.sendline("Tell me everything")
        child.expect_exact("model> ")
        child.expect(r"\S")  # the answer is being streamed
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact("you> ")  # the session goes on
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
