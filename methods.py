"""The training methods a run may name (``--method``, ``FinetuneConfig.method``): the one list.

Each entry names the recipe that runs the method and the traits the memory planner sizes it
by. The config's check, the command line's help, ``outcore.finetune``'s dispatch and the
planner all read :data:`METHODS`: a new method is one recipe file (a class the run lifecycle,
``training/lifecycle.py``, runs) and one entry here.

Torch-free and importing nothing of outcore but its errors, so that every layer may read it:
the planner too, which may not import the recipes; a recipe is therefore named
(``"module:Class"``, as ``optim.OPTIMIZERS`` names its optimizers) and imported by
``outcore.finetune`` only.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class MethodTraits:
    """What sizing a layout needs to know of a fine-tuning method."""

    trains_weights: bool  # every weight is updated and written back (else a frozen base + adapters)
    backward: bool  # a backward pass runs (zeroth-order: forward passes only)
    quantized_base: bool  # the frozen base's block matrices are NF4
    #: a step's compute in forward passes: full 3 (a backward costs 2 forwards), LoRA 2 (its
    #: backward skips the weight gradients), zeroth-order 2 (two forwards)
    compute_passes: float


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        recipe: the recipe class that runs it, ``"module:Class"`` (a module relative to the
            package ``outcore``, or absolute), constructed by ``training.lifecycle.Run.execute``.
        traits: what the planner and the config's checks know of it.
    """

    recipe: str
    traits: MethodTraits


FULL, LORA, QLORA, ZO = "full", "lora", "qlora", "zo"
_FIRST_ORDER = ".recipes.full_finetune:FullFinetune"  # full, LoRA and QLoRA: one recipe, three setups

#: name -> method, in the order the command line lists them
METHODS: dict[str, Method] = {
    FULL: Method(_FIRST_ORDER, MethodTraits(trains_weights=True, backward=True, quantized_base=False,
                                            compute_passes=3.0)),
    LORA: Method(_FIRST_ORDER, MethodTraits(trains_weights=False, backward=True, quantized_base=False,
                                            compute_passes=2.0)),
    QLORA: Method(_FIRST_ORDER, MethodTraits(trains_weights=False, backward=True, quantized_base=True,
                                             compute_passes=2.0)),
    ZO: Method(".recipes.zo_finetune:ZORecipe", MethodTraits(trains_weights=True, backward=False,
                                                             quantized_base=False, compute_passes=2.0)),
}


def method(name: str) -> Method:
    """The registered method ``name``.

    Raises:
        ConfigError: no method of that name.
    """
    return _named(METHODS, "method", name)


def method_traits(name: str) -> MethodTraits:
    """The :class:`MethodTraits` of method ``name`` (what the planner sizes).

    Raises:
        ConfigError: no method of that name.
    """
    return method(name).traits


@dataclass(frozen=True)
class Objective:
    """What a run optimizes, orthogonal to what it trains (``--objective``; a method of
    :data:`METHODS` says which weights train).

    Attributes:
        recipe: the recipe class that runs it (``"module:Class"``), or None: the method's own
            recipe (the next-token loss).
        rows_per_example: token rows a training example puts in a micro-batch (a preference
            pair: its chosen and its rejected completion); the planner sizes activations by it.
        reference: its loss compares with a frozen reference model's log-probabilities.
        beta: its ``beta`` when the config leaves it unset (TRL's default for the trainer).
        zo_recipe: the recipe that runs it with method ``zo`` (a scalar loss of the batch that
            two perturbed forwards can score), or None: ``zo`` does not run it.
    """

    recipe: str | None
    rows_per_example: int = 1
    reference: bool = False
    beta: float = 0.1
    zo_recipe: str | None = None


SFT, GRPO = "sft", "grpo"
_PREFERENCE = ".recipes.preference:PreferenceFinetune"

#: name -> objective (named as TRL's trainers, LLaMA-Factory's ``stage`` and axolotl's ``rl``)
OBJECTIVES: dict[str, Objective] = {
    SFT: Objective(None, zo_recipe=".recipes.zo_finetune:ZORecipe"),
    "dpo": Objective(_PREFERENCE, rows_per_example=2, reference=True, zo_recipe=".recipes.zo_preference:ZODPORecipe"),
    "orpo": Objective(_PREFERENCE, rows_per_example=2),
    "simpo": Objective(_PREFERENCE, rows_per_example=2),
    # a micro-batch is batch_size completions, num_generations per prompt; the KL term's
    # reference only when beta > 0 (TRL's default beta is 0)
    GRPO: Objective(".recipes.grpo:GRPOFinetune", beta=0.0),
    # unpaired: an example is its completion's row and its mismatched KL row
    "kto": Objective(".recipes.kto:KTOFinetune", rows_per_example=2, reference=True),
}

#: GRPO's loss reductions (TRL's ``loss_type``) and reward scalings (its ``scale_rewards``)
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def objective(name: str) -> Objective:
    """The registered objective ``name``.

    Raises:
        ConfigError: no objective of that name.
    """
    return _named(OBJECTIVES, "objective", name)


def recipe_of(method_name: str, objective_name: str = SFT) -> str:
    """The recipe (``"module:Class"``) that runs ``objective_name`` with ``method_name``."""
    chosen = objective(objective_name)
    if method_name == ZO and chosen.zo_recipe:
        return chosen.zo_recipe
    return chosen.recipe or method(method_name).recipe


def _named(table: dict, what: str, name: str):
    """``table[name]``, or the one-line error naming ``what`` and the registered names."""
    if name not in table:
        raise ConfigError(f"{what}={name!r} is not one of: {', '.join(table)}")
    return table[name]
