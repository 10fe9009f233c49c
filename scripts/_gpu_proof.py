"""The parts of scripts/gpu_proof.sh that are better written in Python.

Subcommands that print one JSON object on stdout (a stage of the proof; the shell sends it to
the stage's file):

  env       versions, GPU, driver, compilers, libaio, disk, RAM, CPU and its ISA
  tests     the gpu-marked tests and the equivalence suite under pytest (junit XML per suite),
            summarized: passed / failed / skipped counts, failing test ids, skip reasons
  ds-ops    JIT-build DeepSpeed's cpu_adam and async_io ops (the offloaded peers need them)
  race      scripts/bench_gpu_step.py twice, with CUDA_LAUNCH_BLOCKING=1 and without: the losses
            must be equal bit for bit (a missing wait between streams shows up as a difference)

Subcommands that keep the books (no stdout JSON):

  finish    a stage ended: make sure its JSON exists and parses (else write why), append its
            record to stages.jsonl, rewrite summary.json, print the stage's one-line summary
  merge     peers_<shape>.json files -> peers.json

Status words, everywhere: passed (ran, every check held), partial (some parts ran and held,
the others were skipped with a reason), failed, skipped (nothing ran: the reason says why),
missing (the tool is not in this tree), timeout (the stage's time ran out; what finished is
kept), not_run (the proof's total budget was spent before it). A skip is never a pass.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from outcore.cli.jsonout import emit_json, json_stdout

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ("passed", "partial", "failed", "skipped", "missing", "timeout", "not_run", "error")
BAD = ("failed", "timeout", "error")


def _run(cmd: list[str], timeout: float = 10) -> str | None:
    """A tool's output (stdout, else stderr), or None where the tool is absent or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout or out.stderr).strip() or None


def _line(text: str | None, i: int) -> str | None:
    lines = (text or "").splitlines()
    return lines[i] if lines else None


# ---------------------------------------------------------------------------------
# env
# ---------------------------------------------------------------------------------
PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "safetensors", "numpy", "torchao", "deepspeed",
            "bitsandbytes", "gguf", "pydantic", "pytest", "xxhash", "psutil", "outcore")
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def source_identity() -> dict[str, Any]:
    """Which outcore this is: its git commit where .git is there, and a digest of its sources
    (the GPU machine gets a copy of the working tree, possibly without .git)."""
    rev = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    files = sorted(p for ext in ("py", "sh", "cpp", "h", "toml") for p in ROOT.rglob(f"*.{ext}")
                   if not any(part in (".whl", "runs", "build", "__pycache__", ".git") or part.endswith(".egg-info")
                              for part in p.relative_to(ROOT).parts))
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return {"path": str(ROOT), "git_rev": rev if rev and re.fullmatch(r"[0-9a-f]{40}", rev) else None,
            "git_dirty": None if dirty is None or not rev else bool(dirty), "source_sha256": digest.hexdigest(),
            "source_files": len(files)}


