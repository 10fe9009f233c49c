"""The memory plan: which tier holds what, how deep to prefetch, what a step will cost.

``outcore plan`` prints it, ``outcore finetune`` follows it. From the model
(its units of transfer), the method, optimizer, dtype, sequence length and
micro-batch, the activation policy and the budgets (from the hardware probe or
explicit flags), :func:`make_plan` decides, per unit and per class of tensor
(weights, gradients, optimizer state; activations), the tier that holds the
authoritative copy, the prefetch depth *k*, the largest micro-batch that fits,
the bytes per tier and the expected step time split into compute and I/O.

Policy (docs/architecture.md §6): keep everything as high (fast) as the budgets allow.

- ``offload="none"``: everything on DEVICE; error if it does not fit, naming the sizes.
- ``offload="cpu"``: weights, gradients and state on HOST; DEVICE holds the window.
- ``offload="nvme"``: everything authoritative on NVME; HOST and DEVICE hold windows.
- ``offload="auto"``: all on DEVICE when it fits; otherwise stream from HOST,
  spilling to NVMe first optimizer state, then stored gradients, then weights —
  cold units first (the embedding and the first blocks, whose forward and
  backward uses are furthest apart) — and pin hot units on DEVICE with what is
  left.

Activation policy ``auto`` weighs ``keep`` and ``recompute``. Every configuration
considered (offload layout x activation policy) is listed on the plan
(``MemoryPlan.candidates``: fits, estimated step time, bytes written to the SSD per
step) and ``choice.choose`` takes one: among those that fit, the fastest, or
among those within 10% of it the one that writes least.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..activations.policy import ACTIVATION_POLICIES, AUTO, CHECKPOINT_OFFLOADS, SEQ_TILE_AUTO, ActivationPolicy
from ..bytesize import format_bytes
from ..dtypes import DTYPE_BYTES, EXACT, torch_dtype
from ..errors import BudgetError, ConfigError
from ..methods import SFT, method_traits, objective
from ..offload.modes import CPU, NONE, NVME, OFFLOAD_MODES, UPDATE_ON
from ..offload.modes import AUTO as AUTO_OFFLOAD
from ..offload.store import Tier
from ..optim import ZO_OPTIMIZERS, optimizer_names
from .budget import RUNTIME_OVERHEAD_BYTES, Budgets, budgets_from_probe
from .choice import Candidate, choose, describe
from .compute import measure_compute_rates, measure_update_rate
from .layout import (RECOMPUTED, Layout, StepTime, Workload, account, activations_read_ahead, prefetch_depth,
                     step_time)
from .longest import LongestContext, longest_context
from .sizes import ModelSpec, model_spec, unit_bytes

__all__ = ["MemoryPlan", "UnitPlacement", "make_plan", "plan_for_config", "Budgets", "budgets_from_probe"]

MAX_MICRO_BATCH = 1 << 16  # search bound for the largest micro-batch that fits
#: what activation policy ``auto`` tries, in order: keep when it fits, else recompute (the block
#: checkpoints on DEVICE, else on NVMe: the longest contexts)
_AUTO_ACTIVATIONS = (ActivationPolicy.KEEP.value, ActivationPolicy.RECOMPUTE.value, CHECKPOINT_OFFLOADS[1])
#: what the longest-context search weighs: every policy
_ALL_ACTIVATIONS = tuple(p for p in ACTIVATION_POLICIES if p != AUTO)


@dataclass(frozen=True)
class UnitPlacement:
    """Where one unit's tensors live. ``grads`` is None when they are freed right after the
    unit's update (step-in-backward); ``state`` is None when the unit has none."""

    name: str
    weights_bytes: int
    grads_bytes: int
    state_bytes: int  # optimizer state + fp32 master weights
    weights: Tier
    grads: Tier | None
    state: Tier | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weights_bytes": self.weights_bytes, "grads_bytes": self.grads_bytes,
                "state_bytes": self.state_bytes, "weights": self.weights.name,
                "grads": self.grads.name if self.grads is not None else None,
                "state": self.state.name if self.state is not None else None}


