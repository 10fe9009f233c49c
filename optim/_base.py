"""The optimizer contract the out-of-core engine relies on.

Every outcore optimizer is a ``torch.optim.Optimizer`` whose persistent state is a fixed
set of tensors per parameter, declared up front, so that a tiered store can allocate,
stream and write back that state without knowing the optimizer:

* :meth:`OutcoreOptimizer.state_spec` — name -> (shape, dtype) of each state tensor of p,
* :meth:`OutcoreOptimizer.init_state` — fresh state tensors matching the spec,
* :meth:`OutcoreOptimizer.update` — one block's update, in place, on tensors that may come
  from anywhere (a store's arena); it never reads ``self.state``.

``step()`` is the in-memory driver: for each group, lazily initialize ``self.state[p]``
then call ``update`` once for the group's parameters that have gradients. The step count
is a tensor in the state like everything else, so ``state_dict()`` /
``load_state_dict()`` round-trip exactly (dtypes included: torch's loader would cast the
uint8 codes and int64 seeds of our states to the parameter dtype, so we restore them).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

StateSpec = dict[str, tuple[torch.Size, torch.dtype]]
#: Group key the out-of-core engine sets when it updates a tensor in pieces: per parameter
#: passed to :meth:`OutcoreOptimizer.update`, the index of its first element in its whole
#: tensor (an update whose arithmetic depends on the element's index reads it; absent: 0).
PIECE_OFFSETS = "piece_offsets"


class OutcoreOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement :meth:`state_spec` and :meth:`update`."""

    #: whether a 16-bit parameter trains through an fp32 master the engine keeps (mixed
    #: precision); False: :meth:`update` takes the 16-bit weights themselves (``optim/lean.py``)
    wants_master = True

    def state_spec(self, p: Tensor, group: dict[str, Any]) -> StateSpec:
        """Every persistent state tensor of ``p``: name -> (shape, dtype).

        Args:
            p: the parameter (any shape).
            group: its param group (hyper-parameters).

        Returns:
            An ordered mapping; a store allocates exactly these tensors.
        """
        raise NotImplementedError

    def init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """Fresh state of ``p`` on ``p.device``, matching :meth:`state_spec` (zeros by default).

        Args:
            p: the parameter.
            group: its param group.

        Returns:
            name -> tensor.
        """
        return {name: torch.zeros(shape, dtype=dtype, device=p.device)
                for name, (shape, dtype) in self.state_spec(p, group).items()}

    def elementwise_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, int] | None:
        """How ``p``'s state lines up with its elements, if the update is element-wise.

        An optimizer whose update of element ``i`` reads only element ``i`` of the
        gradient and of its state (Adam and its 8-bit form; not a projection method)
        lets the out-of-core engine update a large parameter — an embedding — a piece
        at a time, so its state streams through memory in pieces instead of whole.

        Args:
            p: the parameter (any shape; its elements are taken in row-major order).
            group: its param group.

        Returns:
            None when the update mixes elements (the default). Otherwise, per state
            name of :meth:`state_spec`, how many consecutive elements of ``p`` share one
            state element: 1 (a state shaped like ``p``), ``b`` (one per block of ``b``
            elements, e.g. an absmax) or 0 (one for the whole tensor, e.g. the step
            count, which every piece reads and advances alike).
        """
        return None

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """Update ``params`` and ``states`` in place from ``grads`` (one block, one group).

        Args:
            params: parameters (or their storage in an arena), updated in place.
            grads: gradients, same shapes.
            states: per parameter, the tensors of :meth:`state_spec`, updated in place.
            group: the param group's hyper-parameters.
        """
        raise NotImplementedError

    def update_lean(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
                    group: dict[str, Any], rounding: list[tuple[int, int]]) -> list[bool]:
        """The bf16-lean update (``optim/lean.py``) of those ``params`` this optimizer has one
        fused pass for: bf16 weights and gradients widened to fp32, :meth:`update`, the weights
        rounded back by ``stochastic_round_(p, w, key, offset)``; the same bits, without the
        chunked path's fp32 buffers.

        Args:
            params, grads: bf16 tensors (weights updated in place).
            states: per parameter, its :meth:`state_spec` tensors as for an fp32 ``p``.
            group: the param group's hyper-parameters.
            rounding: per parameter, the ``(key, offset)`` of its stochastic rounding.

        Returns:
            Per parameter, whether it was updated; the default updates none.
        """
        return [False] * len(params)

    # ------------------------------------------------------------------------------
    def param_index(self, p: Tensor) -> int:
        """Position of ``p`` among all parameters of all groups (0-based), by identity.

        Raises:
            KeyError: ``p`` is not a parameter of this optimizer.
        """
        i = 0
        for group in self.param_groups:
            for q in group["params"]:
                if q is p:
                    return i
                i += 1
        raise KeyError("tensor is not a parameter of this optimizer")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every parameter that has a gradient.

        Args:
            closure: optional; re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, states = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self.init_state(p, group))
                params.append(p)
                grads.append(p.grad)
                states.append(state)
            if params:
                self.update(params, grads, states, group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, keeping every state tensor's dtype (and copying it).

        Args:
            state_dict: from ``state_dict()`` of an optimizer of the same class and groups.
        """
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, params))
        for pid, st in saved.items():
            p = by_id[pid]
            self.state[p] = {k: (v.detach().to(device=p.device, copy=True)
                                 if isinstance(v, Tensor) else v) for k, v in st.items()}


def check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Validate the common Adam hyper-parameters; raise ValueError naming the value."""
    if not lr >= 0.0:
        raise ValueError(f"lr={lr!r} must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
