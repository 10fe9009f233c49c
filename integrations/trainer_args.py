"""Which ``transformers.TrainingArguments`` the out-of-core Trainer honours, and which it refuses.

Honoured (the Trainer's own code does them, on the engine's numbers): ``learning_rate``,
``lr_scheduler_type`` / ``warmup_*`` (the scheduler sets the wrapped optimizer's learning
rate, read at the start of each step), ``adam_beta1`` / ``adam_beta2`` / ``adam_epsilon``,
``gradient_accumulation_steps``, ``max_grad_norm`` (the engine's global-norm clip, the
arithmetic of ``clip_grad_norm_``), ``max_steps`` / ``num_train_epochs``, ``logging_steps``,
``save_steps`` / ``save_strategy`` / ``save_total_limit``, ``eval_steps`` / ``eval_strategy``,
``seed``, ``output_dir`` and ``train(resume_from_checkpoint=...)``.

Refused, each with a one-line :class:`~outcore.errors.ConfigError` naming the fix: the
AMP flags (the engine computes in the model's own dtype), DeepSpeed, FSDP and more than one
process (the engine is the memory manager of one process), optimizers other than AdamW
(pass an ``outcore.optim`` optimizer through ``optimizers=`` instead), ``weight_decay`` > 0
(the Trainer exempts biases and norms; the engine's updates take one hyper-parameter group) —
both honoured for a peft (LoRA) model, whose resident adapters the Trainer's own optimizer steps —,
gradient checkpointing and ``torch_compile`` (they re-run or trace the forward the engine's
hooks stream), ``load_best_model_at_end``, Liger kernels and TRL's ``use_vllm`` (vLLM would load
the weights itself; transformers' ``generate`` streams them).
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError

#: ``optim`` names computed by outcore's AdamW (torch's fused kernel: bit for bit with
#: ``adamw_torch_fused``, the Trainer's default; ``adamw_torch``'s foreach loop rounds differently)
ADAMW_NAMES = ("adamw_torch_fused", "adamw_torch")


def _refusals(args: Any, adapters: bool) -> list[tuple[bool, str]]:
    """(is it set, the one-line reason and fix) for every argument the engine cannot honour."""
    optim = str(getattr(args.optim, "value", args.optim))
    streamed = not adapters  # the engine updates the weights (else the Trainer's optimizer, the adapters)
    # transformers 5.24 renamed gradient_checkpointing (a mirrored alias until v6, absent before 5.24)
    checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(args, "gradient_checkpointing", False)
    return [
        (args.fp16 or args.bf16, f"fp16={args.fp16}, bf16={args.bf16}: the out-of-core engine computes in the "
                                 "model's own dtype; load the model in bfloat16 instead (outcore keeps fp32 "
                                 "master weights) and leave fp16/bf16 False"),
        (bool(args.deepspeed), f"deepspeed={args.deepspeed!r}: outcore replaces DeepSpeed's offload; drop it"),
        (bool(args.fsdp), f"fsdp={args.fsdp!r}: the out-of-core engine runs in one process; drop fsdp"),
        (args.world_size > 1 or args.n_gpu > 1,
         f"world_size={args.world_size}, n_gpu={args.n_gpu}: the out-of-core engine runs in one process on one "
         "device; launch one process (CUDA_VISIBLE_DEVICES=0)"),
        (streamed and optim not in ADAMW_NAMES,
         f"optim={optim!r}: the out-of-core Trainer computes AdamW ({', '.join(ADAMW_NAMES)}); "
         "for another optimizer pass optimizers=(outcore.optim.<Name>(...), None)"),
        (streamed and args.weight_decay > 0,
         f"weight_decay={args.weight_decay}: the Trainer exempts biases and norms from "
         "decay and the out-of-core updates take one decay for all; set weight_decay=0"),
        (bool(checkpointing), "activation_checkpointing (gradient_checkpointing)=True: the engine streams "
                                      "each block's weights for one forward; drop it"),
        (args.torch_compile, "torch_compile=True: the engine's module hooks stream the weights; drop torch_compile"),
        (args.load_best_model_at_end, "load_best_model_at_end=True: not supported out of core; pick the "
                                      "checkpoint-N folder yourself after training"),
        (bool(getattr(args, "use_liger_kernel", False)), "use_liger_kernel=True: not supported out of core; drop it"),
        (bool(getattr(args, "use_vllm", False)), "use_vllm=True: vLLM would load the policy's weights, which "
                                                 "stream out of core; leave it False (generate() streams them)"),
    ]


def check_training_args(args: Any, adapters: bool = False) -> None:
    """Raise on the first argument the out-of-core engine cannot honour.

    Args:
        args: the Trainer's ``TrainingArguments`` (or a subclass such as TRL's ``SFTConfig``).
        adapters: the model is a peft model (resident adapters stepped by the Trainer's optimizer).

    Raises:
        ConfigError: one line naming the argument and what to do.
    """
    for refused, why in _refusals(args, adapters):
        if refused:
            raise ConfigError(why)
