"""``--json``: stdout holds the JSON document alone, whatever libraries print meanwhile.

The case that broke it: with DeepSpeed installed, accelerate imports it inside every
``save_pretrained``; DeepSpeed binds its logger to ``sys.stdout`` on import and warns there
("Setting accelerator to CPU ..."), so ``outcore generate default --json`` on a fresh GGUF
cache printed that line ahead of its JSON. Reproduced here without DeepSpeed: a package of
that name which does what DeepSpeed's import does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from tests._helpers import ROOT, load_module

TESTS = ROOT / "tests"


def test_everything_but_the_document_goes_to_stderr():
    """A logger bound to stdout before and one bound inside, a print, a write to file descriptor 1
    and a child process: all on stderr; the document alone on stdout; stdout back afterwards."""
    code = textwrap.dedent("""
        import json, logging, os, subprocess, sys
        from outcore.cli.jsonout import emit_json, json_stdout

        def bound(name):
            log = logging.getLogger(name)
            log.propagate = False
            log.addHandler(logging.StreamHandler(stream=sys.stdout))
            return log

        before = bound("before")
        with json_stdout(True):
            bound("inside").warning("a handler bound inside")
            before.warning("a handler bound before")
            print("a print")
            os.write(1, b"a write to fd 1\\n")
            subprocess.run([sys.executable, "-c", "print('a child')"], check=True)
            emit_json(json.dumps({"ok": True}))
        print("stdout is back")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == '{"ok": true}\nstdout is back\n'
    for line in ("a handler bound inside", "a handler bound before", "a print", "a write to fd 1", "a child"):
        assert line in out.stderr, (line, out.stderr)


def test_a_library_printing_when_imported_leaves_the_json_alone(tmp_path):
    """End to end through the real path: ``outcore generate X.gguf --json`` writes the GGUF's
    cache (``save_pretrained``, where accelerate imports an installed ``deepspeed``)."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text(textwrap.dedent("""
        import logging, sys
        # what deepspeed/utils/logging.py does on import
        logger = logging.getLogger("DeepSpeed")
        logger.propagate = False
        logger.addHandler(logging.StreamHandler(stream=sys.stdout))
        logger.warning("Setting accelerator to CPU (a stand-in for DeepSpeed)")

        class DeepSpeedEngine:  # what accelerate's extract_model_from_parallel imports
            pass
    """))
    (site / "deepspeed-0.0.0.dist-info").mkdir()  # accelerate asks the package's metadata too
    (site / "deepspeed-0.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0.0\n")

    models = load_module(TESTS / "models" / "conftest.py")
    tiny = load_module(TESTS / "models" / "test_gguf_tiny.py")
    gguf = tmp_path / "tiny.gguf"
    with torch.no_grad():
        tiny.write_tiny_gguf(gguf, models.make_family_model("llama", tie=True), models.make_tokenizer())

    env = {**os.environ, "OUTCORE_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "outcore", "generate", str(gguf), "To be", "--no-chat",
                          "--max-new-tokens", "2", "--offload", "none", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the stand-in was imported during the command (else this test proves nothing) ...
    assert "a stand-in for DeepSpeed" in out.stdout + out.stderr, out.stderr[-3000:]
    # ... and stdout is the document alone
    doc = json.loads(out.stdout)
    assert "a stand-in for DeepSpeed" in out.stderr
    assert doc["model"] == str(gguf) and 1 <= doc["new_tokens"] <= 2
