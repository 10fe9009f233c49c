#!/usr/bin/env python
"""The peers a user would pick instead of outcore, trained side by side on one device.

Same model (a Llama shape from ``LlamaConfig``, random init, seed 0, built in fp32 on the
device), same synthetic token batches, same AdamW hyper-parameters, bf16 compute, and on CUDA
the same GPU memory cap (``--gpu-mem-gib``, default 24: a consumer card, set with
``torch.cuda.set_per_process_memory_fraction`` before the first allocation). Each peer runs
in its own process with a timeout, so one that crashes, hangs or runs out of memory does not
stop the rest, and one's peaks cannot hide another's.

  peer                  what it is (as its docs advise for one GPU)
  plain                 everything in GPU memory: fp32 master weights, bf16 autocast, fused AdamW
                        (16 B/param before activations; skipped where that exceeds the cap)
  plain_bf16            everything in GPU memory in pure bf16 (weights and AdamW state, no fp32
                        master: 8 B/param; different numerics from the others, said in its row)
  fsdp2_cpu_offload     FSDP2 ``fully_shard`` per block and at the root on a one-rank group
                        (NCCL; gloo on a CPU) with ``CPUOffloadPolicy(pin_memory=True)`` and
                        ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``: fp32 shards and the
                        AdamW step on the CPU
  torchao_cpu_offload   ``torchao.optim.CPUOffloadOptimizer`` (fused CPU AdamW,
                        ``offload_gradients=True``): fp32 weights on the GPU, state on the CPU
  deepspeed_zero2_cpu   DeepSpeed ZeRO-Offload: stage 2, optimizer state and step on the CPU
                        (its cpu_adam op, JIT-built), bf16
  deepspeed_zero3_cpu   ZeRO-3 with parameters and optimizer offloaded to the CPU
  deepspeed_zero3_nvme  ZeRO-Infinity: parameters and optimizer on NVMe (its async_io op, which
                        needs libaio) under ``--nvme-dir``

Reported per peer: median step time (min, max, every step) after the warm-up, tokens/s, the
GPU's peak (``torch.cuda.max_memory_allocated``, and reserved) over warm-up and timed steps,
the host's peak RSS over the same steps (``VmHWM`` after a reset; pinned buffers included),
model TFLOPS = 6 x parameters x tokens / median step (and with causal attention's
6 x layers x hidden x seq^2 x batch), the losses (the first one, before any update, must
agree across peers: same weights, same data), or the reason it did not run.

Usage:
  python scripts/bench_peers.py --device cuda --shape 1.7b --json
  python scripts/bench_peers.py --device cuda --shape 8b --blocks 4 --json
  python scripts/bench_peers.py --device cpu --shape tiny --dry-run     # the harness, in seconds
"""
from __future__ import annotations

import argparse
import importlib.util
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from outcore.cli.jsonout import emit_json, json_stdout

PEERS = ("plain", "fsdp2_cpu_offload", "torchao_cpu_offload", "deepspeed_zero3_cpu", "deepspeed_zero3_nvme",
         "deepspeed_zero2_cpu", "plain_bf16")  # in the order they run: the budget may end the list
SHAPES = {"tiny": None, "1.7b": "smollm2-1.7b", "8b": "llama3-8b"}  # -> bench_big.SHAPES
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
#: bytes per parameter held on the GPU by the in-memory peers (weights + grads + AdamW moments)
IN_MEMORY_BYTES = {"plain": 16, "plain_bf16": 8}
MIN_PEER_S = 20  # a peer is not started with less of the budget left
T_START = time.perf_counter()  # --budget-s counts from here: imports and the parameter count included


# ---------------------------------------------------------------------------------
# The model and the data every peer shares
# ---------------------------------------------------------------------------------
def llama_config(shape: str, blocks: int):
    from transformers import LlamaConfig

    if shape == "tiny":
        dims = TINY
    else:
        from bench_big import SHAPES as BIG  # one definition of the 1.7B and 8B shapes

        dims = BIG[SHAPES[shape]]
    dims = {**dims, "num_hidden_layers": blocks or dims["num_hidden_layers"]}
    return LlamaConfig(**dims, bos_token_id=1, eos_token_id=2)


