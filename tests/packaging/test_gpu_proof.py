"""The GPU proof's harness (scripts/gpu_proof.sh, docs/gpu_proof.md), tested where CI runs: no GPU.

The dry run puts every stage on the simulated accelerator (the CPU until it exists) at tiny
shapes: each stage's JSON must exist and parse, summary.json must list every stage, and no stage
of a dry run may fail, error or time out. What is absent here (DeepSpeed, torchao, the lead's
step bench) must say skipped or missing with a reason, and never count as passed.
The books (_gpu_proof.py), the JSON-only stdout and the verdicts are tested alone, in seconds.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest

from tests._helpers import ROOT

SCRIPTS = ROOT / "scripts"
STAGES = ("setup", "env", "tests", "kernels", "ds_ops", "step_1.7b", "step_1.7b_host", "step_8b", "long_8b",
          "peers_1.7b", "peers_8b", "race")
FILES = ("setup.json", "env.json", "tests.json", "kernels.json", "ds_ops.json", "step_1.7b.json", "step_1.7b_host.json",
         "step_8b.json", "long_8b.json", "peers_1.7b.json", "peers_8b.json", "peers.json", "race.json", "summary.json")


def _scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))


@pytest.mark.slow(ci=True)  # ~2-3 minutes on 2 cores: every stage, tiny
def test_dry_run_writes_every_stage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # --out given: the full layout
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_proof.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = tmp_path
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = {}
    for name in FILES:
        assert (out / name).exists(), f"{name} missing; stdout: {proc.stdout[-2000:]}"
        data[name] = json.loads((out / name).read_text())
        assert isinstance(data[name], dict) and data[name].get("status"), name
    summary = data["summary.json"]
    assert summary["complete"] and summary["dry_run"]
    assert [s["stage"] for s in summary["stages"]] == list(STAGES)
    for s in summary["stages"]:  # the harness works: nothing failed, errored, timed out or went unrun
        assert s["status"] in ("passed", "partial", "skipped", "missing"), s
        assert (out / s["file"]).exists() and s["seconds"] >= 0
        assert f"[gpu_proof] {s['stage']}" in proc.stdout  # its one-line summary
    assert summary["elapsed_s"] <= summary["budget_s"]

    tests = data["tests.json"]
    for suite, xml in (("gpu", "tests_gpu.xml"), ("equivalence", "tests_equiv.xml")):
        ET.parse(out / xml)  # junit XML, parseable
        assert tests["suites"][suite]["junit"] == xml
    assert tests["counts"]["passed"] >= 1 and tests["failed"] == []
    # no CUDA here: every gpu-marked test is skipped, and a suite of skips is not a pass
    assert tests["suites"]["gpu"]["status"] == "skipped"

    kernels = data["kernels.json"]
    assert set(kernels["kernels"]) >= {"adamw8bit", "quantize", "dequantize", "stochastic_round", "zo_perturb",
                                       "lce_fp32", "lce_bf16"}
    assert kernels["device"]["used"] in ("sim", "cpu")
    if kernels["device"]["used"] == "cpu":  # the simulated accelerator is not there yet: said so
        assert kernels["device"]["fallback"]
    for k in kernels["kernels"].values():
        assert k["status"] != "ok" or k.get("impl", "reference") != "reference"  # the reference vs itself is no pass
        if k["status"] == "skipped":
            assert k["reason"]

    for shape in ("1.7b", "8b"):
        peers = data[f"peers_{shape}.json"]
        assert data["peers.json"]["shapes"][shape]["peers"] == peers["peers"]
        for name, p in peers["peers"].items():
            assert p["status"] in ("ok", "skipped", "not_run"), (name, p)
            if p["status"] != "ok":
                assert p["reason"], name
            else:
                assert p["median_step_s"] > 0 and p["tokens_per_s"] > 0 and len(p["losses"]) == 3
        if any(p["status"] != "ok" for p in peers["peers"].values()):
            assert peers["status"] != "passed"  # a skipped peer is never counted as passed

    if importlib.util.find_spec("deepspeed") is None:
        assert data["ds_ops.json"]["status"] == "skipped" and data["ds_ops.json"]["reason"]
    if not (ROOT / "scripts" / "bench_gpu_step.py").exists():
        for name in ("step_1.7b.json", "step_1.7b_host.json", "step_8b.json", "long_8b.json", "race.json"):
            assert data[name]["status"] == "missing" and data[name]["reason"]
    else:  # the long-context stage planned its length, then (a dry run) trained 64 tokens of it
        long = data["long_8b.json"]
        assert long["status"] == "passed" and long["longest"]["seq_len"] >= long["seq_len"] == 64
        assert long["activations"] == long["longest"]["activations"] and long["seq_tile"] == "auto"


def _books(tmp_path, *extra):
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    return work, ["--work", str(work), "--device", "cpu", "--budget", "480", *extra]


def _gpu_proof(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "_gpu_proof.py"), *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_stage_without_json_is_recorded_with_why(tmp_path):
    work, books = _books(tmp_path)
    (work / "logs" / "kernels.log").write_text("Traceback ...\nRuntimeError: CUDA error: an illegal memory access\n")
    (work / "kernels.json").write_text("")  # the tool died before printing
    (work / "race.json").write_text('{"partial": ')  # cut off
    assert _gpu_proof("finish", "--name", "kernels", "--file", "kernels.json", "--rc", "1", "--seconds", "3",
                      *books).returncode == 0
    assert _gpu_proof("finish", "--name", "race", "--file", "race.json", "--rc", "124", "--seconds", "45",
                      *books).returncode == 0
    assert _gpu_proof("finish", "--name", "peers_8b", "--file", "peers_8b.json", "--rc", "125", "--seconds", "0",
                      "--reason", "the proof's 480 s budget was spent", *books).returncode == 0
    k = json.loads((work / "kernels.json").read_text())
    assert k["status"] == "error" and "illegal memory access" in k["log_tail"][-1]
    assert json.loads((work / "race.json").read_text())["status"] == "timeout"
    assert json.loads((work / "peers_8b.json").read_text())["status"] == "not_run"
    summary = json.loads((work / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [
        ("kernels", "error"), ("race", "timeout"), ("peers_8b", "not_run")]
    assert summary["status"] == "failed" and not summary["complete"]
    final = _gpu_proof("summary", "--elapsed", "50", *books)
    assert final.returncode == 1 and json.loads((work / "summary.json").read_text())["complete"]


def test_a_timed_out_tool_keeps_its_partial_json(tmp_path):
    work, books = _books(tmp_path)
    (work / "peers_1.7b.json").write_text(json.dumps({"status": "interrupted", "peers": {"plain": {"status": "ok"}}}))
    _gpu_proof("finish", "--name", "peers_1.7b", "--file", "peers_1.7b.json", "--rc", "124", "--seconds", "110",
               *books)
    assert json.loads((work / "peers_1.7b.json").read_text())["peers"]["plain"]["status"] == "ok"  # kept
    assert json.loads((work / "summary.json").read_text())["stages"][0]["status"] == "timeout"


def test_compact_output_fits_the_device_tool(tmp_path):
    """With $OUT as the output the device tool returns at most 8 files: summary.json (every stage's
    JSON inside) and a tarball of everything."""
    publish = tmp_path / "OUT"
    work, books = _books(tmp_path, "--publish", str(publish))
    for i in range(12):
        (work / f"s{i}.json").write_text(json.dumps({"status": "passed", "i": i}))
        _gpu_proof("finish", "--name", f"s{i}", "--file", f"s{i}.json", "--rc", "0", "--seconds", "1", *books)
    (work / "tests_gpu.xml").write_text("<testsuites/>")
    _gpu_proof("summary", "--elapsed", "12", *books)
    files = sorted(p.name for p in publish.iterdir())
    assert files == ["gpu_proof.tar.gz", "summary.json"]
    summary = json.loads((publish / "summary.json").read_text())
    assert summary["complete"] and summary["results"]["s11"] == {"status": "passed", "i": 11}
    names = tarfile.open(publish / "gpu_proof.tar.gz").getnames()
    assert "gpu_proof/tests_gpu.xml" in names and "gpu_proof/s0.json" in names


def test_junit_summary_counts_and_names_failures(tmp_path, monkeypatch):
    _scripts_on_path(monkeypatch)
    from _gpu_proof import _suite_status, junit_summary, worst

    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite name="pytest">
      <testcase classname="tests.kernels.test_quantize" name="test_a"/>
      <testcase classname="tests.kernels.test_quantize" name="test_b">
        <failure message="assert 1 == 2">tb</failure></testcase>
      <testcase classname="tests.offload.test_engine" name="test_c"><skipped message="needs a CUDA device"/></testcase>
      <testcase classname="tests.offload.test_engine" name="test_d"><error message="fixture broke"/></testcase>
    </testsuite></testsuites>""")
    s = junit_summary(xml)
    assert s["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert [f["id"] for f in s["failed"]] == ["tests.kernels.test_quantize::test_b",
                                              "tests.offload.test_engine::test_d"]
    assert s["failed"][0]["message"] == "assert 1 == 2" and s["skipped_reasons"] == {"needs a CUDA device": 1}
    assert _suite_status({**s, "timed_out": False, "exit_code": 1}) == "failed"
    only_skips = {"counts": {"passed": 0, "failed": 0, "errors": 0, "skipped": 3}, "timed_out": False, "exit_code": 0}
    assert _suite_status(only_skips) == "skipped"  # never a pass
    assert worst(["passed", "skipped"]) == "partial" and worst(["passed", "timeout"]) == "timeout"
    assert worst(["passed", "passed"]) == "passed" and worst(["skipped", "missing"]) == "skipped"