@dataclass
class MemoryPlan:
    """A decided plan. Render with :meth:`table`; serialize with :meth:`to_dict`."""

    model_type: str
    params: int  # parameters of the model (tied counted once)
    trainable: int
    method: str
    optim: str
    dtype: str
    seq_len: int
    batch_size: int  # the micro-batch the plan is for
    offload: str  # what was asked (none | auto | cpu | nvme)
    layout: str  # what was chosen (none | cpu | nvme | mixed)
    activations: str  # resolved policy (keep | recompute | offload)
    prefetch_depth: int  # k units in flight ahead of the one computing (0: nothing streams)
    max_micro_batch: int  # largest micro-batch this layout fits
    grads_kept: bool  # gradients stored until all exist (clipping / accumulation) vs step-in-backward
    units: list[UnitPlacement]
    tier_bytes: dict[str, dict[str, int]]  # tier name -> part -> bytes
    budgets: Budgets
    time: StepTime
    notes: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # every configuration considered (choice.py)
    chosen: int | None = None  # which of the candidates this plan is
    longest: LongestContext | None = None  # the longest sequence that trains at this micro-batch (longest.py)
    seq_tile: int = 0  # tokens per MLP tile (0: untiled)
    blocks_tiled: bool = False  # a recomputed block runs seq_tile positions at a time (tiled_block.py)

    # -- derived ---------------------------------------------------------------------
    def tier_total(self, tier: Tier | str) -> int:
        """Bytes the plan puts in ``tier`` (authoritative copies, windows, activations)."""
        return sum(self.tier_bytes[Tier.parse(tier).name].values())

    def budget(self, tier: Tier | str) -> int:
        t = Tier.parse(tier)
        return {Tier.DEVICE: self.budgets.device_bytes, Tier.HOST: self.budgets.host_bytes,
                Tier.NVME: self.budgets.nvme_bytes}[t]

    def arena_bytes(self, tier: Tier | str) -> int:
        """Bytes the TieredStore's arena for ``tier`` must hold: the tier's total minus what
        lives in ordinary torch allocations (activations, resident LoRA adapters)."""
        parts = self.tier_bytes[Tier.parse(tier).name]
        return sum(v for k, v in parts.items() if k not in ("activations", "adapters"))

    @property
    def activations_read_ahead(self) -> int:
        """Offloaded blocks the backward reads ahead, as this plan counts them: the
        ``prefetch_depth`` to give ``apply_activation_policy``."""
        return activations_read_ahead(self.prefetch_depth)

    @property
    def expected_peak_rss_bytes(self) -> int:
        """Process RSS to expect: the RAM tiers plus the fixed runtime overhead."""
        ram = self.tier_total(Tier.HOST) + (self.tier_total(Tier.DEVICE) if self.budgets.shared_ram else 0)
        return ram + RUNTIME_OVERHEAD_BYTES

    @property
    def written_per_step_bytes(self) -> int | None:
        """Bytes a step of this plan writes to the SSD (estimated; None for a plan built by hand)."""
        return None if self.chosen is None else self.candidates[self.chosen].written_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole plan (``outcore plan --json``)."""
        t = self.time
        return {
            "model_type": self.model_type, "params": self.params, "trainable": self.trainable,
            "method": self.method, "optim": self.optim, "dtype": self.dtype, "seq_len": self.seq_len,
            "batch_size": self.batch_size, "offload": self.offload, "layout": self.layout,
            "activations": self.activations, "prefetch_depth": self.prefetch_depth,
            "max_micro_batch": self.max_micro_batch, "grads_kept": self.grads_kept,
            "tiers": {name: {"bytes": sum(parts.values()), "budget": self.budget(name), "parts": dict(parts)}
                      for name, parts in self.tier_bytes.items()},
            "expected_peak_rss_bytes": self.expected_peak_rss_bytes,
            "runtime_overhead_bytes": RUNTIME_OVERHEAD_BYTES,
            "step": {"step_s": t.step_s, "compute_s": t.compute_s, "update_s": t.update_s,
                     "exposed_io_s": t.exposed_io_s, "io_bytes": dict(t.io_bytes), "io_s": dict(t.io_s)},
            "budgets": self.budgets.to_dict(),
            "units": [u.to_dict() for u in self.units],
            "notes": list(self.notes),
            "candidates": [{**c.to_dict(), "chosen": i == self.chosen} for i, c in enumerate(self.candidates)],
            "written_per_step_bytes": self.written_per_step_bytes,
            "seq_tile": self.seq_tile,
            "blocks_tiled": self.blocks_tiled,
            "longest_context": None if self.longest is None else self.longest.to_dict(),
        }

    def table(self) -> str:
        """A plain-text report a person can read before the run starts (no torch needed)."""
        from .render import render_table

        return render_table(self)


# ---------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------
def _check_inputs(method: str, optim: str, dtype: str, seq_len: int, batch_size: int, activations: str,
                  offload: str, grad_accum: int, update_on: str) -> None:
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"offload={offload!r} is not one of: {', '.join(OFFLOAD_MODES)}")
    if update_on not in UPDATE_ON:
        raise ConfigError(f"update_on={update_on!r} is not one of: {', '.join(UPDATE_ON)}")
    if activations not in ACTIVATION_POLICIES:
        raise ConfigError(f"activations={activations!r} is not one of: {', '.join(ACTIVATION_POLICIES)}")
    if optim not in optimizer_names():
        raise ConfigError(f"optim={optim!r} is not one of: {', '.join(optimizer_names())}")
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("grad_accum", grad_accum)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be an integer >= 1")
    if method_traits(method).backward == (optim in ZO_OPTIMIZERS):
        raise ConfigError(f"method={method!r} does not go with optim={optim!r}: zeroth-order "
                          f"needs method 'zo' with optim {' or '.join(ZO_OPTIMIZERS)}")


def _fits(w: Workload, lay: Layout, batch: int) -> bool:
    return account(w, lay, batch).over_budget(w.budgets) is None


def _max_batch(w: Workload, lay: Layout) -> int:
    """Largest micro-batch with which ``lay`` fits (0: not even one sequence)."""
    if not _fits(w, lay, 1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_MICRO_BATCH and _fits(w, lay, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_MICRO_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(w, lay, mid) else (lo, mid)
    return lo


def _with_depth(w: Workload, lay: Layout, batch: int) -> Layout:
    """``lay`` with the prefetch depth it wants, reduced (to 1 at least) until DEVICE fits."""
    if not lay.streamed:
        return replace(lay, prefetch=0)
    k = prefetch_depth(w, lay, batch)
    while k > 1 and not _fits(w, replace(lay, prefetch=k), batch):
        k -= 1
    return replace(lay, prefetch=k)


def _greedy(w: Workload, policy: str, batch: int) -> Layout:
    """Stream from HOST; spill to NVMe (state, then grads, then weights; cold units first)
    until everything fits; then pin hot units (head, last blocks) whole on DEVICE while it fits."""
    n = len(w.units)
    lay = Layout.uniform(n, Tier.HOST, policy)
    lay = replace(lay, prefetch=prefetch_depth(w, lay, batch))
    order = list(range(n))  # forward order = coldest first: uses furthest apart in a step
    spills = [("state", i) for i in order if w.units[i].state]
    spills += [("grads", i) for i in order if w.units[i].grads and w.grads_kept]
    spills += [("weights", i) for i in order]
    for cls, i in spills:
        if _fits(w, lay, batch):
            break
        lay = lay.with_unit(i, **{cls: Tier.NVME})
    lay = _with_depth(w, lay, batch)  # only now give up prefetch depth, if DEVICE is the limit
    if not _fits(w, lay, batch):
        return lay  # the caller reports what does not fit
    for i in reversed(order):  # hottest first
        pinned = lay.with_unit(i, resident=True, weights=Tier.DEVICE, grads=Tier.DEVICE, state=Tier.DEVICE)
        if pinned.streamed and _fits(w, pinned, batch):
            lay = pinned
    return lay


def _grads_in_ram(w: Workload, lay: Layout, batch: int) -> Layout:
    """``lay`` with its kept gradients in HOST when HOST holds them. A gradient lives one step:
    on NVMe it costs a write and a read per step (SSD wear, nothing kept), in RAM neither."""
    if not w.grads_kept:
        return lay
    in_ram = replace(lay, grads=tuple(Tier.HOST if g == Tier.NVME else g for g in lay.grads))
    return in_ram if _fits(w, in_ram, batch) else lay


def _budget_error(w: Workload, lay: Layout, batch: int, offload: str) -> BudgetError:
    acc = account(w, lay, batch)
    tier, budget, need = acc.over_budget(w.budgets) or ("DEVICE", w.budgets.device_bytes, acc.total(Tier.DEVICE))
    key = {"DEVICE": Tier.DEVICE, "HOST": Tier.HOST, "NVME": Tier.NVME}.get(tier)
    if key is not None:
        parts = acc.parts[key]
    else:
        parts = {f"{p} ({t.name})": v for t in (Tier.DEVICE, Tier.HOST) for p, v in acc.parts[t].items()}
    detail = ", ".join(f"{p} {format_bytes(v)}" for p, v in sorted(parts.items(), key=lambda x: -x[1]))
    hints = []
    if offload == NONE:
        hints.append(f"--offload {AUTO_OFFLOAD} (or {CPU} / {NVME})")
    elif tier not in ("DEVICE", "NVME") and lay.name(w.grads_kept) != NVME:
        hints.append(f"--offload {NVME}")
    best = _max_batch(w, lay)
    if batch > 1 and best >= 1:
        hints.append(f"--batch-size {best}")
    elif batch > 1:
        hints.append("a smaller --batch-size")
    if lay.activations == ActivationPolicy.KEEP.value and w.has_backward and tier != "NVME":
        hints.append(f"--activations {ActivationPolicy.RECOMPUTE.value}")
    flag = {"DEVICE": "a larger --device-mem", "HOST": "a larger --host-mem",
            "NVME": "a --swap-dir with more free space"}.get(tier, "more free RAM (or a smaller --host-mem / "
                                                                   "--device-mem so NVMe takes the rest)")
    hints.append(flag)
    return BudgetError(f"offload={offload}: the {tier} budget of {format_bytes(budget)} cannot hold the "
                       f"{format_bytes(need)} this plan needs at batch_size={batch} ({detail}); "
                       f"try {', '.join(hints)}")


def _length_error(w: Workload, error: BudgetError, layouts, batch: int) -> BudgetError:
    """``error`` with what fits instead, when the sequence length is what does not: the setting at
    which ``w.seq_len`` trains (another activation policy, a smaller micro-batch), or the
    longest context that trains at all (at micro-batch 1) and its setting."""
    longest = longest_context(w, lambda wn: layouts(wn, 1), 1)
    if longest is None:
        return error
    for b in dict.fromkeys((batch, 1)):
        at = longest_context(w, lambda wn, b=b: layouts(wn, b), b, up_to=w.seq_len)
        if at is not None and at.seq_len >= w.seq_len:
            return BudgetError(f"seq_len={w.seq_len} does not fit as asked: {error}; it fits with {at.setting} "
                               f"(the longest context that fits: {longest.seq_len} tokens)")
    return BudgetError(f"seq_len={w.seq_len} does not fit: {error}; the longest context that fits is "
                       f"{longest.seq_len} tokens: --seq-len {longest.seq_len} {longest.setting}")


def make_plan(model: Any, *, method: str = "full", optim: str = "adamw", dtype: str = "float32", precision: str = EXACT,
              seq_len: int = 256, batch_size: int = 1, activations: str = "keep", offload: str = "auto",
              budgets: Budgets | None = None, probe: Any = None, grad_accum: int = 1,
              max_grad_norm: float = 0.0, optim_args: Mapping[str, Any] | None = None, lora_r: int = 8,
              lora_targets: tuple[str, ...] | list[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
              activations_compress: str = "none", world: int = 1, seq_tile: "int | str" = SEQ_TILE_AUTO,
              padding_free: bool = False, update_on: str = "device") -> MemoryPlan:
    """Decide where every tensor of a fine-tuning run lives.

    Args:
        model: a Hugging Face causal LM (live or on the meta device), its config
            (``PretrainedConfig``; sized on the meta device, nothing allocated), or a ``ModelSpec``.
        method: ``full`` | ``lora`` | ``qlora`` | ``zo``.
        optim: an optimizer name (sets bytes of state per parameter).
        dtype: compute dtype; ``bfloat16`` / ``float16`` keep fp32 master weights with the state
            (unless ``precision`` is ``bf16-lean``: no master).
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch.
        activations: ``auto`` | ``keep`` | ``recompute`` | ``offload``.
        offload: ``none`` | ``auto`` | ``cpu`` | ``nvme``.
        budgets: explicit budgets and speeds; else from ``probe``.
        probe: a ``HardwareProbe`` (used when ``budgets`` is None).
        grad_accum, max_grad_norm: > 1 / > 0 keep every gradient until the update
            (it then runs after the backward); otherwise updates run inside it.
        optim_args, lora_r, lora_targets, activations_compress: as in ``FinetuneConfig``
            (the last sizes offloaded activations by its codec's ratio).
        world: data-parallel ranks (a full fine-tune's state sharded: the plan is one rank's).
        seq_tile: tokens per MLP tile, ``auto`` or 0 (``activations/tiling.py``): a tiled MLP
            holds one tile's intermediates, not the sequence's; a recomputed block, one tile of
            positions (``activations/tiled_block.py``).
        padding_free: packed documents kept apart: attention takes a ``[batch, 1, seq, seq]``
            mask, which every block saves in the compute dtype, and no block is tiled whole.
        update_on: on a GPU, where an out-of-core update runs (``offload.modes.UPDATE_ON``): ``device``,
            the state streamed to it, or ``host``, the CPU updating it in RAM (its rate timed here).

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        ConfigError: a bad argument (named).
        BudgetError: no layout fits; the message names the tier, its budget, the need and what to try.
    """
    _check_inputs(method, optim, dtype, seq_len, batch_size, activations, offload, grad_accum, update_on)
    if budgets is None:
        if probe is None:
            raise ConfigError("make_plan needs budgets= or probe= (outcore.offload.store.probe.probe_hardware())")
        budgets = budgets_from_probe(probe)
    spec: ModelSpec = model_spec(model)
    ub = tuple(unit_bytes(spec, method=method, optim=optim, dtype=dtype, precision=precision,
                          optim_args=optim_args,
                          lora_r=lora_r, lora_targets=tuple(lora_targets),
                          world=world if method == "full" else 1))
    traits = method_traits(method)
    grads_kept = traits.trains_weights and traits.backward and (max_grad_norm > 0 or grad_accum > 1)
    measure = budgets.flops <= 0  # no rate given: time this machine (once per shape and process)
    budgets = budgets.with_flops(dtype)
    rates = measure_compute_rates(spec, torch_dtype(dtype), seq_len, budgets.device_kind,
                                  budgets.flops) if measure else None
    # a full fine-tune's update on the CPU timed too (each of ``world`` ranks updates 1/world of it)
    on_host = update_on == "host" and budgets.device_kind != "cpu"
    timed_update = measure and (budgets.device_kind == "cpu" or on_host) and method == "full"
    update_rate = measure_update_rate(spec, optim, optim_args, precision) * world if timed_update else 0.0
    from ..activations.tiling import resolve_tile

    tile = resolve_tile(seq_tile, spec.intermediate, DTYPE_BYTES[dtype])
    w = Workload(spec, ub, traits, dtype, seq_len, grads_kept, budgets, activations_compress, rates, tile,
                 padding_free, masters=precision == EXACT, update_params_per_s=update_rate, update_on_host=on_host)
    policies = list(_AUTO_ACTIVATIONS) if activations == AUTO else [activations]
    if not traits.backward:
        policies = [ActivationPolicy.KEEP.value]  # nothing is saved for a backward

    layouts = _layouts(w, offload, policies, batch_size)
    times = [step_time(w, lay, batch_size) for lay in layouts]
    candidates = [describe(w, lay, batch_size, st) for lay, st in zip(layouts, times)]
    best = choose(candidates)
    every = list(_ALL_ACTIVATIONS) if traits.backward else policies
    if best is None:
        raise _length_error(w, _budget_error(w, layouts[0] if offload == NONE else layouts[-1], batch_size,
                                             offload), lambda wn, b: _layouts(wn, offload, every, b), batch_size)
    plan = _build(w, layouts[best], times[best], batch_size, offload, method, optim)
    plan.candidates, plan.chosen, plan.seq_tile = candidates, best, tile if w.tiled(batch_size) else 0
    plan.blocks_tiled = w.block_tiled and plan.activations in RECOMPUTED
    plan.longest = longest_context(w, lambda wn: _layouts(wn, offload, every, batch_size), batch_size)
    return plan


def _layouts(w: Workload, offload: str, policies: list[str], batch: int) -> list[Layout]:
    """The configurations ``offload`` allows, per activation policy, in the order considered:
    ``auto`` weighs all on DEVICE, streamed from HOST, from NVMe, and its greedy spill
    (a layout met twice is listed once)."""
    out: list[Layout] = []
    n = len(w.units)
    for policy in policies:
        if offload in (NONE, AUTO_OFFLOAD):
            out.append(Layout.uniform(n, Tier.DEVICE, policy))
        for mode, tier in ((CPU, Tier.HOST), (NVME, Tier.NVME)):
            if offload in (mode, AUTO_OFFLOAD):
                lay = Layout.uniform(n, tier, policy)
                out.append(_with_depth(w, _grads_in_ram(w, lay, batch) if tier == Tier.NVME else lay, batch))
        if offload == AUTO_OFFLOAD:
            out.append(_greedy(w, policy, batch))
    return [lay for i, lay in enumerate(out) if lay not in out[:i]]


def _build(w: Workload, lay: Layout, st: StepTime, batch: int, offload: str, method: str,
           optim: str) -> MemoryPlan:
    acc = account(w, lay, batch)
    units = []
    for i, u in enumerate(w.units):
        grads = None
        if u.grads and (lay.resident[i] or w.grads_kept):
            grads = Tier.DEVICE if lay.resident[i] else lay.grads[i]
        units.append(UnitPlacement(u.name, u.weights, u.grads, u.state, lay.weights[i], grads,
                                   (lay.state[i] if u.state else None)))
    notes = []
    if not w.budgets.measured:
        notes.append("disk and copy speeds are fallbacks, not measured (run `outcore doctor`)")
    if lay.streamed and lay.prefetch < prefetch_depth(w, lay, batch):
        notes.append(f"DEVICE fits only {lay.prefetch} unit(s) ahead, fewer than the I/O needs to hide "
                     "behind compute; raise --device-mem or lower --batch-size")
    if w.grads_kept:
        notes.append("gradient clipping / accumulation: gradients are kept until every unit has one "
                     "and updates run after the backward")
    if w.budgets.device_kind == "cpu" and lay.streamed:
        notes.append("CPU-only: DEVICE is a RAM arena; copy and I/O threads share the cores with compute")
    elif lay.streamed and w.has_backward and any(u.state for u in w.units):
        notes.append("each update runs on the CPU where its optimizer state lives (update_on=host): "
                     "gradients come down and updated weights go up, the state never crosses the link; "
                     "a unit updates while the GPU computes the next unit's backward"
                     if w.update_on_host else
                     "each update runs on the GPU, its optimizer state streamed there and back: the copy "
                     "link carries no more than the disk, and a GPU updates faster than a consumer CPU")
    if w.rates:
        r = w.rates
        notes.append(f"compute timed here on one block and the head: {r.block / 1e9:.0f} and {r.head / 1e9:.0f} "
                     f"GFLOP/s (a square matmul: {r.matmul / 1e9:.0f})")
    if w.update_params_per_s:
        notes.append(f"optimizer update timed here: {w.update_params_per_s / 1e9:.2f} G parameters/s")
    trainable = sum(u.trainable for u in w.units)
    return MemoryPlan(
        model_type=w.spec.model_type, params=w.spec.numel, trainable=trainable, method=method,
        optim=optim, dtype=w.dtype, seq_len=w.seq_len, batch_size=batch, offload=offload,
        layout=lay.name(w.grads_kept), activations=lay.activations, prefetch_depth=lay.prefetch,
        max_micro_batch=_max_batch(w, lay), grads_kept=w.grads_kept, units=units,
        tier_bytes={t.name: dict(acc.parts[t]) for t in Tier}, budgets=w.budgets, time=st, notes=notes)


def plan_for_config(cfg: Any, model_or_hf_config: Any, probe: Any = None,
                    budgets: Budgets | None = None, world: int = 1) -> MemoryPlan:
    """The plan for a ``FinetuneConfig`` (what ``outcore plan`` and the trainer call).

    Args:
        cfg: the run's ``FinetuneConfig`` (method, optim, dtype, seq_len, batch_size,
            activations, offload, device_mem, host_mem, grad_accum, max_grad_norm, LoRA fields,
            objective: a preference pair is two rows of the micro-batch).
        model_or_hf_config: the loaded model, or its HF config (sized on the meta device).
        probe: ``probe_hardware(cfg.swap_dir)``; ``cfg.device_mem`` / ``cfg.host_mem``
            override its budgets.
        budgets: explicit budgets instead of a probe.
        world: data-parallel ranks (the plan is one rank's).

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        ConfigError, BudgetError: as :func:`make_plan`.
    """
    if budgets is None:
        if probe is None:
            raise ConfigError("plan_for_config needs a probe (outcore.offload.store.probe.probe_hardware()) or budgets")
        budgets = budgets_from_probe(probe, device_mem=cfg.device_mem, host_mem=cfg.host_mem)
    rows = cfg.batch_size * objective(getattr(cfg, "objective", SFT)).rows_per_example  # a pair is two rows
    return make_plan(model_or_hf_config, method=cfg.method, optim=cfg.optim, dtype=cfg.dtype, precision=cfg.precision,
                     seq_len=cfg.seq_len, batch_size=rows, activations=cfg.activations,
                     offload=cfg.offload, budgets=budgets, grad_accum=cfg.grad_accum,
                     max_grad_norm=float(cfg.max_grad_norm or 0.0), optim_args=cfg.optim_args,
                     lora_r=cfg.lora_r, lora_targets=tuple(cfg.lora_targets),
                     activations_compress=cfg.activations_compress, seq_tile=cfg.seq_tile,
                     padding_free=bool(getattr(cfg, "padding_free", False)),
                     update_on=getattr(cfg, "update_on", "device"),
                     world=world if cfg.offload != NONE else 1)  # (in memory, every rank a replica)