def cmd_env(args) -> dict[str, Any]:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions.update(python=sys.version.split()[0], cuda=torch.version.cuda, cudnn=(
        torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None))
    gpu = None
    if torch.cuda.is_available():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        gpu = [{"name": p.name, "total_memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count} for p in props]
    flags: set[str] = set()
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import ctypes.util

    import psutil

    from _accel import filesystem

    vm = psutil.virtual_memory()
    disks = {}
    for path in dict.fromkeys([args.out_dir, "/tmp", args.nvme_dir, str(ROOT)]):
        if path and os.path.isdir(path):
            du = shutil.disk_usage(path)
            disks[path] = {"free_bytes": du.free, "total_bytes": du.total, **filesystem(path)}
    sim = importlib.util.find_spec("outcore.offload.simdevice") is not None if importlib.util.find_spec(
        "outcore") else False
    return {
        "status": "passed", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": platform.node(), "dry_run": args.dry_run, "device_requested": args.device,
        "python_executable": sys.executable, "versions": versions, "outcore": source_identity(),
        "gpu": gpu, "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "nvidia_smi": _run(["nvidia-smi", "-L"]),
        "nvcc": _line(_run(["nvcc", "--version"]), -1), "gcc": _line(_run(["gcc", "--version"]), 0),
        "ninja": _run(["ninja", "--version"]),
        "libaio": {"library": ctypes.util.find_library("aio"), "header": os.path.exists("/usr/include/libaio.h"),
                   "carried_prefix": os.environ.get("PROOF_LIBAIO_PREFIX") or None},
        "simulated_accelerator_module": sim,
        "disk": disks, "ram": {"total_bytes": vm.total, "available_bytes": vm.available},
        "cpu": {"model": model, "cores": os.cpu_count(), "isa": sorted(flags & set(ISA_FLAGS)),
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OUTCORE_TEST_DEVICE", "TORCH_EXTENSIONS_DIR",
                                               "PYTHONPATH", "TRITON_INTERPRET")},
    }


# ---------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------
# The equivalence suite: out of core == in memory, bit for bit (docs/architecture.md), and ours ==
# the references. On a GPU each runs on the device the lead's OUTCORE_TEST_DEVICE option picks.
EQUIVALENCE = ("tests/offload/test_device_path.py", "tests/offload/engine/test_engine.py",
               "tests/offload/engine/test_engine_mixed.py",
               "tests/offload/engine/test_engine_optimizers.py", "tests/offload/engine/test_engine_lean.py",
               "tests/offload/engine/test_engine_pieces.py", "tests/offload/engine/test_engine_lora.py",
               "tests/offload/engine/test_tied_embedding.py", "tests/optim/test_reference_equivalence.py")
# a device-parametrized one, so the dry run's `-k sim` selects it
EQUIVALENCE_DRY = ("tests/offload/engine/test_engine.py::test_checkpoint_resume_and_export",)


def gpu_test_files() -> list[str]:
    """Every test file with a ``gpu``-marked test (collected alone: a file the GPU image cannot
    import elsewhere in tests/ must not stop the collection)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if re.search(r"mark\.gpu\b", p.read_text(errors="replace")))


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts, failing test ids (with their message's first line) and skip reasons of a junit file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skips = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = "::".join(x for x in (case.get("classname"), case.get("name")) if x)  # a collection error: no class
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            counts["failed" if tag == "failure" else "errors"] += 1
            msg = (kinds[tag].get("message") or kinds[tag].text or "").strip().splitlines()
            failed.append({"id": tid, "kind": tag, "message": (msg[0] if msg else "")[:300]})
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = (kinds["skipped"].get("message") or "").strip()[:200]
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failed": failed, "skipped_reasons": skips}


def run_pytest(targets: list[str], extra: list[str], xml: Path, timeout: float) -> dict[str, Any]:
    """pytest on ``targets`` with a junit report; at the timeout SIGINT, so pytest still writes it
    (the caller keeps 25 s of its stage for that: 10 s of grace, then SIGKILL)."""
    # a file that cannot be imported there is an error in the report, and the other files still run
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junit-xml={xml}", *extra, *targets]
    if importlib.util.find_spec("pytest_timeout"):  # a hung test (a stuck collective) costs one test, not the suite
        cmd.append(f"--timeout={max(30, int(timeout / 2))}")
    xml.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        timed_out = True
        os.killpg(proc.pid, signal.SIGINT)  # pytest ends the session and writes the junit file
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        if isinstance(exc, KeyboardInterrupt):
            raise
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "exit_code": rc, "timed_out": timed_out,
                           "seconds": time.perf_counter() - t0, "junit": xml.name}
    if xml.exists():
        out.update(junit_summary(xml))
    else:
        out.update(counts=None, failed=[], skipped_reasons={},
                   error=f"no junit report (pytest exit {rc}{', timed out' if timed_out else ''})")
    out["status"] = _suite_status(out)
    return out


def _suite_status(s: dict[str, Any]) -> str:
    c = s.get("counts")
    if s["timed_out"]:
        return "timeout"
    if c is None or c["failed"] or c["errors"] or s["exit_code"] not in (0, 5):  # 5: nothing collected
        return "failed"
    if c["passed"] and not c["skipped"]:
        return "passed"
    return "partial" if c["passed"] else "skipped"


def worst(statuses: list[str]) -> str:
    """One status for several parts: any failure fails; all passed passes; some passed is partial."""
    for bad in ("failed", "error", "timeout"):
        if bad in statuses:
            return bad
    if statuses and all(s == "passed" for s in statuses):
        return "passed"
    if any(s in ("passed", "partial") for s in statuses):
        return "partial"
    return "skipped" if statuses else "not_run"


def cmd_tests(args) -> dict[str, Any]:
    work = Path(args.work)
    honoured = "OUTCORE_TEST_DEVICE" in (ROOT / "tests" / "conftest.py").read_text()
    report: dict[str, Any] = {
        "device": os.environ.get("OUTCORE_TEST_DEVICE"), "device_option_honoured": honoured,
        "note": None if honoured else ("tests/conftest.py does not read OUTCORE_TEST_DEVICE yet: the equivalence "
                                       "tests ran on the CPU; only the gpu-marked tests used the GPU"),
        "suites": {}}
    deadline = time.perf_counter() + args.budget
    gpu_files = gpu_test_files()
    equiv = list(EQUIVALENCE_DRY if args.dry_run else EQUIVALENCE)
    # the equivalence suite's device-parametrized tests on the device (their ids name it); the
    # rest of those files checks the CPU, which CI does
    device = os.environ.get("OUTCORE_TEST_DEVICE")
    only = ["-k", device] if device and device != "cpu" else []
    share = args.gpu_share if args.gpu_share is not None else 0.6 if args.dry_run else 0.4
    plan = [("gpu", gpu_files, ["-m", "gpu", "--slow=all"], work / "tests_gpu.xml", share),
            ("equivalence", equiv, ["--slow=ci", *only], work / "tests_equiv.xml", 1.0)]
    try:
        for name, targets, extra, xml, share in plan:
            left = deadline - time.perf_counter()
            report["suites"][name] = run_pytest(targets, extra, xml, left * share)
    except KeyboardInterrupt:
        for name, *_ in plan:
            report["suites"].setdefault(name, {"status": "not_run", "reason": "interrupted (stage timeout)"})
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for s in report["suites"].values():
        for k in totals:
            totals[k] += (s.get("counts") or {}).get(k, 0)
    report["counts"] = totals
    report["failed"] = [f["id"] for s in report["suites"].values() for f in s.get("failed", [])]
    report["status"] = worst([s["status"] for s in report["suites"].values()])
    return report


# ---------------------------------------------------------------------------------
# ds-ops
# ---------------------------------------------------------------------------------
def cmd_ds_ops(args) -> dict[str, Any]:
    if importlib.util.find_spec("deepspeed") is None:
        return {"status": "skipped", "reason": "deepspeed is not installed (bash scripts/gpu_wheels.sh builds a "
                                               "wheel; carry .whl/)"}
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from bench_peers import build_deepspeed_op

    t0 = time.perf_counter()
    ops = {op: build_deepspeed_op(builder) for op, builder in (("cpu_adam", "CPUAdamBuilder"),
                                                               ("async_io", "AsyncIOBuilder"))}
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    states = [o["status"] for o in ops.values()]
    status = ("passed" if all(s == "built" for s in states) else "failed" if "failed" in states and
              "built" not in states else "partial" if "built" in states else "skipped")
    return {"status": status, "deepspeed": deepspeed.__version__, "accelerator": get_accelerator()._name,
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"), "ops": ops,
            "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------
# race
# ---------------------------------------------------------------------------------
def cmd_race(args) -> dict[str, Any]:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    script = next((c for c in cmd if c.endswith(".py")), None)
    if script and not (ROOT / script).exists() and not Path(script).exists():
        return {"status": "missing", "reason": f"{script} is not in this tree"}
    runs: dict[str, Any] = {}
    deadline = time.perf_counter() + args.budget
    # launch-blocking is the slower run: it gets more of the budget
    for name, blocking, share in (("default", False, 0.4), ("launch_blocking", True, 1.0)):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
        if blocking:
            env["CUDA_LAUNCH_BLOCKING"] = "1"  # every launch synchronous: no overlap between streams
        timeout = max(1.0, (deadline - time.perf_counter()) * share)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            runs[name] = {"status": "timeout", "seconds": time.perf_counter() - t0}
            continue
        sys.stderr.write(proc.stderr[-20000:])
        run: dict[str, Any] = {"exit_code": proc.returncode, "seconds": time.perf_counter() - t0}
        try:
            data = json.loads(proc.stdout)
            run["losses"] = data.get("losses")
            run["digests"] = {k: v for k, v in data.items() if "digest" in k}
            run["status"] = "passed" if proc.returncode == 0 and isinstance(run["losses"], list) else "failed"
            if not isinstance(run["losses"], list):
                run["error"] = "its JSON has no 'losses' list"
        except json.JSONDecodeError:
            run.update(status="failed", error="stdout is not one JSON object: " + proc.stdout.strip()[:200])
        runs[name] = run
    out: dict[str, Any] = {"command": " ".join(cmd), "runs": runs}
    a, b = runs.get("default", {}), runs.get("launch_blocking", {})
    if a.get("status") != "passed" or b.get("status") != "passed":
        out["status"] = "timeout" if "timeout" in (a.get("status"), b.get("status")) else "failed"
        out["reason"] = "a run did not finish with losses; nothing to compare"
        return out
    la, lb = a["losses"], b["losses"]
    same = len(la) == len(lb) and all(float(x).hex() == float(y).hex() for x, y in zip(la, lb))
    out["losses_bit_identical"] = same
    out["losses_hex"] = {"default": [float(x).hex() for x in la], "launch_blocking": [float(x).hex() for x in lb]}
    if not same:
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if float(x).hex() != float(y).hex()), min(len(la), len(lb)))
        out["first_difference"] = {"step": i, "default": la[i] if i < len(la) else None,
                                   "launch_blocking": lb[i] if i < len(lb) else None}
    digests_same = a["digests"] == b["digests"]
    out["digests_equal"] = digests_same if a["digests"] or b["digests"] else None
    out["status"] = "passed" if same and digests_same else "failed"
    return out


# ---------------------------------------------------------------------------------
# finish / merge: the books
# ---------------------------------------------------------------------------------
def stage_status(data: dict[str, Any], rc: int) -> str:
    if rc in (124, 137):  # timeout(1) ran out (the tool may have kept partial results)
        return "timeout"
    status = data.get("status")
    if status in ("ok",):
        return "passed"
    if status == "interrupted":
        return "timeout"
    if status in STATUSES:
        return status
    return "passed" if rc == 0 else "failed"


def headline(name: str, data: dict[str, Any]) -> str:
    """A few words on what a stage found, for its one-line summary."""
    if data.get("reason") and data.get("status") in ("skipped", "missing", "not_run", "error", "timeout"):
        return str(data["reason"])[:140]
    if name == "tests" and data.get("counts"):
        c = data["counts"]
        return f"{c['passed']} passed, {c['failed'] + c['errors']} failed, {c['skipped']} skipped"
    if name == "kernels" and data.get("kernels"):
        return ", ".join(f"{k} {v.get('status')}" for k, v in data["kernels"].items())
    if name.startswith("peers") and data.get("peers"):
        return ", ".join(f"{k} {v.get('status')}" for k, v in data["peers"].items())
    if name.startswith("long") and data.get("longest"):  # the plan's longest context, and what ran
        peak = data.get("gpu_peak_reserved_bytes")
        return (f"plan's longest {data['longest']['seq_len']} tokens ({data['activations']}); ran {data['seq_len']}"
                + (f", GPU peak {peak / 2**30:.1f} of {data['device_cap_bytes'] / 2**30:.0f} GiB" if peak else ""))
    if name == "race" and "losses_bit_identical" in data:
        return f"losses bit-identical: {data['losses_bit_identical']}"
    if name == "ds_ops" and data.get("ops"):
        return ", ".join(f"{k} {v['status']}" for k, v in data["ops"].items())
    if name == "setup" and data.get("wheels"):  # the first clause of each: "installed into /tmp/site", ...
        return f"wheels {data['wheels'].split(':')[0]}; libaio {data.get('libaio', '').split(':')[0]}"
    if name == "env" and data.get("gpu"):
        return f"{data['gpu'][0]['name']}, torch {data['versions'].get('torch')}"
    if name == "env":
        return f"no GPU, torch {data.get('versions', {}).get('torch')}"
    return ""


def cmd_finish(args) -> None:
    work = Path(args.work)
    path = work / args.file
    data: dict[str, Any]
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        log = work / "logs" / f"{args.name}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
        status = ("not_run" if args.rc == 125 else "timeout" if args.rc in (124, 137) else "error")
        data = {"status": status, "reason": args.reason or (
            f"timed out after {args.seconds:.0f} s before writing its JSON" if status == "timeout" else
            f"exit {args.rc} without a JSON object on stdout ({type(exc).__name__})"),
                "exit_code": args.rc, "log_tail": tail}
        path.write_text(json.dumps(data, indent=1) + "\n")
    if args.reason and data.get("status") in ("missing", "not_run") and not data.get("reason"):
        data["reason"] = args.reason
    status = stage_status(data, args.rc)
    record = {"stage": args.name, "status": status, "seconds": round(args.seconds, 2), "file": args.file,
              "exit_code": args.rc, "summary": headline(args.name, data)}
    with open(work / "stages.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    write_summary(work, args)
    print(f"[gpu_proof] {args.name:<11} {status:<8} {args.seconds:7.1f}s  {args.file:<16} {record['summary']}",
          flush=True)


def cmd_summary(args) -> int:
    """The final summary; prints its status and returns 1 where a stage failed, errored or timed out."""
    summary = write_summary(Path(args.work), args, final=True)
    print(f"[gpu_proof] {'summary':<11} {summary['status']:<8} {args.elapsed:7.1f}s  summary.json     "
          + ", ".join(f"{n} {k}" for k, n in summary["counts"].items()), flush=True)
    return 1 if summary["status"] in BAD else 0


def write_summary(work: Path, args, final: bool = False) -> dict[str, Any]:
    path = work / "stages.jsonl"
    stages = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    counts: dict[str, int] = {}
    for s in stages:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    summary = {
        "status": "failed" if any(s["status"] in BAD for s in stages) else worst([s["status"] for s in stages]
                                                                                  if stages else []),
        "complete": final, "dry_run": args.dry_run, "device": args.device,
        "budget_s": args.budget, "elapsed_s": round(args.elapsed, 1), "counts": counts, "stages": stages,
        "note": "a stage counts as passed only when everything it ran held; skipped, missing and not_run "
                "stages are not passes (their JSON says why)"}
    _write_json(work / "summary.json", summary)
    if args.publish and Path(args.publish).resolve() != work.resolve():
        publish(work, Path(args.publish), summary)
    return summary


def publish(work: Path, dest: Path, summary: dict[str, Any]) -> None:
    """Compact output (the device tool returns at most 8 files from $OUT): summary.json with
    every stage's JSON inside, and gpu_proof.tar.gz with every file (junit XML, logs)."""
    dest.mkdir(parents=True, exist_ok=True)
    results = {}
    for s in summary["stages"]:
        try:
            results[s["stage"]] = json.loads((work / s["file"]).read_text())
        except (OSError, ValueError):
            results[s["stage"]] = None
    _write_json(dest / "summary.json", {**summary, "results": results})
    tmp = dest / "gpu_proof.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="gpu_proof")
    tmp.replace(dest / "gpu_proof.tar.gz")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)  # a reader (or a kill) never sees half a file