def count_params(cfg) -> int:
    """Parameters of the model (a tied embedding once), from a meta-device build: no memory."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def batches(n: int, batch: int, seq: int, vocab: int, seed: int) -> list:
    """``n`` synthetic token batches [batch, seq], the same for every peer (CPU generator)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------
# The peers: each returns (step(ids) -> loss, close(), what it is) or a reason it cannot run
# ---------------------------------------------------------------------------------
def setup_plain(model, dev, args, bf16_weights: bool):
    import torch

    fused = dev.kind == "cuda"
    if bf16_weights:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=fused, **HYPER)
    autocast = not bf16_weights and dev.kind != "sim"  # (the simulated accelerator has no autocast)

    def step(ids):
        with torch.autocast(dev.torch.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    what = {"precision": "bf16 weights and AdamW state, no fp32 master" if bf16_weights else
            "fp32 master weights, bf16 autocast" if autocast else "fp32",
            "optimizer": f"torch.optim.AdamW(fused={fused}) on the device",
            "offload": "none"}
    return step, (lambda: None), what


def setup_fsdp2(model, dev, args):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    backend = "nccl" if dev.kind == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp}
    if dev.kind == "cuda":  # on a CPU there is nothing to offload from: FSDP2 alone, for the harness
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:  # one all-gather per block, as FSDP2's docs shard a transformer
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)  # on the CPU shards: the default implementation

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    what = {"precision": "fp32 sharded master weights, bf16 compute (MixedPrecisionPolicy), fp32 reduce",
            "optimizer": "torch.optim.AdamW (default implementation) on the CPU shards" if "offload_policy" in kw
            else "torch.optim.AdamW on the device",
            "offload": "CPUOffloadPolicy(pin_memory=True)" if "offload_policy" in kw else
            f"none (device {dev.kind}: nothing to offload from)", "process_group": f"{backend}, 1 rank"}
    return step, dist.destroy_process_group, what


def setup_torchao(model, dev, args):
    import torch

    if dev.kind != "cuda":
        return "torchao's CPUOffloadOptimizer offloads from a CUDA (or XPU) device; this run is on " + dev.kind
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (bash scripts/gpu_wheels.sh carries a wheel)"
    from torchao.optim import CPUOffloadOptimizer

    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, **HYPER)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    import torchao

    what = {"precision": "fp32 master weights on the GPU, bf16 autocast",
            "optimizer": "torchao CPUOffloadOptimizer(torch.optim.AdamW, fused CPU step, offload_gradients=True)",
            "offload": "optimizer state, gradients and step on the CPU", "torchao": torchao.__version__}
    return step, (lambda: None), what


