"""What the live runtime accepts (runtime/live/config.py): LiveConfig's refusals, each one line, its
balance override and alpha rule, and live_config's settings over a given config."""

from __future__ import annotations

import math

import pytest
from moecast.runtime.core.policy import DEFAULT_ALPHA
from moecast.runtime.live.config import LiveConfig, live_config

from moecast.errors import InputError


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (dict(io_threads=0), "io_threads must be at least 1, got 0"),
        (dict(pinned_mb=-1.0), "pinned_mb must be a size in MB >= 0, got -1.0"),
        (dict(pinned_mb=math.inf), "pinned_mb must be a size in MB >= 0, got inf"),
        (dict(pinned_mb=math.nan), "pinned_mb must be a size in MB >= 0, got nan"),
        (dict(prefetch="oracle"), "unknown prefetch 'oracle'; choose one of auto, none, online, predictor"),
        (dict(balance="none"), "unknown balance 'none'; choose one of smoe, presched, load, cpu"),
        (dict(policy="belady"), "it is a replay bound (moecast replay --policy belady)"),
    ],
    ids=["no-io-threads", "negative-pin", "infinite-pin", "nan-pin", "prefetch", "balance", "belady"],
)
def test_a_setting_the_runtime_cannot_take_is_refused_in_one_line(settings, needle):
    with pytest.raises(InputError) as info:
        LiveConfig(**settings)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_the_smallest_settings_that_mean_something_are_accepted():
    """One I/O thread reads the offload directory; pinned_mb 0 pins nothing beyond the staging buffers."""
    cfg = LiveConfig(io_threads=1, pinned_mb=0.0)
    assert (cfg.io_threads, cfg.pinned_mb) == (1, 0.0)


@pytest.mark.parametrize(
    ("policy", "balance", "balancer"),
    [("smoe", "load", "none"), ("smoe", "cpu", "cpu"), ("lru", "smoe", "smoe"), ("static", None, "cpu")],
)
def test_balance_overrides_the_policys_balancer_and_load_is_the_vocabularys_none(policy, balance, balancer):
    rule = LiveConfig(policy=policy, balance=balance).rule()
    assert rule.balancer == balancer and rule.name == policy


def test_alpha_is_resolved_at_construction_by_the_replays_rule():
    assert LiveConfig(policy="smoe").alpha == DEFAULT_ALPHA == 0.3
    assert LiveConfig(policy="lru").alpha == 0.0
    assert LiveConfig(policy="smoe", alpha=0.1).alpha == 0.1


def test_settings_apply_over_the_given_config_and_an_unknown_one_is_refused():
    base = LiveConfig(policy="lfu", capacity=3, io_threads=4)
    got = live_config(base, {"warm": False})
    assert (got.policy, got.capacity, got.io_threads, got.warm) == ("lfu", 3, 4, False)
    assert base.warm  # the given config is left as it was
    fresh = live_config(None, {"capacity": 5})
    assert (fresh.policy, fresh.capacity) == ("lru", 5)
    with pytest.raises(
        InputError, match="unknown live runtime setting cache_size, speed; LiveConfig's fields"
    ):
        live_config(base, {"speed": 1, "cache_size": 2})
