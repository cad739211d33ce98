"""One spec (runtime/core/spec.py): the runtime's defaults are written once and read by the replay and
its commands; the replay builds its core only through ``build_core``; the batch-1 replay engine takes
its eviction keys from the eviction table."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import TraceSet
from moecast.runtime.core import eviction
from moecast.runtime.core import spec as core_spec
from moecast.runtime.core.cost_model import DEFAULT_HARDWARE, load_profile
from moecast.runtime.core.spec import DEFAULT, RuntimeSpec
from moecast.runtime.replay import commands
from moecast.runtime.replay.engine import ReplayConfig, replay, replay_capacities

SPEC_FIELDS = [f.name for f in dataclasses.fields(RuntimeSpec)]


@pytest.fixture
def ts(tmp_path):
    return TraceSet(make_synthetic_traceset(tmp_path / "s", num_requests=4, num_experts=8, tokens=16))


def _defaults(func) -> dict:
    return {n: p.default for n, p in inspect.signature(func).parameters.items()}


def test_replay_config_and_the_commands_take_the_specs_defaults():
    """A default written again in ReplayConfig or a command (and then changed on one side) fails here."""
    cfg = ReplayConfig()
    assert {n: getattr(cfg, n) for n in SPEC_FIELDS} == dataclasses.asdict(RuntimeSpec())
    for func in (commands.replay, commands.compare):
        got = _defaults(func)
        for name in ("hardware", "alpha", "predictor_ms", "group_size", "plan_weight", "batch_size", "cold"):
            want = getattr(cfg, name)
            assert got[name] == want, f"{func.__name__} --{name}"
    replay_d, compare_d = _defaults(commands.replay), _defaults(commands.compare)
    assert replay_d["policy"] == cfg.policy
    assert float(replay_d["capacity"]) == cfg.capacity
    assert replay_d["expert_dtype"] == cfg.expert_dtype and tuple(compare_d["expert_dtypes"]) == (
        cfg.expert_dtype,
    )


def test_the_default_policy_leaves_the_routing_exact(ts):
    """A first run substitutes nothing (alpha 0) and needs no predictor or router probabilities."""
    rule = DEFAULT.rule()
    assert not rule.substituting and rule.alpha == 0.0 and not rule.prefetches
    assert rule.eviction in eviction.FAST_REPLAY  # no router_probs, no next-use oracle needed
    res = replay(ts, ReplayConfig())
    assert res.config["policy"] == rule.name and res.substitution_rate == 0.0 and res.prefetches_issued == 0


def test_the_default_hardware_is_this_machines_profile_where_one_was_measured(ts, tmp_path, monkeypatch):
    """No hardware given: prescope-a100-pcie4 until `moecast profile` writes ``local``, then that one,
    in the replay as in the live runtime (cost_model.default_hardware)."""
    monkeypatch.setenv("MOECAST_HOME", str(tmp_path / "home"))
    before = replay(ts, ReplayConfig())
    assert before.config["hardware"] == DEFAULT_HARDWARE == "prescope-a100-pcie4"
    local = dataclasses.replace(load_profile("smoe-s2-4060ti"), name="local")
    (tmp_path / "home" / "hardware").mkdir(parents=True)
    (tmp_path / "home" / "hardware" / "local.yaml").write_text(local.to_yaml())
    after = replay(ts, ReplayConfig())
    assert after.config["hardware"] == "local"
    assert after.modeled_tpot_ms == replay(ts, ReplayConfig(hardware="smoe-s2-4060ti")).modeled_tpot_ms
    assert after.modeled_tpot_ms != before.modeled_tpot_ms
    assert RuntimeSpec().profile()[1] == "this machine's profile (moecast profile)"


@pytest.mark.parametrize("fast", [True, False])
def test_the_replay_builds_its_core_with_build_core(ts, monkeypatch, fast):
    """A core that build_core returns with one more ms of attention per layer is the one the replay
    runs: TPOT grows by L ms (demand-only LRU: every layer starts with its attention), in the fast
    engine and in the general one, whose step comes from Core.step."""
    real, calls, steps = core_spec.build_core, [], []

    def slower(spec, **kw):
        core = real(spec, **kw)
        calls.append(spec)
        return dataclasses.replace(core, cost=dataclasses.replace(core.cost, t_attn=core.cost.t_attn + 1.0))

    real_step = core_spec.Core.step

    def counted(self, *a, **kw):
        steps.append(1)
        return real_step(self, *a, **kw)

    cfg = ReplayConfig(policy="lru", capacity=3, fast=fast)
    base = replay(ts, cfg).modeled_tpot_ms
    monkeypatch.setattr(core_spec, "build_core", slower)
    monkeypatch.setattr(core_spec.Core, "step", counted)
    got = replay(ts, cfg)
    assert calls == [cfg]
    assert bool(steps) == (not fast)  # the fast engine reads the core's cost, builds no step
    assert got.modeled_tpot_ms == pytest.approx(base + ts.num_layers * 1.0)


@pytest.mark.parametrize("name", eviction.FAST_REPLAY)
def test_the_fast_engine_equals_the_general_one_for_every_fast_replay_eviction(ts, name):
    cfg = ReplayConfig(policy=name, cold=True)
    fast = replay_capacities(ts, cfg, [2, 3, 5])
    ref = replay_capacities(ts, dataclasses.replace(cfg, fast=False), [2, 3, 5])
    for a, b in zip(fast, ref, strict=True):
        assert a.hit_rate_per_layer == pytest.approx(b.hit_rate_per_layer)
        assert (a.loads, a.cpu_experts) == (b.loads, b.cpu_experts)
        assert a.modeled_tpot_ms == pytest.approx(b.modeled_tpot_ms)


def _planted(monkeypatch, name: str, like: str) -> None:
    """Plant policy ``like``'s key (and the state it reads) in the table's row ``name``."""
    rule = dataclasses.replace(
        eviction.TABLE[name], key=eviction.TABLE[like].key, reads=eviction.TABLE[like].reads
    )
    monkeypatch.setitem(eviction.TABLE, name, rule)


@pytest.mark.parametrize(
    ("name", "like", "predictor"),
    [("lfu", "lru", None), ("belady", "lru", None), ("lfu-prefetch", "lru", "oracle")],
)
def test_the_fast_engines_keys_are_the_tables(ts, monkeypatch, name, like, predictor):
    """With LRU's key planted in the lfu (or belady) row, the batch-1 engine (the demand-only
    simulation; the wavefront with prefetch) replays LRU: its keys are the table's, not its own."""
    hw = "gh200-nvlink-c2c"  # a link fast enough that prefetches land
    cfg = ReplayConfig(policy=name, predictor=predictor, hardware=hw)
    lru_cfg = dataclasses.replace(cfg, policy="prefetch" if predictor else "lru")
    caps = [3, 4, 5]

    def figures(c):
        return [(r.hit_rate_per_layer, r.loads, r.prefetches_landed) for r in replay_capacities(ts, c, caps)]

    own, lru = figures(cfg), figures(lru_cfg)
    assert own != lru  # the trace tells the two policies apart
    assert not predictor or all(f[2] > 0 for f in own)
    _planted(monkeypatch, name.removesuffix("-prefetch"), like)
    assert figures(cfg) == lru
    assert figures(dataclasses.replace(cfg, fast=False)) == lru