def deepspeed_config(stage: int, device: str, nvme: str | None, batch: int, largest: int,
                     pin: bool) -> dict[str, Any]:
    """ZeRO-2/3 with the optimizer (and at stage 3 the parameters) offloaded to ``device``."""
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": device, "pin_memory": pin}}
    if stage == 3:
        zero["offload_param"] = {"device": device, "pin_memory": pin}
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=int(1e9))
    if device == "nvme":
        # a buffer must hold the largest parameter (an 8B embedding: 525M elements)
        zero["offload_param"].update(nvme_path=nvme, buffer_count=5, buffer_size=max(int(1e8), largest),
                                     max_in_cpu=int(1e9))
        zero["offload_optimizer"].update(nvme_path=nvme)
    lr, betas, eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": wd}},
        "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_deepspeed_op(name: str) -> dict[str, Any]:
    """JIT-build one DeepSpeed op (or load it from the extensions cache, where a build is reused).

    Args:
        name: the builder's class name (``CPUAdamBuilder``, ``AsyncIOBuilder``).

    Returns:
        ``{"status": "built", "seconds": s}``, ``{"status": "not_compatible", "reason": ...}`` (the op
        cannot build on this machine: for async_io, no libaio) or ``{"status": "failed", "error": ...}``.
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is None:
        return {"status": "not_compatible", "reason": f"DeepSpeed has no {name} for its {get_accelerator()._name} "
                                                      "accelerator"}
    if not builder.is_compatible(verbose=False):
        why = " ".join(str(x) for x in getattr(builder, "error_log", None) or []) or "is_compatible() is False"
        hint = " (async_io needs libaio's headers and library)" if name == "AsyncIOBuilder" else ""
        return {"status": "not_compatible", "reason": f"DeepSpeed's {builder.NAME} op cannot build here{hint}: {why}"}
    t0 = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed JIT build is a finding, reported in one line
        return {"status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                "seconds": time.perf_counter() - t0}
    return {"status": "built", "seconds": time.perf_counter() - t0}


def build_deepspeed_ops(nvme: bool) -> dict[str, Any] | str:
    """The ops an offloaded DeepSpeed peer needs: seconds per op, or why one cannot be had here."""
    built: dict[str, Any] = {}
    for name in ("CPUAdamBuilder", *(("AsyncIOBuilder",) if nvme else ())):
        op = build_deepspeed_op(name)
        if op["status"] != "built":
            return op.get("reason") or f"DeepSpeed's {name} did not build: {op['error']}"
        built[name] = round(op["seconds"], 2)
    return built


def setup_deepspeed(model, dev, args, stage: int, device: str):
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (bash scripts/gpu_wheels.sh builds a wheel; scripts/setup.sh does not)"
    if dev.kind not in ("cuda", "cpu"):
        return f"DeepSpeed runs on cuda or cpu here, not on {dev.kind}"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    if dev.kind == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed's first import
    import deepspeed

    ops = build_deepspeed_ops(nvme=device == "nvme")
    if isinstance(ops, str):
        return ops
    swap = tempfile.mkdtemp(prefix="bench_peers_ds_", dir=args.nvme_dir) if device == "nvme" else None
    largest = max(p.numel() for p in model.parameters())
    deepspeed.init_distributed(dist_backend="nccl" if dev.kind == "cuda" else "gloo")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config=deepspeed_config(stage, device, swap, args.batch, largest, pin=dev.kind == "cuda"))

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def close():
        if swap:
            shutil.rmtree(swap, ignore_errors=True)

    where = {"cpu": "the CPU", "nvme": f"NVMe ({args.nvme_dir})"}[device]
    what = {"precision": "bf16 weights, fp32 master weights in the optimizer (DeepSpeed bf16)",
            "optimizer": "DeepSpeedCPUAdam (AdamW mode)" if dev.kind == "cuda" else "DeepSpeed's CPU Adam",
            "offload": f"ZeRO-{stage}: optimizer" + (" and parameters" if stage == 3 else "") + f" on {where}",
            "deepspeed": deepspeed.__version__, "ops_build_s": ops}
    return step, close, what


def setup_peer(peer: str, model, dev, args):
    if peer in ("plain", "plain_bf16"):
        return setup_plain(model, dev, args, bf16_weights=peer == "plain_bf16")
    if peer == "fsdp2_cpu_offload":
        return setup_fsdp2(model, dev, args)
    if peer == "torchao_cpu_offload":
        return setup_torchao(model, dev, args)
    stage, device = {"deepspeed_zero2_cpu": (2, "cpu"), "deepspeed_zero3_cpu": (3, "cpu"),
                     "deepspeed_zero3_nvme": (3, "nvme")}[peer]
    return setup_deepspeed(model, dev, args, stage, device)


# ---------------------------------------------------------------------------------
# One peer, in this (child) process
# ---------------------------------------------------------------------------------
def child_main(args) -> dict[str, Any]:
    import statistics

    import torch

    from _accel import cap_gpu_memory, peak_memory, reset_peak_memory, resolve, synchronize
    from _measure import reset_peak_rss
    from _rss_trace import status_bytes

    dev = resolve(args.device)
    result: dict[str, Any] = {"device": None}
    cap = cap_gpu_memory(dev, args.gpu_mem_gib)  # before the first allocation
    result["device"] = dev.describe()
    result["gpu_cap"] = cap
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = llama_config(args.shape, args.blocks)
    data = [b.to(dev.torch) for b in batches(args.warmup + args.steps, args.batch, args.seq, cfg.vocab_size,
                                             args.seed)]
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(dev.torch):  # the same init on the same device for every peer
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    built = setup_peer(args.child, model, dev, args)
    if isinstance(built, str):
        return {**result, "status": "skipped", "reason": built}
    step, close, what = built
    result.update(what, setup_s=time.perf_counter() - t0, parameters=n_params,
                  attn_implementation=getattr(cfg, "_attn_implementation", None))
    synchronize(dev)
    reset_peak_memory(dev)  # peaks cover the warm-up (first-step allocations) and the timed steps
    rss_reset = reset_peak_rss()
    losses, times = [], []
    try:
        for i, ids in enumerate(data):
            t = time.perf_counter()
            loss = step(ids)
            synchronize(dev)  # the optimizer's kernels are queued after the loss: wait for all of it
            dt = time.perf_counter() - t
            losses.append(float(loss))
            if i >= args.warmup:
                times.append(dt)
    finally:
        close()
    tokens = args.batch * args.seq
    med = statistics.median(times)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    attn = 6 * layers * hidden * args.seq ** 2 * args.batch  # 12 L H S^2 per sequence, halved: causal
    result.update(
        status="ok", warmup=args.warmup, steps=args.steps, median_step_s=med, min_step_s=min(times),
        max_step_s=max(times), step_times_s=times, tokens_per_step=tokens, tokens_per_s=tokens / med,
        model_tflops=6 * n_params * tokens / med / 1e12,
        model_tflops_with_attention=(6 * n_params * tokens + attn) / med / 1e12,
        tflops_formula="6 x parameters x tokens / median step (with attention: + 6 x layers x hidden x seq^2 x "
                       "batch, causal)",
        losses=losses, gpu_peak_allocated_bytes=peak_memory(dev)["max_allocated_bytes"],
        gpu_peak_reserved_bytes=peak_memory(dev)["max_reserved_bytes"],
        host_peak_rss_bytes=status_bytes("VmHWM")["VmHWM"] if rss_reset else None,
        host_peak_rss_process_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return result


def run_child_main(args) -> int:
    """The child's entry: run one peer, write its result (or its error) to ``--result``."""
    try:
        result = child_main(args)
    except Exception as exc:  # noqa: BLE001 - the error line is the result
        oom = "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc).lower()
        traceback.print_exc()
        result = {"status": "oom" if oom else "failed",
                  "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:600]}
    Path(args.result).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------
# The parent: one child per peer, each with a timeout, within the budget
# ---------------------------------------------------------------------------------
def precheck(peer: str, args, n_params: int, kind: str) -> str | None:
    """Why ``peer`` cannot run here, known without starting it (saves a child's start-up)."""
    if peer == "torchao_cpu_offload" and kind != "cuda":
        return f"torchao's CPUOffloadOptimizer offloads from a CUDA device; this run is on {kind}"
    if peer == "torchao_cpu_offload" and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (bash scripts/gpu_wheels.sh carries a wheel)"
    if peer.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (bash scripts/gpu_wheels.sh builds a wheel)"
    if peer.startswith("deepspeed") and kind == "sim":
        return "DeepSpeed runs on cuda or cpu, not on the simulated accelerator"
    if peer.startswith("fsdp2") and kind == "sim":
        return "FSDP2 needs a process-group backend for the device (nccl, gloo); none for the simulated one"
    need = IN_MEMORY_BYTES.get(peer, 0) * n_params
    if kind == "cuda" and need and args.gpu_mem_gib and need > args.gpu_mem_gib * 2**30:
        return (f"does not fit: weights, gradients and AdamW moments alone need {IN_MEMORY_BYTES[peer]} B x "
                f"{n_params / 1e9:.2f}B parameters = {need / 2**30:.1f} GiB > the {args.gpu_mem_gib:g} GiB cap")
    return None


def device_kind(name: str) -> str:
    """What ``--device`` resolves to, without creating a CUDA context in this process (the
    children's GPU memory is capped and measured; the parent must hold none)."""
    import torch

    if name in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if name == "cuda":
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here")
    if name in ("auto", "sim"):
        from _accel import resolve

        return resolve(name).kind
    return "cpu"


def run_peer(peer: str, args, timeout: float) -> dict[str, Any]:
    """Run ``peer`` in a child process (its own session, so a timeout kills its compilers too)."""
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        result_file, log_file = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, __file__, "--child", peer, "--result", str(result_file), "--device", args.device,
               "--shape", args.shape, "--blocks", str(args.blocks), "--seq", str(args.seq), "--batch",
               str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
               "--gpu-mem-gib", str(args.gpu_mem_gib), "--nvme-dir", args.nvme_dir]
        t0, started = time.perf_counter(), time.time()
        with open(log_file, "w") as log:
            # unbuffered: a child killed at its timeout still leaves its last lines in the log
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            except KeyboardInterrupt:
                _kill(proc)
                raise
            if timed_out:
                _kill(proc)
                rc = proc.returncode
        wall = time.perf_counter() - t0
        _remove_swap_left_by(args.nvme_dir, started)
        text = log_file.read_text(errors="replace")
        sys.stderr.write(f"----- {peer} (exit {rc}, {wall:.1f} s) -----\n{text[-20000:]}\n")
        if timed_out:
            return {"status": "timeout", "reason": f"no result within {timeout:.0f} s", "wall_s": wall,
                    "log_tail": _tail(text)}
        if result_file.exists():
            return {**json.loads(result_file.read_text()), "wall_s": wall}
        return {"status": "failed", "error": f"exit {rc} without a result", "wall_s": wall, "log_tail": _tail(text)}


