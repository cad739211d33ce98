"""The host tier's layer store on the CPU (no device ops): its slot bookkeeping, a failed copy, the order
``load_many`` evicts in, and which tensors count as an expert's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moecast.runtime.tiers.expert_store import LayerStore, expert_params
from test_live import make_model
from torch import nn

# qwen2_moe of test_live: hidden 32, expert width 16, float32: gate-up [32, 32] and down [32, 16]
EXPERT_BYTES = (32 * 32 + 32 * 16) * 4  # 6144


def _store(slots: int = 2) -> LayerStore:
    return LayerStore(make_model("qwen2_moe").model.layers[0].mlp.experts, slots)


def test_a_store_needs_at_least_one_slot_and_at_most_every_expert():
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"num_slots must be between 1 and 8, got {bad}"):
            _store(bad)


def test_each_copy_counts_its_bytes_and_lands_the_experts_weights():
    store = _store()
    want = {k: v[5].clone() for k, v in expert_params(store.experts).items()}
    slot = store.load(5)
    store.load(2)
    assert (store.loads, store.link_bytes, store.bytes_moved) == (2, 2 * EXPERT_BYTES, 2 * EXPERT_BYTES)
    assert all(torch.equal(store.slots[k][slot], v) for k, v in want.items())


def test_a_failed_copy_leaves_its_slot_free():
    """The copy raised (a read error): the slot must not count as filled, or the store reports itself
    full with a slot that holds nothing, and the next load names an expert to evict that is not there."""
    store = _store()
    store.load(1)
    copy = store._copy

    def broken(expert: int, slot: int, prefetch: bool = False) -> None:
        raise OSError("read failed")

    store._copy = broken
    with pytest.raises(OSError, match="read failed"):
        store.load(4)
    store._copy = copy
    assert store.free_slot() is not None and store.slot_of[4] == -1
    slot = store.load(4)  # into the free slot, with nothing evicted
    assert store.expert_in.tolist() == [1, 4] and slot == 1


def test_load_many_evicts_in_the_order_given():
    """The runtime lists the victims in its policy's order: the first named leaves first."""
    store = _store()
    store.fill([0, 1])
    store.load_many([6], evict=[1, 0])
    assert store.slot_of[1] == -1 and store.slot_of[0] == 0 and store.slot_of[6] == 1


def test_only_the_tensors_indexed_by_expert_are_an_experts_weights():
    """A tensor shared by the experts (first dimension not the expert count) is no part of any slot."""

    class Experts(nn.Module):
        num_experts = 4

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 3, 2))
            self.shared = nn.Parameter(torch.zeros(5))
            self.register_buffer("scale", torch.ones(4, 3))
            self.register_buffer("scalar", torch.tensor(1.0))

    assert sorted(expert_params(Experts())) == ["scale", "w"]


def test_a_preload_evicts_only_residents_it_does_not_want():
    """A plan's preload of layer 0 to hold {0, 5} over residents [0, 1]: it loads 5 into 1's slot, and
    keeps 0 (evicting 0 first, the slot order, would leave {1, 5} and 0 to a demand read)."""
    from moecast.runtime.live.runtime import attach

    model = make_model("qwen2_moe")
    rt = attach(model, policy="lru", capacity=2, warm=False)
    try:
        ex = rt.executor
        ex.stores[0].fill([0, 1])
        assert ex.preload(0, np.array([0, 5])) == 1
        assert ex.stores[0].expert_in.tolist() == [0, 5]
    finally:
        rt.detach()