def test_the_wavefront_refuses_an_eviction_it_cannot_key():
    from moecast.runtime.replay.fastreplay import Wavefront

    topk = np.zeros((2, 1, 1), dtype=np.int64)
    with pytest.raises(ValueError, match="lru or lfu"):
        Wavefront(
            topk,
            np.array([2]),
            False,
            np.array([1]),
            4,
            None,
            "none",
            None,
            None,
            np.ones(2, bool),
            policy="belady",
        )


def test_the_live_runtime_takes_the_specs_defaults():
    """LiveConfig extends RuntimeSpec (capacity aside: attach keeps every expert resident unless
    told), and `moecast run` takes the commands' defaults from the spec."""
    from moecast.runtime.live.commands import run
    from moecast.runtime.live.runtime import LiveConfig

    assert issubclass(LiveConfig, RuntimeSpec)
    live = {f.name: f.default for f in dataclasses.fields(LiveConfig)}  # as declared, before __post_init__
    assert {n: live[n] for n in SPEC_FIELDS if n != "capacity"} == {
        n: v for n, v in dataclasses.asdict(RuntimeSpec()).items() if n != "capacity"
    }
    got = _defaults(run)
    assert got["policy"] == DEFAULT.policy and float(got["capacity"]) == DEFAULT.capacity
    for name in ("hardware", "alpha", "predictor_ms", "expert_dtype", "group_size"):
        assert got[name] == getattr(DEFAULT, name), f"run --{name}"


