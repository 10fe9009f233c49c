"""The fine-tuning config: one typed dataclass, loaded from YAML plus overrides.

``FinetuneConfig`` is what every recipe reads and what ``outcore finetune``
builds from ``--config FILE.yaml`` and ``key=value`` overrides. Keys are flat so
that every one of them can be overridden on the command line; optimizer-specific
hyper-parameters live in the ``optim_args`` mapping (``optim_args.rank=128``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..activations.policy import ACTIVATION_COMPRESSION, ACTIVATION_POLICIES, SEQ_TILE_AUTO, parse_seq_tile
from ..dtypes import BF16_LEAN, DTYPES, PRECISIONS
from ..errors import ConfigError
from ..methods import FULL, GRPO, GRPO_LOSS_TYPES, SCALE_REWARDS, SFT, method_traits, objective
from ..methods import OBJECTIVES as _OBJECTIVE_REGISTRY
from ..methods import METHODS as _METHOD_REGISTRY
from ..offload.modes import DEVICE_CHOICES, NVME, OFFLOAD_MODES, UPDATE_ON
from ..optim import ZO_OPTIMIZERS as _ZO_REGISTRY
from ..optim import optimizer_names

# The lists named here are defined by the package that owns the concept (methods in
# outcore/methods.py) and only re-exported, for the command line's help.
METHODS = tuple(_METHOD_REGISTRY)  # the registry's names (checks read the registry itself)
OBJECTIVES = tuple(_OBJECTIVE_REGISTRY)
OPTIMIZERS = optimizer_names()  # outcore.optim's registry: gradient-based, then zeroth-order
ZO_OPTIMIZERS = tuple(_ZO_REGISTRY)  # the only optimizers of method "zo" (and only of it)
UI_MODES = ("auto", "rich", "plain", "none")
TRACKERS = ("tensorboard", "wandb", "mlflow")  # report_to: experiment trackers (tui/trackers.py)
__all__ = ["METHODS", "OBJECTIVES", "OPTIMIZERS", "ZO_OPTIMIZERS", "DTYPES", "OFFLOAD_MODES", "DEVICE_CHOICES",
           "ACTIVATION_POLICIES", "UI_MODES", "TRACKERS", "PRECISIONS", "FinetuneConfig", "load_config", "save_config"]


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run needs. Defaults fine-tune the embedded default."""

    # --- what to train on -------------------------------------------------
    model: str = "default"  # local HF dir, a .gguf file, a hub id, or "default" (SmolLM2-135M-Instruct)
    data: str = "default"  # text file/folder, .jsonl (instruction or chat), or "default" (Shakespeare)
    data_max_bytes: int = 0  # read at most this many bytes of text data (0 = all)
    val_fraction: float = 0.02  # share of sequences held out for validation
    seq_len: int = 256  # tokens per training sequence
    padding_free: bool = False  # packed text keeps its documents apart (TRL's name): positions restart at each
    # --- how -----------------------------------------------------------------
    method: str = FULL  # one of METHODS
    # one of OBJECTIVES: sft (next-token loss on data), or a preference objective on JSONL pairs
    # {"prompt", "chosen", "rejected"} (TRL's format): dpo, orpo, simpo; kto on unpaired rows;
    # or grpo on prompt-only JSONL rows
    objective: str = SFT
    # dpo / orpo / simpo / kto: the preference loss's temperature; grpo: the KL term's weight (TRL's
    # beta). Unset: the objective's TRL default (0.1; grpo 0.0)
    beta: float | None = None
    simpo_gamma: float = 0.5  # simpo: the target reward margin (TRL's simpo_gamma)
    # kto (JSONL {"prompt", "completion", "label"}): the weights of the desirable and the
    # undesirable examples' losses (TRL's names)
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # --- GRPO (objective grpo: prompt-only JSONL, completions sampled and rewarded) --------
    num_generations: int = 8  # completions sampled per prompt (a group); batch_size counts completions, as TRL's
    max_completion_length: int = 128  # the most tokens sampled per completion (a prompt keeps seq_len - this)
    temperature: float = 1.0  # sampling temperature (the log-probabilities are taken at it, as TRL's)
    epsilon: float = 0.2  # the probability ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = 0.0  # 0: epsilon
    loss_type: str = "dapo"  # one of GRPO_LOSS_TYPES (TRL's loss_type)
    scale_rewards: str = "group"  # one of SCALE_REWARDS: advantages over the group's std, the batch's, or none
    reward_funcs: list[str] = field(default_factory=list)  # built-ins (exact_answer, format, regex) or module:function
    reward_weights: list[float] = field(default_factory=list)  # one per reward function (empty: 1.0 each)
    reward_pattern: str = ""  # the built-in regex reward's pattern (re.search)
    optim: str = "adamw"  # one of OPTIMIZERS
    optim_args: dict[str, Any] = field(default_factory=dict)  # optimizer-specific hyper-parameters
    lr: float = 5e-5  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5  # linear warmup steps
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables it
    batch_size: int = 2  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 40  # optimizer steps
    seed: int = 0  # seeds data order, init of new weights and dropout
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    # one of PRECISIONS. exact: the dtype's arithmetic (a 16-bit dtype trains through fp32 master
    # weights kept with the optimizer state). bf16-lean: compute and weights in bfloat16 (dtype is
    # set to it; float16 is refused), no fp32 master: each update widens a chunk of the weights to
    # fp32, runs the optimizer and rounds back stochastically (unbiased); with optim adamw8bit
    # ~4 B written per parameter per step instead of 16. method full only.
    precision: str = "exact"
    # --- LoRA (method lora / qlora) ------------------------------------------
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # --- memory ----------------------------------------------------------------
    offload: str = NVME  # one of OFFLOAD_MODES: where weights and optimizer state live (none = in memory)
    device: str = "auto"  # one of DEVICE_CHOICES: where the model computes (auto: the GPU when there is one)
    # one of UPDATE_ON: on a GPU, where the out-of-core update runs (host: the state stays in RAM and
    # the CPU updates it, at the rate the plan times; only gradients and weights cross the link)
    update_on: str = "device"
    device_mem: str | None = None  # DEVICE tier budget, e.g. "2GiB" (None = plan decides)
    host_mem: str | None = None  # HOST tier budget
    swap_dir: str | None = None  # NVMe swap directory (default: OUTPUT/swap)
    activations: str = "keep"  # one of ACTIVATION_POLICIES
    activations_keep_last: int = 1  # with offload: the last N blocks keep theirs (backward needs them first)
    activations_compress: str = "none"  # one of ACTIVATION_COMPRESSION: offloaded activations stored 8-bit
    # each block's MLP over tiles of this many tokens (its memory grows with the tile, not the
    # sequence): "auto" (~32 MiB of intermediate per tile; SmolLM2 fp32: 4096), 0 = untiled
    seq_tile: int | str = SEQ_TILE_AUTO
    ssd_tbw: float = 0.0  # the swap disk's rated terabytes written: show the share of its life a run uses (0 = unknown)
    # --- evaluation, logging, checkpoints --------------------------------------
    eval_every: int = 20  # steps between validation passes (0 = only before and after)
    eval_batches: int = 8  # micro-batches per validation pass (0 = the whole validation set)
    eval_task: str | None = None  # labelled JSONL task (or "shakespeare") scored at each eval (data/tasks.py)
    log_every: int = 1  # steps between metrics rows
    save_every: int = 0  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept; older ones are removed once a new one is complete
    output: str = "runs/default"  # output directory
    overwrite: bool = False  # allow reusing an output directory that holds another run
    resume: str | None = None  # resume from this output directory's last checkpoint
    export: bool = True  # write OUTPUT/final as a Hugging Face directory at the end
    ui: str = "auto"  # auto (rich on a TTY, else plain) | rich | plain | none
    report_to: list[str] = field(default_factory=list)  # experiment trackers, any of TRACKERS (a list allowed)
    push_to_hub: str | None = None  # after the export, upload OUTPUT/final to this Hugging Face repo id
    threads: int = 0  # torch CPU threads (0 = all cores; under torchrun, the cores shared among its ranks)
    dist_timeout_s: float = 300.0  # under torchrun: longest wait of a collective for the other ranks

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raise ConfigError naming the value and the rule."""
        _choice("method", self.method, tuple(_METHOD_REGISTRY))  # (a method registered since import too)
        objective(self.objective)  # (an objective registered since import too)
        for name, allowed in (("optim", OPTIMIZERS), ("dtype", DTYPES), ("precision", PRECISIONS),
                              ("offload", OFFLOAD_MODES), ("device", DEVICE_CHOICES), ("update_on", UPDATE_ON),
                              ("ui", UI_MODES),
                              ("activations", ACTIVATION_POLICIES), ("activations_compress", ACTIVATION_COMPRESSION)):
            _choice(name, getattr(self, name), allowed)
        self.seq_tile = parse_seq_tile(self.seq_tile)
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "lora_r",
                     "keep_checkpoints"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")
        for name in ("warmup_steps", "eval_every", "eval_batches", "save_every", "threads",
                     "data_max_bytes", "activations_keep_last"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not (self.dist_timeout_s > 0 and math.isfinite(self.dist_timeout_s)):
            raise ConfigError(f"dist_timeout_s={self.dist_timeout_s!r} must be a positive number of seconds")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr={self.lr!r} must be a positive finite number")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction={self.val_fraction!r} must be in [0, 0.5)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"max_grad_norm={self.max_grad_norm!r} must be >= 0 (0 disables clipping)")
        self._validate_numbers()
        self._resolve_precision()
        if self.zeroth_order != (self.optim in ZO_OPTIMIZERS):
            raise ConfigError(
                f"method={self.method!r} does not go with optim={self.optim!r}: "
                f"method 'zo' needs optim {' or '.join(ZO_OPTIMIZERS)}, and those need method 'zo'")
        if self.zeroth_order and objective(self.objective).zo_recipe is None:
            runs = " and ".join(repr(name) for name, o in _OBJECTIVE_REGISTRY.items() if o.zo_recipe)
            raise ConfigError(f"objective={self.objective!r} trains with gradients; method 'zo' runs objective "
                              f"{runs} only: use --method full, lora or qlora")
        if self.padding_free and self.objective != SFT:
            raise ConfigError(f"padding_free=true packs text for objective 'sft', not objective={self.objective!r} "
                              f"(its rows are examples, one a row): set padding_free=false")
        if self.objective == "kto" and self.batch_size < 2:
            raise ConfigError(f"objective 'kto' estimates its KL term from a batch's other completions: "
                              f"batch_size={self.batch_size} has none; use batch_size >= 2")
        if self.eval_task and self.zeroth_order:
            raise ConfigError(f"eval_task={self.eval_task!r} is not scored by method 'zo' yet; "
                              "drop it, or score the result with 'outcore eval RUN_DIR --task FILE'")
        if not isinstance(self.optim_args, dict):
            raise ConfigError(f"optim_args={self.optim_args!r} must be a mapping")
        for tracker in self.report_to:
            _choice("report_to", tracker, TRACKERS)
        if self.push_to_hub is not None and not self.export:
            raise ConfigError(f"push_to_hub={self.push_to_hub!r} uploads OUTPUT/final: set export=true")

    def _validate_numbers(self) -> None:
        """The checks of the optimizer's, LoRA's and the memory budgets' numbers (bad values
        would otherwise surface as a traceback deep in torch, peft or the planner)."""
        from ..bytesize import parse_bytes

        if self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be >= 0")
        for name in ("weight_decay", "eps"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas={list(self.betas)!r} must be two numbers in [0, 1), e.g. betas=0.9,0.999")
        if self.beta is None:
            self.beta = objective(self.objective).beta
        for name in ("simpo_gamma", "desirable_weight", "undesirable_weight"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive finite number")
        if self.objective == GRPO:
            self._validate_grpo()
        elif not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"beta={self.beta!r} must be a positive finite number")
        if not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha={self.lora_alpha!r} must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if not self.lora_targets or not all(isinstance(t, str) and t for t in self.lora_targets):
            raise ConfigError(f"lora_targets={self.lora_targets!r} must name modules, e.g. lora_targets=q_proj,v_proj")
        for name in ("model", "data", "output"):
            if not str(getattr(self, name)).strip():
                raise ConfigError(f"{name}={getattr(self, name)!r} is empty; pass a path (or 'default')")
        for name in ("device_mem", "host_mem"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), name)
        if not (self.ssd_tbw >= 0 and math.isfinite(self.ssd_tbw)):
            raise ConfigError(f"ssd_tbw={self.ssd_tbw!r} must be the swap disk's rated terabytes written, "
                              "a finite number > 0 (e.g. --ssd-tbw 600), or 0 when unknown")

    def _validate_grpo(self) -> None:
        """GRPO's sampling, loss and reward settings."""
        from .rewards import check_reward_spec

        if not self.reward_funcs:
            raise ConfigError("objective='grpo' needs reward_funcs: built-ins (exact_answer, format, regex) or "
                              "module:function, e.g. reward_funcs=exact_answer")
        for spec in self.reward_funcs:
            check_reward_spec(spec)
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ConfigError(f"beta={self.beta!r} must be a finite number >= 0 (the KL term's weight; 0: none)")
        if self.beta > 0 and not self.uses_adapters:
            raise ConfigError(f"beta={self.beta} with method={self.method!r}: the KL term's reference would be the "
                              "initial weights, which a full fine-tune does not keep; use beta=0 (TRL's default) "
                              "or method lora / qlora (the reference is then the base, adapters disabled)")
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations!r} must be >= 2 (advantages compare a "
                              "prompt's completions)")
        if self.batch_size % self.num_generations:
            raise ConfigError(f"batch_size={self.batch_size} must be a multiple of num_generations="
                              f"{self.num_generations} (completions per micro-batch, as TRL's batch size), "
                              f"e.g. batch_size={self.num_generations}")
        if not 1 <= self.max_completion_length < self.seq_len:
            raise ConfigError(f"max_completion_length={self.max_completion_length!r} must be in [1, seq_len="
                              f"{self.seq_len}): a prompt and its completion fit in seq_len")
        for name in ("temperature", "epsilon"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive finite number")
        if not (self.epsilon_high >= 0 and math.isfinite(self.epsilon_high)):
            raise ConfigError(f"epsilon_high={self.epsilon_high!r} must be >= 0 (0: epsilon)")
        _choice("loss_type", self.loss_type, GRPO_LOSS_TYPES)
        _choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        try:
            self.reward_weights = [float(w) for w in self.reward_weights]
        except (TypeError, ValueError):
            raise ConfigError(f"reward_weights={self.reward_weights!r} must be numbers") from None
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} "
                              "reward_funcs; give one per function (or none: 1.0 each)")

    def _resolve_precision(self) -> None:
        """``bf16-lean`` computes in bfloat16 (the default float32 dtype is taken as unset) and
        trains every weight; refuse what contradicts it."""
        if self.precision != BF16_LEAN:
            return
        if self.dtype == "float16":
            raise ConfigError(f"precision={BF16_LEAN!r} trains bfloat16 weights but dtype='float16': "
                              "drop dtype (or set dtype=bfloat16), or use precision=exact")
        if self.method != FULL:
            raise ConfigError(f"precision={BF16_LEAN!r} trains the model's own weights (method 'full'), "
                              f"not method={self.method!r}: use --method full, or precision=exact")
        self.dtype = "bfloat16"

    @property
    def uses_adapters(self) -> bool:
        """LoRA or QLoRA: low-rank adapters train, the base model stays frozen."""
        return not method_traits(self.method).trains_weights

    @property
    def quantizes_base(self) -> bool:
        """QLoRA: the frozen base's linear weights are stored 4-bit (NF4)."""
        return method_traits(self.method).quantized_base

    @property
    def zeroth_order(self) -> bool:
        """Method ``zo``: forward passes only (MeZO / Sparse-MeZO), no gradients or state."""
        return not method_traits(self.method).backward

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML-able dict of every field."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(allowed)}")


