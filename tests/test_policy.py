"""Runtime policies: presets, the one alpha rule, refusals."""

from __future__ import annotations

import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import TraceSet
from moecast.runtime.core.policy import (
    DEFAULT_ALPHA,
    POLICIES,
    Policy,
    get_policy,
    resolve_alpha,
    substitutes,
)
from moecast.runtime.replay.engine import ReplayConfig, replay

#: the shipped presets, each as its paper has it
SHIPPED = {
    "lru": ("lru", "none", "none", "none"),
    "lfu": ("lfu", "none", "none", "none"),
    "score": ("score", "none", "none", "none"),
    "static": ("static", "cpu", "none", "none"),
    "belady": ("belady", "none", "none", "none"),
    "prefetch": ("lru", "none", "predictor", "none"),
    "lfu-prefetch": ("lfu", "none", "predictor", "none"),
    "prefetch-late": ("lru", "none", "predictor", "none"),
    "prefetch-gated": ("lru", "none", "predictor", "none"),
    "presched": ("lru", "presched", "predictor", "hot"),
    "smoe": ("score", "smoe", "predictor", "none"),
}


def test_presets_name_the_papers_choices():
    # a preset added beside them (docs/adding-a-policy.md) leaves this test alone
    got = {n: (p.eviction, p.balancer, p.prefetch, p.preload) for n, p in POLICIES.items()}
    assert {n: got.get(n) for n in SHIPPED} == SHIPPED


def test_which_presets_substitute_and_prefetch_late():
    assert [n for n in POLICIES if substitutes(n)] == ["smoe"]
    assert not substitutes("no-such-policy")
    assert [n for n, p in POLICIES.items() if p.late_prefetch] == ["prefetch-late", "prefetch-gated"]
    assert [n for n, p in POLICIES.items() if p.gate != "none"] == ["prefetch-gated"]


def test_late_prefetch_needs_a_prefetch_of_its_own():
    from moecast.runtime.core.policy import Policy

    for kw in (dict(), dict(prefetch="predictor", balancer="presched")):
        with pytest.raises(ValueError, match="late_prefetch needs prefetch predictor"):
            Policy("x", "lru", late_prefetch=True, **kw)


def test_the_gate_needs_a_prefetch_and_a_known_rule():
    from moecast.runtime.core.policy import Policy

    with pytest.raises(ValueError, match="gate calibrated gates prefetches; it needs prefetch predictor"):
        Policy("x", "lru", gate="calibrated")
    with pytest.raises(ValueError, match="unknown gate 'always'"):
        Policy("x", "lru", prefetch="predictor", gate="always")


def test_alpha_defaults_only_where_the_policy_substitutes():
    assert resolve_alpha(None, True) == DEFAULT_ALPHA == 0.3
    assert resolve_alpha(None, False) == 0.0
    assert resolve_alpha(0.1, True) == 0.1
    assert get_policy("smoe").alpha == 0.3 and get_policy("smoe").substituting
    assert get_policy("smoe", 0.0).alpha == 0.0 and not get_policy("smoe", 0.0).substituting
    assert get_policy("lru").alpha == 0.0
    with pytest.raises(ValueError, match="alpha applies to substitution, which policy 'lru' does not use"):
        get_policy("lru", 0.2)
    for bad in (-0.1, 1.0, 5.0, float("nan"), float("inf")):  # replay and live alike (run refused 1.5)
        with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\) \(SMoE's substitution threshold\)"):
            get_policy("smoe", bad)


def test_unknown_names_are_one_line():
    with pytest.raises(ValueError, match="unknown policy 'fifo'; choose one of lru, lfu"):
        get_policy("fifo")
    with pytest.raises(ValueError, match="unknown balancer 'greedy'"):
        Policy("x", "lru", balancer="greedy")
    with pytest.raises(ValueError, match="unknown eviction 'fifo'"):
        Policy("x", "fifo")


def test_replay_config_takes_the_policy_default_alpha(tmp_path):
    """ReplayConfig(policy="smoe") substitutes as `moecast replay --policy smoe` does (alpha 0.3)."""
    ts = TraceSet(make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2, tokens=12))
    cfg = dict(policy="smoe", predictor="none", capacity=3, batch_size=2)
    default = replay(ts, ReplayConfig(**cfg))
    assert default.config["alpha"] == DEFAULT_ALPHA
    assert default.to_json() == {
        **replay(ts, ReplayConfig(**cfg, alpha=0.3)).to_json(),
        "wall_s": default.wall_s,
    }
    assert replay(ts, ReplayConfig(**cfg, alpha=0.0)).substitution_rate == 0.0
    # a Policy value is accepted in place of a preset name
    own = Policy("lru-presched", "lru", balancer="presched")
    r = replay(ts, ReplayConfig(policy=own, capacity=3, predictor="none"))
    assert r.config["policy"] == "lru-presched" and r.config["balancer"] == "presched"
    # balancer cpu: a decode step loads nothing, so an empty cache stays empty and every use runs on
    # the CPU (prefill would load what it needs)
    dec = TraceSet(make_synthetic_traceset(tmp_path / "d", num_experts=8, top_k=2, tokens=12, decode_from=0))
    cpu = replay(dec, ReplayConfig(policy=Policy("cpu", "lru", balancer="cpu"), capacity=3, cold=True))
    assert cpu.loads == 0 and cpu.hit_rate == 0.0 and cpu.cpu_experts == cpu.accesses


def test_a_policy_value_keeps_its_own_alpha_unless_one_is_given():
    """A Policy passed whole (LiveConfig(policy=Policy(...)), a contributor's preset) runs at the alpha
    it carries; the smoe preset itself carries SMoE's default, so passing it whole substitutes as
    naming it does."""
    mine = Policy("mine", "score", substitutes=True, alpha=0.1)
    assert get_policy(mine).alpha == 0.1 and get_policy(mine, 0.2).alpha == 0.2
    assert get_policy(POLICIES["smoe"]).alpha == DEFAULT_ALPHA == get_policy("smoe").alpha
    assert get_policy(POLICIES["smoe"]).substituting


def test_policy_names_split_the_presets_by_whether_they_prefetch():
    from moecast.runtime.core.policy import policy_names

    assert policy_names(False)[:5] == ["lru", "lfu", "score", "static", "belady"]
    assert policy_names(True)[:6] == [
        "prefetch",
        "lfu-prefetch",
        "prefetch-late",
        "prefetch-gated",
        "presched",
        "smoe",
    ]
    assert sorted(policy_names(False) + policy_names(True)) == sorted(POLICIES) == sorted(policy_names())
    assert "belady" not in policy_names(False, exclude=("belady",))