def cmd_merge(args) -> dict[str, Any]:
    shapes = {}
    for f in args.files:
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        shapes[Path(f).stem.removeprefix("peers_")] = data  # the stage's shape (a dry run's is tiny)
    status = worst([stage_status(d, 0) for d in shapes.values()]) if shapes else "not_run"
    return {"status": status, "shapes": shapes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--device", default="cuda")
    e.add_argument("--dry-run", action="store_true")
    e.add_argument("--out-dir", default="")
    e.add_argument("--nvme-dir", default="/tmp")
    t = sub.add_parser("tests")
    t.add_argument("--work", required=True)
    t.add_argument("--budget", type=float, required=True, help="seconds for both suites")
    t.add_argument("--gpu-share", type=float, default=None,
                   help="share of the budget for the gpu-marked suite (default 0.4; a dry run's, which only "
                        "collects and skips it, 0.6)")
    t.add_argument("--dry-run", action="store_true")
    sub.add_parser("ds-ops")
    r = sub.add_parser("race")
    r.add_argument("--budget", type=float, required=True)
    r.add_argument("command", nargs=argparse.REMAINDER)
    f = sub.add_parser("finish")
    for name in ("--name", "--file"):
        f.add_argument(name, required=True)
    f.add_argument("--rc", type=int, required=True)
    f.add_argument("--seconds", type=float, required=True)
    f.add_argument("--reason", default="")
    sm = sub.add_parser("summary", help="the final summary.json (complete: true)")
    for q in (f, sm):
        q.add_argument("--work", required=True)
        q.add_argument("--publish", default="", help="compact output folder (summary.json + gpu_proof.tar.gz)")
        q.add_argument("--dry-run", action="store_true")
        q.add_argument("--device", default="")
        q.add_argument("--budget", type=float, default=0)
        q.add_argument("--elapsed", type=float, default=0)
    m = sub.add_parser("merge")
    m.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "finish":
        cmd_finish(args)
        return 0
    if args.cmd == "summary":
        return cmd_summary(args)
    contextlib.ExitStack().enter_context(json_stdout())  # library chatter (DeepSpeed's) to stderr, to the end
    handler = {"env": cmd_env, "tests": cmd_tests, "ds-ops": cmd_ds_ops, "race": cmd_race, "merge": cmd_merge}
    emit_json(json.dumps(handler[args.cmd](args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