# ---------------------------------------------------------------------------------
# Loading: YAML file + key=value overrides -> FinetuneConfig
# ---------------------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
_OPTIONAL_FLOATS = ("beta",)  # numbers whose default, None, the objective resolves


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (``1e-4`` -> float, ``true`` -> bool)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if value is None and text not in ("null", "~", "") else value


def _coerce(name: str, value: Any) -> Any:
    """Convert ``value`` to the declared type of field ``name`` or raise ConfigError."""
    default = _FIELDS[name].default
    if default is dataclasses.MISSING:
        default = _FIELDS[name].default_factory()  # type: ignore[misc]
    try:
        if name in _OPTIONAL_FLOATS:
            return None if value is None else float(value)
        if value is None:
            if default is None or name in ("max_grad_norm",):
                return None if default is None else 0.0
            raise TypeError
        if isinstance(default, bool):
            if isinstance(value, str):
                value = {"true": True, "false": False, "1": True, "0": False}[value.lower()]
            return bool(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [float(v) for v in value.strip("()[] ").split(",")]
            return tuple(float(v) for v in value)
        if isinstance(default, list):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return list(value)
        if isinstance(default, dict):
            if not isinstance(value, Mapping):
                raise TypeError
            return dict(value)
        return value if value is None else str(value)
    except (TypeError, ValueError, KeyError):
        kind = type(default).__name__ if default is not None else "str"
        raise ConfigError(f"{name}={value!r} is not a valid {kind}") from None


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | list[str] | None = None,
                **kwargs: Any) -> FinetuneConfig:
    """Build a FinetuneConfig from a YAML file, then overrides, then keyword arguments.

    Args:
        path: a YAML file whose top-level keys are FinetuneConfig fields (or None).
        overrides: ``["key=value", ...]`` strings or a mapping; ``optim_args.x=1``
            sets one optimizer argument.
        **kwargs: more overrides as Python values (highest precedence).

    Returns:
        The validated config.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, or a bad value.
    """
    import yaml

    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file to --config")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text ({e}); "
                              "pass a YAML file saved as UTF-8") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
            raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of config keys")
        values.update(loaded)

    pairs: list[tuple[str, Any]] = []
    if isinstance(overrides, Mapping):
        pairs += list(overrides.items())
    else:
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value (e.g. lr=1e-4)")
            key, raw = item.split("=", 1)
            pairs.append((key.strip().replace("-", "_"), _parse_scalar(raw)))
    pairs += list(kwargs.items())

    for key, value in pairs:
        if key.startswith("optim_args."):
            base = values.setdefault("optim_args", {})
            if not isinstance(base, Mapping):
                raise ConfigError(f"optim_args={base!r} is not a mapping, so {key}={value!r} cannot extend it; "
                                  "give optim_args as key=value pairs (optim_args.NAME=VALUE)")
            values["optim_args"] = {**base, key.split(".", 1)[1]: value}
        else:
            values[key] = value

    if values.get("resume"):
        # Resuming continues the run as it was configured: its saved config is the
        # base and what was given here overrides it (e.g. a larger max_steps).
        saved = Path(str(values["resume"])) / "config.yaml"
        if path is None and saved.is_file():
            base = yaml.safe_load(saved.read_text()) or {}
            base.pop("overwrite", None)
            values = {**base, **values}
        values["output"] = str(values["resume"])

    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; known keys: {', '.join(sorted(_FIELDS))}")
    values = {**first_run_settings(values), **values}
    return FinetuneConfig(**{k: _coerce(k, v) for k, v in values.items()})


#: How the embedded default trains (``outcore finetune``, no settings): write-lean, 4 B written per
#: parameter per step where fp32 AdamW writes 12, sparing a newcomer's SSD; at lr 6.5e-5 its 40
#: steps reach perplexity 27.77 (5e-5: 28.17; exact fp32 AdamW at 5e-5: 28.11).
FIRST_RUN = {"precision": BF16_LEAN, "optim": "adamw8bit", "lr": 6.5e-5}


def first_run_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`FIRST_RUN` when the keys a user gave (``values``) leave model, data, method and objective
    the embedded default's and set no precision, optimizer or dtype; otherwise nothing."""
    default = {"model": "default", "data": "default", "method": FULL, "objective": SFT}
    if any(str(values.get(k, v)) != v for k, v in default.items()):
        return {}
    return {} if any(k in values for k in ("precision", "optim", "dtype")) else dict(FIRST_RUN)


def save_config(config: FinetuneConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (``OUTPUT/config.yaml``)."""
    import yaml

    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