def test_kernel_verdicts(monkeypatch):
    _scripts_on_path(monkeypatch)
    import torch
    from bench_kernels import bits_equal, overall, verdict

    assert verdict("triton", True, "bit-identical")["status"] == "ok"
    assert verdict("triton", False, "bit-identical")["status"] == "failed"
    ref = verdict("reference", True, "bit-identical")  # the reference compared with itself proves nothing
    assert ref["status"] == "skipped" and ref["reason"]
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, different bits
    assert bits_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert overall({"a": {"status": "ok"}, "b": {"status": "skipped"}}) == "partial"
    assert overall({"a": {"status": "ok"}, "b": {"status": "error"}}) == "failed"
    assert overall({"a": {"status": "ok"}}) == "passed"


def test_peer_prechecks_and_verdicts(monkeypatch):
    _scripts_on_path(monkeypatch)
    from bench_peers import overall, parse_args, precheck

    args = parse_args(["--shape", "1.7b", "--gpu-mem-gib", "24"])
    why = precheck("plain", args, 1_711_376_384, "cuda")  # fp32 + AdamW: 16 B/param = 25.5 GiB
    assert why and "does not fit" in why and "25.5 GiB" in why
    assert precheck("plain_bf16", args, 1_711_376_384, "cuda") is None  # 12.7 GiB
    assert "CUDA" in precheck("torchao_cpu_offload", args, 1000, "cpu")
    assert precheck("plain", args, 10**12, "cpu") is None  # no GPU cap off CUDA
    assert overall({"a": {"status": "ok"}, "b": {"status": "oom"}}) == "partial"
    assert overall({"a": {"status": "ok"}, "b": {"status": "timeout"}}) == "failed"
    assert overall({"a": {"status": "skipped"}}) == "skipped"