def _remove_swap_left_by(nvme_dir: str, started: float) -> None:
    """A ZeRO-Infinity child killed at its timeout leaves its swap (tens of GB): remove the swap
    folders made since it started (another run's, older, stay)."""
    for d in Path(nvme_dir).glob("bench_peers_ds_*"):
        try:
            if d.stat().st_mtime >= started - 1:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    clear_build_locks()


def clear_build_locks(prefixes: tuple[str, ...] = ("cpu_adam", "async_io", "pin_memory")) -> list[str]:
    """Remove the locks that op builds killed half-way left (a peer's or a stage's timeout): torch's
    extension loader waits on a lock forever. A lock counts as stale only when it is over a minute
    old and no process works in its build folder (ninja runs there), so a live build elsewhere on
    a shared machine keeps its lock.

    Args:
        prefixes: build folder names (``TORCH_EXTENSIONS_DIR/<py>_<cuda>/<name>``) to look in.

    Returns:
        The locks removed.
    """
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    busy = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            busy.add(os.path.realpath(os.readlink(proc / "cwd")))
        except OSError:
            pass
    removed = []
    for lock in (*root.glob("*/lock"), *root.glob("*/*/lock")):
        folder = os.path.realpath(lock.parent)
        try:
            stale = time.time() - lock.stat().st_mtime > 60 and folder not in busy
        except OSError:
            continue
        if lock.parent.name.startswith(prefixes) and stale:
            lock.unlink(missing_ok=True)
            removed.append(str(lock))
    return removed