def test_live_builds_its_core_with_build_core(monkeypatch):
    from moecast.runtime.live.runtime import attach
    from test_live import make_model

    real, calls = core_spec.build_core, []

    def spy(spec, **kw):
        calls.append(spec)
        return real(spec, **kw)

    monkeypatch.setattr(core_spec, "build_core", spy)
    rt = attach(make_model("qwen2_moe"), capacity=2)
    try:
        assert calls == [rt.config] and rt.step.policy.name == DEFAULT.policy
    finally:
        rt.detach()


def test_the_defaults_are_the_ones_the_module_documents_and_argues_for():
    """The module docstring gives each default with its reason (``capacity = 0.25``: a quarter of the
    experts, the middle of the papers' sweeps; ``score_window = 8``: SMoE Eq. 3's n); a default changed
    in the dataclass alone would leave that reasoning describing another runtime."""
    import ast
    import re

    documented = {
        name: ast.literal_eval(value)
        for name, value in re.findall(r"``(\w+) = ([^`]+)``", core_spec.__doc__ or "")
        if name in SPEC_FIELDS
    }
    assert set(documented) == set(SPEC_FIELDS)
    assert dataclasses.asdict(RuntimeSpec()) == documented


#: a device profile whose figures make a load's time a sum by hand: 1e6 bytes of reference expert, a
#: link of 1 GB/s (1e6 bytes in 1 ms), and a dequantize of 0.5 ms at int8 and 0.25 ms at int4
DEQUANT = dataclasses.replace(
    load_profile("prescope-a100-pcie4"),
    name="by-hand",
    transfer_gbps=1.0,
    ref_expert_bytes=1_000_000,
    dequant_ms={"int8": 0.5, "int4-g128": 0.25},
    fast_tier="device",
)


def test_two_copies_cost_the_high_copy_as_the_step_and_the_low_one_as_a_demand_read():
    """int8+int4 of a 1e6-byte expert, moved as 500 kB (int8) and 250 kB (int4): a high copy's load is
    0.5 ms on the link + 0.5 ms dequantize = 1.0 ms; a low copy's 0.25 + 0.25 = 0.5 ms."""
    spec = RuntimeSpec(hardware=DEQUANT, expert_dtype="int8+int4")
    core = core_spec.build_core(
        spec, num_experts=8, num_layers=2, expert_bytes=1_000_000, link_bytes=500_000,
        low_link_bytes=250_000, prefetching=False,
    )  # fmt: skip
    assert (core.copies.high_tag, core.copies.low_tag, core.copies.tag) == (
        "int8",
        "int4-g128",
        "int8+int4-g128",
    )
    assert core.cost.t_io == pytest.approx(1.0) and core.cost.expert_bytes == 500_000
    assert core.copies.low.t_io == pytest.approx(0.5) and core.copies.low.expert_bytes == 250_000
    one = core_spec.build_core(
        RuntimeSpec(hardware=DEQUANT, expert_dtype="int4"), num_experts=8, num_layers=2,
        expert_bytes=1_000_000, link_bytes=250_000, prefetching=False,
    )  # fmt: skip
    assert one.copies is None and one.cost.t_io == pytest.approx(0.5)


def test_a_predictor_is_charged_only_where_the_run_prefetches():
    """A plan is made before decoding: a predictor given to a run that never prefetches costs nothing."""

    class Scorer:
        def metadata(self) -> dict:
            return {"predictor_ms": 0.7}

    kw = dict(num_experts=8, num_layers=2, expert_bytes=1_000_000, predictor=Scorer())
    spec = RuntimeSpec(hardware=DEQUANT)
    on = core_spec.build_core(spec, prefetching=True, **kw)
    off = core_spec.build_core(spec, prefetching=False, **kw)
    assert (on.predictor_ms, on.predictor_ms_from) == (0.7, "the checkpoint's header")
    assert (off.predictor_ms, off.predictor_ms_from) == (0.0, "no predictor")


def test_a_shared_cache_holds_every_layers_experts_and_a_layers_own_cache_one_layers():
    core = core_spec.build_core(
        RuntimeSpec(hardware=DEQUANT), num_experts=8, num_layers=3, expert_bytes=1_000_000, prefetching=False
    )
    stat_base = np.array([0, 3])  # two lanes, each its run of three layers' statistics
    assert core.step(4, stat_base, 6, shared=True).cache.N == 3 * 8
    assert core.step(4, stat_base, 6, shared=False).cache.N == 8