def test_race_check_compares_losses_bit_for_bit(tmp_path):
    """The race stage runs the step bench with and without CUDA_LAUNCH_BLOCKING=1; a loss that
    differs in its last bit is a difference."""
    fake = tmp_path / "fake_step.py"
    fake.write_text("import json, os\n"
                    "late = 2.5 if os.environ.get('CUDA_LAUNCH_BLOCKING') != '1' or 'SAME' in os.environ "
                    "else 2.5000000000000004\n"
                    "print(json.dumps({'status': 'passed', 'losses': [3.0, late]}))\n")
    race = [sys.executable, str(SCRIPTS / "_gpu_proof.py"), "race", "--budget", "60", "--", sys.executable, str(fake)]
    differs = json.loads(subprocess.run(race, capture_output=True, text=True, timeout=120).stdout)
    assert differs["status"] == "failed" and differs["losses_bit_identical"] is False
    assert differs["first_difference"]["step"] == 1
    same = json.loads(subprocess.run(race, capture_output=True, text=True, timeout=120,
                                     env={**os.environ, "SAME": "1"}).stdout)
    assert same["status"] == "passed" and same["losses_bit_identical"]
    missing = [sys.executable, str(SCRIPTS / "_gpu_proof.py"), "race", "--budget", "9", "--", sys.executable,
               "scripts/no_such_bench.py"]
    assert json.loads(subprocess.run(missing, capture_output=True, text=True, timeout=60).stdout)["status"] == "missing"


_BROKEN_KERNEL = """
import json, sys
sys.path.insert(0, {scripts!r})
import torch
import bench_kernels as bk
from outcore.kernels import stochastic_round_triton as srt
real = srt.stochastic_round_triton_
def off_by_one_bit(out, x, key, offset):  # a kernel that breaks its promise in one element
    real(out, x, key, offset)
    out.view(torch.int16)[7] ^= 1
srt.stochastic_round_triton_ = off_by_one_bit
dev = bk.resolve("cpu")
c = bk.Ctx(dev, "triton", 4096 * 3 + 5, bk.LCE_DRY, 1, 0)
print(json.dumps({{"broken": bk.bench_stochastic_round(c)["status"],
                   "real": (setattr(srt, "stochastic_round_triton_", real),
                            bk.bench_stochastic_round(c))[1]["status"]}}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_bench_catches_a_broken_kernel():
    """bench_kernels' bit-identity check fails a kernel one bit off (Triton's interpreter, on the CPU)."""
    out = subprocess.run([sys.executable, "-c", _BROKEN_KERNEL.format(scripts=str(SCRIPTS))], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"broken": "failed", "real": "ok"}