def _tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:]


def overall(peers: dict[str, dict[str, Any]]) -> str:
    """passed: every peer measured; failed: one crashed or hung (a harness or peer bug);
    partial: some measured, the others skipped, out of memory or not run (findings, with reasons);
    skipped: none measured."""
    statuses = [p["status"] for p in peers.values()]
    if any(s in ("failed", "timeout") for s in statuses):
        return "failed"
    if statuses and all(s == "ok" for s in statuses):
        return "passed"
    return "partial" if "ok" in statuses else "skipped"


def first_loss_agreement(peers: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The first loss of every measured peer (before any update: same weights, same data) against
    the first measured one's; bf16 compute rounds differently per peer, so small gaps are expected."""
    firsts = {k: p["losses"][0] for k, p in peers.items() if p.get("status") == "ok" and p.get("losses")}
    if not firsts:
        return None
    ref_peer, ref = next(iter(firsts.items()))
    return {"reference_peer": ref_peer, "max_abs_diff": max(abs(v - ref) for v in firsts.values()),
            "first_losses": firsts}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "sim", "cpu"))
    p.add_argument("--shape", default="1.7b", choices=tuple(SHAPES))
    p.add_argument("--blocks", type=int, default=0, help="decoder blocks (0: all of the shape's)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per peer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocation, JIT, autotuning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-mem-gib", type=float, default=24.0, help="CUDA memory cap per peer (0: none)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset, run in this order")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per peer (start-up, JIT builds included)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="all peers together (0: none); a peer is not started with under 20 s left")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="ZeRO-Infinity's swap directory's parent")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, 1 warm-up + 2 steps, seq 32")
    p.add_argument("--json", action="store_true", help="print one JSON object (and nothing else) on stdout")
    p.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.seq, args.batch, args.steps, args.warmup = "tiny", 32, 2, 2, 1
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in args.peers if x not in PEERS]
    if bad:
        p.error(f"unknown peer {bad[0]!r}; choose from {', '.join(PEERS)}")
    if args.steps < 1 or args.warmup < 0 or args.seq < 2 or args.batch < 1:
        p.error("--steps >= 1, --warmup >= 0, --seq >= 2 and --batch >= 1 are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child_main(args)
    contextlib.ExitStack().enter_context(json_stdout(args.json))  # library chatter to stderr, to the end
    from _accel import filesystem

    kind = device_kind(args.device)
    cfg = llama_config(args.shape, args.blocks)
    n_params = count_params(cfg)
    report: dict[str, Any] = {
        "script": "bench_peers", "device_requested": args.device, "device_kind": kind, "dry_run": args.dry_run,
        "shape": args.shape, "blocks": cfg.num_hidden_layers, "parameters": n_params, "seq": args.seq,
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
        "gpu_mem_cap_gib": args.gpu_mem_gib if kind == "cuda" else None, "hyper": HYPER,
        "data": "synthetic token ids (uniform, seeded), the same batches for every peer",
        "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "nvme_dir": filesystem(args.nvme_dir),  # ZeRO-Infinity's swap: a disk, or the figures are not NVMe's
    }
    peers: dict[str, dict[str, Any]] = {}
    try:
        for peer in args.peers:
            why = precheck(peer, args, n_params, kind)
            if why:
                peers[peer] = {"status": "skipped", "reason": why}
                continue
            left = args.budget_s - (time.perf_counter() - T_START) if args.budget_s else args.timeout_s
            if left < MIN_PEER_S:
                peers[peer] = {"status": "not_run", "reason": f"the stage's {args.budget_s:g} s budget was spent"}
                continue
            print(f"[bench_peers] {args.shape} {peer} (timeout {min(left, args.timeout_s):.0f} s) ...",
                  file=sys.stderr, flush=True)
            peers[peer] = run_peer(peer, args, min(left, args.timeout_s))
            print(f"[bench_peers] {peer}: {peers[peer]['status']}", file=sys.stderr, flush=True)
        report["status"] = overall(peers)
    except KeyboardInterrupt:  # the proof's stage timeout: keep what finished
        report["status"] = "interrupted"
        for peer in args.peers:
            peers.setdefault(peer, {"status": "not_run", "reason": "interrupted (stage timeout)"})
    report["device"] = next((p["device"] for p in peers.values() if p.get("device")), None)
    report["peers"] = peers
    report["first_loss_agreement"] = first_loss_agreement(peers)
    if args.json:
        emit_json(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0 if report["status"] != "failed" else 1


def print_table(r: dict[str, Any]) -> None:
    gib = 2**30
    print(f"shape {r['shape']} ({r['blocks']} blocks, {r['parameters'] / 1e9:.2f}B parameters), seq {r['seq']} x "
          f"batch {r['batch']}, device {r['device_kind']}, cap {r['gpu_mem_cap_gib']} GiB, median of {r['steps']} "
          f"after {r['warmup']} warm-up")
    print(f"{'peer':<22}{'status':<9}{'s/step':>8}{'tok/s':>9}{'TFLOPS':>8}{'GPU peak':>10}{'host RSS':>10}  losses")
    for name, p in r["peers"].items():
        if p["status"] != "ok":
            print(f"{name:<22}{p['status']:<9}  {p.get('reason') or p.get('error') or ''}")
            continue
        gpu = p["gpu_peak_allocated_bytes"]
        rss = p["host_peak_rss_bytes"] or p["host_peak_rss_process_bytes"]
        print(f"{name:<22}{'ok':<9}{p['median_step_s']:>8.3f}{p['tokens_per_s']:>9.0f}{p['model_tflops']:>8.2f}"
              f"{(f'{gpu / gib:.1f}G' if gpu is not None else '-'):>10}{rss / gib:>9.1f}G  "
              + " ".join(f"{x:.4f}" for x in p["losses"]))
    print(f"overall: {r['status']}")


if __name__ == "__main__":
    sys.exit(main())
