"""``outcore plan``: the MemoryPlan of a run, printed before anything is loaded or trained.

The model is sized from its config alone (``outcore.planner.plan`` builds it on the
meta device), so planning a 70B model is as quick as a 135M one; the budgets come
from the hardware probe plus ``--device-mem`` / ``--host-mem``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelError
from .finetune import add_config_arguments, config_from_args, wants_longest
from .jsonout import emit_json

HELP = "show where a run's tensors would live and the expected step time"
DESCRIPTION = """\
Plan a fine-tuning run without running it: for each class of tensor (weights,
gradients, optimizer state, activations) the tier that holds it (DEVICE, HOST,
NVME), the prefetch depth, the largest micro-batch that fits, bytes per tier and
the expected step time split into compute and I/O. Lists every configuration it
considered (offload layout x activation policy): whether it fits, its estimated
step time and the bytes it writes to the SSD per step; 'auto' takes the fastest
that fits, or among those within 10% of it the one that writes least. Takes the
same options as 'outcore finetune'.

examples:
  outcore plan
  outcore plan --model ./llama-8b --offload nvme --device-mem 6GiB --host-mem 16GiB
  outcore plan --config run.yaml --json
  outcore plan --seq-len max --offload nvme     # the longest context these budgets train
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the plan options (the finetune config options plus output switches)."""
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--ranks", type=int, default=0, metavar="N",
                        help="plan one rank of N data-parallel ranks (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--no-measure", action="store_true",
                        help="do not measure disk and copy bandwidth (use fallback figures)")


def model_config(spec: str) -> Any:
    """The Hugging Face config of a model spec, read without loading any weights.

    Args:
        spec: ``"default"``, a local HF directory, a ``.gguf`` file or a hub id.

    Returns:
        A ``transformers.PretrainedConfig``.

    Raises:
        ModelError: the spec names nothing loadable, or a hub id cannot be reached.
    """
    from transformers import AutoConfig

    from ..models import hub_offline, resolve_model_spec

    source = resolve_model_spec(spec)
    try:
        if source.kind == "gguf":
            path = Path(source.location)
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if source.kind == "hub" and hub_offline():
            raise ModelError(f"model {spec!r} is a hub id but the hub is offline (HF_HUB_OFFLINE); "
                             "download it first or pass a local directory")
        return AutoConfig.from_pretrained(source.location)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the config of model {spec!r}: {first}") from None


def run(args: argparse.Namespace) -> int:
    """Probe, plan and print (a text table, or JSON with ``--json``). Returns 0.

    Raises:
        OutcoreError: a bad config, an unreadable model, or a plan that cannot fit
            (BudgetError naming the tier, its budget and the need).
    """
    from ..offload.distributed import from_env
    from ..offload.store import probe_hardware
    from ..planner import plan_for_config
    from ..training.distributed.across_ranks import plan_note

    if args.ranks < 0:
        raise ConfigError(f"--ranks {args.ranks} must be >= 1 (or 0: torchrun's WORLD_SIZE)")
    config = config_from_args(args)
    world = args.ranks or from_env().world  # under torchrun: its WORLD_SIZE
    note = plan_note(config, world) if world > 1 else None
    hf_config = model_config(config.model)
    probe = probe_hardware(config.swap_dir, measure=not args.no_measure)
    if wants_longest(args):
        config = take_longest(config, hf_config, probe, world)
    plan = plan_for_config(config, hf_config, probe, world=world)
    if args.json:
        emit_json(json.dumps({**plan.to_dict(), **({"ranks": world, "per_rank": note} if note else {})},
                         indent=2, default=str))
    else:
        print(plan.table().rstrip("\n") + (f"\n{note}" if note else ""))
    return 0


def take_longest(config: Any, hf_config: Any = None, probe: Any = None, world: int = 1) -> Any:
    """``config`` at the longest context its plan finds (``--seq-len max``), with the activation
    policy that gets there; says so in one line on stderr.

    Args:
        config: the run's FinetuneConfig (its ``seq_len`` is a placeholder).
        hf_config, probe: the model's config and the hardware probe (read / probed when None,
            without measuring the disk, as a run's own plan does).
        world: data-parallel ranks.

    Raises:
        BudgetError: not even one token fits (the plan's own error).
    """
    import dataclasses
    import sys

    from ..errors import BudgetError
    from ..offload.store import probe_hardware
    from ..planner import plan_for_config

    hf_config = hf_config if hf_config is not None else model_config(config.model)
    probe = probe if probe is not None else probe_hardware(config.swap_dir, measure=False)
    try:  # (compute is timed at the plan's length: the configured one times like a real step)
        longest = plan_for_config(config, hf_config, probe, world=world).longest
    except BudgetError:
        longest = plan_for_config(dataclasses.replace(config, seq_len=1), hf_config, probe, world=world).longest
    if longest is None:
        raise BudgetError(f"--seq-len max: not even one token of batch_size={config.batch_size} fits these "
                          "budgets; lower --batch-size or raise --device-mem / --host-mem")
    print(f"outcore: --seq-len max: {longest.describe()}", file=sys.stderr)
    return dataclasses.replace(config, seq_len=longest.seq_len, activations=longest.activations)
