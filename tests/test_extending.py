"""docs/adding-a-policy.md's example, run: an eviction policy added as one row of the eviction table and
one preset reaches the replay and the live runtime (uncompiled until it has a kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moecast.runtime.core import eviction
from moecast.runtime.core.policy import POLICIES, Policy
from moecast.runtime.replay.engine import ReplayConfig, replay
from test_live import make_model
from test_replay_hand import _profile, _trace


def _mru(a: eviction.KeyArrays, rows: object, shift: int) -> np.ndarray:
    """Most recently used first: the latest access gets the lowest key."""
    return ((np.int64(1) << 40) - (a.last[rows] + 1)) << shift


@pytest.fixture
def mru(monkeypatch):
    """The two registrations: the eviction table's row (no kernel code yet), then the preset."""
    row = eviction.Eviction(_mru, None, fast_replay=False, reads=("last",))
    monkeypatch.setitem(eviction.TABLE, "mru", row)
    preset = Policy("mru", "mru", help="MRU eviction, misses loaded on demand")
    monkeypatch.setitem(POLICIES, "mru", preset)
    return preset


# one layer, top-2, capacity 3: t0 {0,1}, t1 {0,2}, t2 {3,4}, t3 {1,5}
ROUTES = [[[0, 1]], [[0, 2]], [[3, 4]], [[1, 5]]]


def test_a_new_eviction_policy_replays_by_hand(tmp_path, mru):
    """t1 hits 0 under both. t2 evicts two of {0 (t1), 1 (t0), 2 (t1)}: LRU the oldest, 1 then 0,
    keeping {2, 3, 4}; MRU the newest, 0 then 2 (ties to the lower id), keeping {1, 3, 4}. t3 {1, 5}:
    LRU misses both, MRU hits 1. Hits of 8 uses: LRU 1, MRU 2."""
    got = {}
    for name in ("lru", "mru"):
        ts = _trace(tmp_path / name, ROUTES)
        got[name] = replay(
            ts, ReplayConfig(policy=name, capacity=3, cold=True, hardware=_profile(1.5))
        ).hit_rate
    assert got == pytest.approx({"lru": 1 / 8, "mru": 2 / 8})


def test_a_new_eviction_policy_runs_live_without_a_kernel(mru):
    from moecast.runtime.live.runtime import attach

    model = make_model("qwen2_moe")
    rt = attach(model, policy=mru, capacity=2, warm=False)
    try:
        assert not rt.step.compiled  # no kernel code: the numpy path
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))
        st = rt.stats()
        assert st["policy"] == "mru" and st["loads"] > 0
    finally:
        rt.detach()


def test_a_policy_registered_after_import_is_taken_by_name_live(mru):
    """Live's names were a snapshot taken at import: a preset registered later ran in replay but was
    refused by name in live. The names are read at the check."""
    from moecast.runtime.live.config import LiveConfig, live_policies

    assert "mru" in live_policies() and "belady" not in live_policies()
    assert LiveConfig(policy="mru").rule().eviction == "mru"


def test_live_refuses_any_policy_that_evicts_by_the_next_use(monkeypatch):
    """Live refused only the name belady: a new policy whose key reads ``nu`` (never set live) ran, every
    key "never", evicting by lowest id."""
    from moecast.runtime.live.config import LiveConfig

    from moecast.errors import InputError

    row = eviction.Eviction(eviction.TABLE["belady"].key, None, fast_replay=False, reads=("nu",))
    monkeypatch.setitem(eviction.TABLE, "far", row)
    monkeypatch.setitem(POLICIES, "far", Policy("far", "far", help="farthest next use"))
    for given in ("far", POLICIES["far"], "belady", Policy("belady2", "belady")):
        with pytest.raises(InputError, match=r"evicts by the future accesses .* replay bound"):
            LiveConfig(policy=given)
