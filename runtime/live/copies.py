"""Two expert copies in the live runtime: the slots follow the step's copy of each expert, and each
experts call computes every slot at the copy it holds (issue 45, item 4; the rules:
:mod:`moecast.runtime.core.mixed`).

The per-layer step decides, exactly as the replay does, which copy each resident expert holds
(``LayerStep.low[layer, expert]``): the prefetches in the link window land as many as fit at the low
copy and, with the time left, the most confident at the high one; one started past the window, a
demand load and the CPU set read the low one, and idle link time rereads the high copy over a resident
low one (an upgrade: the flag turns False while the expert stays resident). The disk tier's stores
read each expert at the copy its flag names when they load it (:meth:`DiskLayerStore.follow
<moecast.runtime.tiers.offload.DiskLayerStore.follow>`: the store holds a view of the step's row),
and :meth:`SlotCopies.sync` rereads, after a layer's step and after its prefetch (or, where no
prefetch reaches a layer, as its window opens: the upgrades rule 4 reads there), each slot whose flag
turned (into the same slot; until the read lands the compute waits for it, as for any read).
So which copy computes a use is the step's decision, never the wall clock's: decisions and counters
equal the replay's, only the time a read takes is this machine's.

:class:`MixedExperts` is the experts call of one layer over such slots: it splits the call's (token,
slot) pairs by the copy each slot holds and adds the two calls (the high copy's implementation: the
model's own at the model dtype, :func:`~moecast.runtime.tiers.precision.quantized_experts_forward`
at int8; the low copy's: the quantized one). The CPU set's experts are read at the low copy, so a
call on anything but the slots computes at the low copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from moecast.runtime.core.mixed import bytes_by_copy
from moecast.runtime.core.step import LayerStep
from moecast.runtime.tiers.expert_store import SlotView
from moecast.runtime.tiers.precision import Precision, TwoCopies, quantized_experts_forward


def _impl(prec: Precision, model_impl: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The experts call for one copy: the model's own at its dtype, else the precision's kernels."""
    return functools.partial(quantized_experts_forward, prec) if prec.quantized else model_impl


class MixedExperts:
    """One layer's experts call over slots that hold either copy (module docstring)."""

    def __init__(
        self, store: Any, high: Callable[..., torch.Tensor], low: Callable[..., torch.Tensor]
    ) -> None:
        self.store, self.high, self.low = store, high, low

    def __call__(
        self, view: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        st = self.store
        if object.__getattribute__(view, "_tensors") is not st.slots:  # the CPU set's wave: the low copy
            return self.low(view, hidden, index, weights, **kwargs)
        if not st.slot_low.any():  # every slot high: the call as the one-precision runtime makes it
            return self.high(view, hidden, index, weights, **kwargs)
        num = int(view.num_experts)
        # slot -> its copy, the sentinel (``num``: computed elsewhere) neither
        low_of = torch.from_numpy(np.append(st.slot_low, False)).to(index.device)
        is_low = low_of[index.clamp(0, num)]
        used = index < num
        n_low, n_used = int((is_low & used).sum()), int(used.sum())
        module = object.__getattribute__(view, "_module")
        low_view = SlotView(module, st.low_slots, num, True)
        if n_low == 0:
            return self.high(view, hidden, index, weights, **kwargs)
        if n_low == n_used:
            return self.low(low_view, hidden, index, weights, **kwargs)
        sentinel = torch.full_like(index, num)
        out = self.high(
            SlotView(module, st.slots, num, True),
            hidden,
            torch.where(is_low, sentinel, index),
            weights,
            **kwargs,
        )
        return out + self.low(low_view, hidden, torch.where(is_low, index, sentinel), weights, **kwargs)


class SlotCopies:
    """The live runtime's two copies: the disk tier's ``stores`` follow ``step``'s flags (one lane
    per MoE layer), and their experts calls compute each slot at its copy."""

    def __init__(self, step: LayerStep, stores: list[Any], setting: TwoCopies) -> None:
        self.step, self.stores, self.setting = step, stores, setting
        for pos, st in enumerate(stores):
            st.follow(step.low[pos, : st.num_experts])  # a view: the store reads the flags as they are now

    def impls(self, model_impls: list[Callable[..., torch.Tensor]]) -> list[Callable[..., torch.Tensor]]:
        """Each layer's experts call over its slots, from the model's own (``model_impls``)."""
        s = self.setting
        return [
            MixedExperts(st, _impl(s.high, impl), _impl(s.low, impl))
            for st, impl in zip(self.stores, model_impls)
        ]

    def mark(self, pos: int, experts: np.ndarray, low: bool) -> None:
        """Experts a caller reads itself, not the step: a plan's preload (the high copy, as the replay's
        ``set_copy``), or loads streamed through the slots in waves (demand loads: the low copy)."""
        self.step.low[pos, experts] = low

    def sync(self, pos: int) -> None:
        """Reread layer ``pos``'s slots whose expert's flag turned while it was resident (upgrades)."""
        self.stores[pos].sync()

    def upgrade_ahead(self, pos: int) -> None:
        """No prefetch reaches layer ``pos`` (a layer past the last: none): the upgrades its window
        holds are decided and read now, as the window opens (mixed.py, rule 4), not at its step,
        behind its own demand loads (a prefetch's upgrades go with it, after the step's prefetch)."""
        if pos < len(self.stores):
            lane = np.array([pos])
            self.step.upgrade_quiet(lane, lane)
            self.sync(pos)

    def figures(self) -> dict[str, Any]:
        """The step's two-copy counters as the replay reports them: the share of routed uses computed at
        the low copy, the upgrades, and the bytes each copy moved (modeled, from the step's counts)."""
        t = self.step.stats
        cost, low = self.step.cost, self.step.demand
        moved = bytes_by_copy(t, cost.expert_bytes, low.expert_bytes)
        uses = float(t["uses"].sum())
        return {
            "low_share": float(t["low_uses"].sum() / uses) if uses else float("nan"),
            "low_uses": int(t["low_uses"].sum()),
            "upgrades": int(t["upgrades"].sum()),
            "prefetches_low": int(t["pf_low"].sum()),
            "bytes_by_copy": {self.setting.tag: moved["high"], self.setting.low.tag: moved["low"]},
            "low_expert_bytes": int(low.expert_bytes),
        }
