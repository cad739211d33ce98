"""Replay timing rules pinned by hand: when each prefetch lands, which loads are demand loads, the
per-layer time and the modeled TPOT, on traces small enough to follow on paper.

Every figure below is worked out in the comments from the rules of runtime/core/step.py's docstring,
not from either engine, and both engines (the general one and the batch-1 one) must reproduce it.
The cost model makes the arithmetic exact: one transfer t_io = 1 ms, one device expert t_g = 0.25 ms,
attention t_attn = 1.5 ms (0.5 ms in the second trace), top-2 of 8 experts, 2 layers, 2 experts per
layer resident, every token a decode step:

    layer_t = t_attn + max(n_dev * t_g, delay + n_load * t_io + t_g [n_load > 0], t_cpu)
    window of layer 1 = layer_t(0) - max(link(0), t_pred);  window of layer 0 = t_attn - t_pred
    prefetches that land = floor(window / t_io)

With one transfer slot more than the window holds (each prefetch landing one transfer late), every
test of a prefetch here fails; so does a prefetch started at layer 0 that cannot land.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_record, synthetic_writer
from moecast.collect.traceset import TraceSet
from moecast.runtime.core.cost_model import CostModel, HardwareProfile
from moecast.runtime.core.policy import Policy
from moecast.runtime.replay.engine import ReplayConfig, replay

EXPERT_BYTES = 3 * 16 * 32 * 2  # the synthetic model's expert size (conftest.synthetic_writer)


def _profile(attn_ms: float, cpu_c_ms: float = 100.0, **tiers: str) -> HardwareProfile:
    return HardwareProfile(
        name="hand",
        transfer_gbps=EXPERT_BYTES / 1e6,  # one expert per ms
        ref_expert_bytes=EXPERT_BYTES,
        gpu_expert_ms=0.25,
        cpu_beta_ms=0.0,
        cpu_c_ms=cpu_c_ms,
        attn_ms=attn_ms,
        **tiers,
    )


def _trace(path: Path, routes: list[list[list[int]]], decode: list[bool] | None = None) -> TraceSet:
    """One request whose token t routes to routes[t][layer] (top-2 of 8 experts, 2 layers)."""
    ids = np.array(routes)
    w = synthetic_writer(path, num_layers=ids.shape[1], num_experts=8, top_k=2, with_optional=False)
    phases = np.ones(len(ids), bool) if decode is None else np.array(decode)
    w.write([synthetic_record(0, np.arange(len(ids)), ids, phases)])
    return TraceSet(path)


# token t: [layer 0 experts, layer 1 experts]
ROUTES_A = [[[0, 1], [2, 3]], [[0, 4], [2, 5]], [[4, 6], [3, 5]]]
ROUTES_B = [[[0, 1], [2, 3]], [[0, 1], [4, 5]], [[0, 2], [4, 6]]]


def test_profile_gives_the_round_numbers():
    c = CostModel.from_profile(_profile(1.5), EXPERT_BYTES)
    assert (c.t_io, c.t_g, c.t_attn) == pytest.approx((1.0, 0.25, 1.5))


def _run(ts: TraceSet, fast: bool, policy: str | Policy = "prefetch", **kw) -> object:
    cfg = dict(policy=policy, capacity=2, cold=True, fast=fast, hardware=_profile(1.5))
    if policy != "lru":
        cfg["predictor"] = "oracle"
    return replay(ts, ReplayConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("fast", [True, False])
def test_demand_loads_and_layer_times_without_prefetch(tmp_path, fast):
    """LRU on demand, trace A:
    t0: both layers load both experts: 1.5 + max(0.5, 2 + 0.25) = 3.75 each; step 7.5
    t1: L0 {0,1} -> {0,4}: hit 0, load 4 (evicts 1): 1.5 + max(0.5, 1.25) = 2.75; L1 {2,3} -> {2,5}:
        hit 2, load 5 (evicts 3): 2.75; step 5.5
    t2: L0 {0,4} -> {4,6}: hit 4, load 6; L1 {2,5} -> {3,5}: hit 5, load 3; step 5.5
    hits 4 / 12, demand loads 8, TPOT (7.5 + 5.5 + 5.5) / 3, per layer (3.75 + 2.75 + 2.75) / 3."""
    r = _run(_trace(tmp_path / "a", ROUTES_A), fast, "lru")
    assert r.hit_rate == pytest.approx(4 / 12) == r.decode_hit_rate
    # token 0 a prefill token: loaded on demand all the same; its 4 misses leave the decode hit rate
    dec = _run(_trace(tmp_path / "ad", ROUTES_A, decode=[False, True, True]), fast, "lru")
    assert (dec.hit_rate, dec.decode_hit_rate) == pytest.approx((4 / 12, 4 / 8))
    assert r.loads == 8 and r.prefetches_landed == 0 and r.cpu_experts == 0
    assert r.modeled_tpot_ms == pytest.approx(18.5 / 3)
    assert r.layer_time_ms_per_layer == pytest.approx([9.25 / 3, 9.25 / 3])
    assert r.bytes_moved == 8 * EXPERT_BYTES
    # 1 ms after each step's last layer (the LM head): every step 1 ms longer, the layers the same
    hw = _profile(1.5)
    hw.step_ms = 1.0
    r = _run(_trace(tmp_path / "a2", ROUTES_A), fast, "lru", hardware=hw)
    assert r.modeled_tpot_ms == pytest.approx(18.5 / 3 + 1.0)
    assert r.layer_time_ms_per_layer == pytest.approx([9.25 / 3, 9.25 / 3])


@pytest.mark.parametrize("fast", [True, False])
def test_oracle_prefetch_lands_only_inside_the_window(tmp_path, fast):
    """Oracle prefetch, trace A, t_attn 1.5 (candidates: the true experts, lowest id first):
    t0 L0: window 1.5 -> 1 lands (0); access {0,1}: hit 0, load 1: link 1, 1.5 + max(0.5, 1.25) = 2.75
       L1: window 2.75 - 1 = 1.75 -> 1 lands (2); hit 2, load 3: 2.75; step 5.5
    t1 L0: window 1.5 -> 4 lands (evicts 1; 0 is predicted, shielded); hits 2, no load: 1.5 + 0.5 = 2.0
       L1: window 2.0 -> 5 lands (evicts 3); hits 2: 2.0; step 4.0
    t2 L0: 6 lands (evicts 0); hits 2: 2.0; L1: 3 lands (evicts 2); hits 2: 2.0; step 4.0
    hits 10 / 12, demand loads 2 (token 0), 6 prefetches issued, landed and used, TPOT 13.5 / 3."""
    r = _run(_trace(tmp_path / "a", ROUTES_A), fast)
    assert r.hit_rate == pytest.approx(10 / 12)
    assert r.hit_rate_per_layer == pytest.approx([5 / 6, 5 / 6])
    assert r.loads == 2
    assert (r.prefetches_issued, r.prefetches_landed) == (6, 6)
    assert r.prefetch_accuracy == 1.0
    assert r.modeled_tpot_ms == pytest.approx(4.5)
    assert r.layer_time_ms_per_layer == pytest.approx([6.75 / 3, 6.75 / 3])
    assert r.bytes_moved == (2 + 6) * EXPERT_BYTES


# each transfer's cost to the step beside it (t_rc): a read's compute time on the cores of a CPU fast tier
# over a disk, or the host's time to issue a copy to a device: (tiers, profile field, ms, TPOT, per layer)
TRANSFER_COSTS = {
    "reads on the cores": (
        {"fast_tier": "cpu", "slow_tier": "disk"},
        "read_cpu_ms",
        0.25,
        14.5 / 3,
        [7.5 / 3, 7.0 / 3],
    ),
    "copies issued by the host": ({}, "load_host_ms", 0.5, 16.75 / 3, [8.75 / 3, 8.0 / 3]),
}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("case", list(TRANSFER_COSTS))
def test_a_transfers_cost_slows_the_layer_it_runs_beside(tmp_path, fast, case):
    """test_oracle_prefetch_lands_only_inside_the_window's run where each transfer costs the step t_rc:
    a started prefetch adds it to the layer it prefetches for, whose attention it runs beside (and so to
    the window that layer leaves).

    Reads on the cores (the CPU the fast tier, the experts on a disk, t_rc = 0.25): a demand load
    adds it to the experts' work, which the link covers here.
    t0 L0: window 1.5 -> 0 lands (rc 0.25); hit 0, load 1: 1.5 + max(1.25, 0.5 + 0.25) + 0.25 = 3.0
       L1: window 3.0 - 1 = 2.0 -> 2 and 3 land (rc 0.5); hits 2: 1.5 + 0.5 + 0.5 = 2.5; step 5.5
    t1 L0: window 1.5 -> 4 lands (evicts 1); hits 2: 1.5 + 0.5 + 0.25 = 2.25
       L1: window 2.25 -> 5 lands (evicts 3); hits 2: 2.25; step 4.5
    t2: 6 and 3 land the same way: 4.5; TPOT 14.5 / 3 (4.5 without the reads' time).

    Copies issued by the host (a device, load_host_ms = 0.5): a demand load adds it after the experts
    (the host issues it before it launches anything else).
    t0 L0: window 1.5 -> 0 lands (rc 0.5); hit 0, load 1: 1.5 + max(0.5, 1 + 0.25) + 0.5 + 0.5 = 3.75
       L1: window 3.75 - 1 = 2.75 -> 2 and 3 land (rc 1.0); hits 2: 1.5 + 0.5 + 1.0 = 3.0; step 6.75
    t1 L0: window 1.5 -> 4 lands (evicts 1); hits 2: 1.5 + 0.5 + 0.5 = 2.5
       L1: window 2.5 -> 5 lands (evicts 3); hits 2: 2.5; step 5.0
    t2: 6 and 3 land the same way: 5.0; TPOT 16.75 / 3 (13.5 / 3 at no issue time).

    Both: hits 11 / 12, 1 demand load, 7 prefetches."""
    tiers, field, ms, tpot, per_layer = TRANSFER_COSTS[case]
    hw = _profile(1.5, **tiers)
    setattr(hw, field, ms)
    r = _run(_trace(tmp_path / "a", ROUTES_A), fast, hardware=hw)
    assert r.hit_rate == pytest.approx(11 / 12)
    assert r.loads == 1
    assert (r.prefetches_issued, r.prefetches_landed) == (7, 7)
    assert r.modeled_tpot_ms == pytest.approx(tpot)
    assert r.layer_time_ms_per_layer == pytest.approx(per_layer)
    assert r.bytes_moved == (1 + 7) * EXPERT_BYTES
    if field == "load_host_ms":
        # LRU on demand (test_demand_loads_and_layer_times_without_prefetch): its 8 loads add 0.5 each
        r = _run(_trace(tmp_path / "b", ROUTES_A), fast, "lru", hardware=hw)
        assert r.loads == 8 and r.modeled_tpot_ms == pytest.approx((18.5 + 8 * 0.5) / 3)


def test_the_issue_time_is_a_devices_per_copy_whatever_its_bytes():
    """load_host_ms is t_rc of a device fast tier over host memory, one per copy at any expert size or
    precision; a CPU fast tier issues no copy to a device (its t_rc is a read's share of the cores,
    or none), and a disk tier's I/O threads issue its copies, not the host's thread."""
    hw = _profile(1.5)
    hw.load_host_ms = 0.2
    assert CostModel.from_profile(hw, EXPERT_BYTES).t_rc == 0.2
    assert CostModel.from_profile(hw, 4 * EXPERT_BYTES, link_bytes=EXPERT_BYTES // 4).t_rc == 0.2
    for fast_tier, slow_tier in (("cpu", "host"), ("cpu", "disk"), ("device", "disk")):
        other = _profile(1.5, fast_tier=fast_tier, slow_tier=slow_tier)
        other.load_host_ms = 0.2
        assert CostModel.from_profile(other, EXPERT_BYTES).t_rc == 0.0


@pytest.mark.parametrize("fast", [True, False])
def test_the_window_is_what_the_previous_layer_leaves(tmp_path, fast):
    """Oracle prefetch, trace B, t_attn 0.5 and 4 experts per layer: layer 0's window (0.5) never
    holds a transfer; layer 1's is layer 0's time less its link.
    t0 L0: 2 loads: link 2, 0.5 + 2.25 = 2.75; L1: window 0.75 -> none; 2 loads: 2.75; step 5.5
    t1 L0: hits 2, link 0: 0.5 + 0.5 = 1.0; L1: window 1.0 -> exactly 1 lands (4); hit 4, load 5:
       0.5 + max(0.5, 1.25) = 1.75; step 2.75
    t2 L0: hit 0, load 2: 1.75; L1: window 0.75 -> none; hit 4, load 6 (evicts 2, the lower of the
       two least recent): 1.75; step 3.5
    hits 5 / 12, demand loads 7, 1 prefetch, TPOT 11.75 / 3, per layer 5.5 / 3 and 6.25 / 3."""
    r = _run(_trace(tmp_path / "b", ROUTES_B), fast, capacity=4, hardware=_profile(0.5))
    assert r.hit_rate == pytest.approx(5 / 12)
    assert r.hit_rate_per_layer == pytest.approx([3 / 6, 2 / 6])
    assert r.loads == 7
    assert (r.prefetches_issued, r.prefetches_landed) == (1, 1)
    assert r.modeled_tpot_ms == pytest.approx(11.75 / 3)
    assert r.layer_time_ms_per_layer == pytest.approx([5.5 / 3, 6.25 / 3])


@pytest.mark.parametrize("fast", [True, False])
def test_predictor_latency_comes_before_the_prefetch(tmp_path, fast):
    """Trace A with the predictor taking 0.6 ms per layer: layer 0's window is 1.5 - 0.6 = 0.9, so
    nothing lands there; layer 1's starts when both the prediction and layer 0's loads are done.
    t0 L0: 2 loads: 1.5 + 2.25 = 3.75; L1: window 3.75 - max(2, 0.6) = 1.75 -> 2 lands; hit 2,
       load 3: 2.75; step 6.5
    t1 L0: hit 0, load 4: link 1, 2.75; L1: window 2.75 - max(1, 0.6) = 1.75 -> 5 lands; hits 2: 2.0
    t2 L0: hit 4, load 6: 2.75; L1: window 1.75 -> 3 lands; hits 2: 2.0
    hits 7 / 12, demand loads 5, 3 prefetches, TPOT (6.5 + 4.75 + 4.75) / 3.
    Trace B with 0.3 ms: at t1 layer 0 has no load, yet layer 1's window is 1.0 - 0.3 = 0.7: none
    lands. Steps 5.5, 1.0 + 2.75, 1.75 + 1.75: hits 4 / 12, loads 8, TPOT 12.75 / 3."""
    r = _run(_trace(tmp_path / "a", ROUTES_A), fast, predictor_ms=0.6)
    assert r.hit_rate_per_layer == pytest.approx([2 / 6, 5 / 6])
    assert (r.loads, r.prefetches_landed) == (5, 3)
    assert r.modeled_tpot_ms == pytest.approx(16 / 3)
    assert r.predictor_ms == 0.6 and r.config["predictor_ms_from"] == "--predictor_ms"
    b = _run(_trace(tmp_path / "b", ROUTES_B), fast, capacity=4, hardware=_profile(0.5), predictor_ms=0.3)
    assert b.hit_rate == pytest.approx(4 / 12)
    assert (b.loads, b.prefetches_landed) == (8, 0)
    assert b.modeled_tpot_ms == pytest.approx(12.75 / 3)


@pytest.mark.parametrize("fast", [True, False])
def test_tpot_counts_decode_steps_only(tmp_path, fast):
    """Trace A with token 0 a prefill token (SMoE Sec. 4.1: no prefetch, every miss loaded): it loads
    all 4 experts, 3.75 ms per layer; tokens 1 and 2 then prefetch as in the timeline above (4.0 ms
    each). The TPOT is the mean of the decode steps, the per-layer times cover every step:
    (3.75 + 2.0 + 2.0) / 3 per layer; hits 8 / 12."""
    r = _run(_trace(tmp_path / "a", ROUTES_A, decode=[False, True, True]), fast)
    assert r.modeled_tpot_ms == pytest.approx(4.0)
    assert r.tpot_basis == "decode steps"
    assert r.layer_time_ms_per_layer == pytest.approx([7.75 / 3, 7.75 / 3])
    assert r.hit_rate == pytest.approx(8 / 12) and r.loads == 4
    assert r.decode_hit_rate == pytest.approx(8 / 8)  # the prefill token's 4 misses are not the TPOT's
    prefill = _run(_trace(tmp_path / "p", ROUTES_A, decode=[False] * 3), fast)
    assert prefill.decode_hit_rate == pytest.approx(prefill.hit_rate)  # every token is a step
    assert prefill.modeled_tpot_ms == pytest.approx(4.5)
    assert prefill.tpot_basis.startswith("every token as a step")


PRESCHED = Policy("presched-empty", "lru", balancer="presched", prefetch="predictor")


@pytest.mark.parametrize("fast", [True, False])
def test_presched_late_prefetch_and_no_prefetch_at_layer_0(tmp_path, fast):
    """PreSched (no hot table), one token [[0, 1], [2, 3]], t_attn 0.5, one CPU expert 2.125 ms:
    L0: no PreSched decision reaches a first layer, so only what fits in its window may start:
        0.5 // 1 = none. Eq. 5 on 2 misses, the i' of least max(T_G, T_C): i'=0: max(0 + 2 + 0.25,
        0) = 2.25; i'=1: max(1.25, 2.125) = 2.125; i'=2: 4.25 -> load 0, CPU 1 (t_cpu 2.125).
        Eq. 6: gap 2.125 - 0 - 1 = 1.125, f = (1.125 + 0.5) / 1 = 1.625, |f| = 2,
        xi = 0.5 * 0.625 - 0.5 * 0.375 > 0 -> 2 prefetches for L1 (both of its experts).
        Time 0.5 + max(0.25, 1.25, 2.125) = 2.625; L1's window 2.625 - 1 = 1.625.
    L1: 2 asked, 1 fits: 2 lands, 3 is started and lands 2 - 1.625 = 0.375 ms after L1's experts
        start (not resident). Eq. 5 on one miss with delay 0.375: i'=0: max(0.375 + 1 + 0.25, 0) =
        1.625; i'=1: max(0.625, 2.125) = 2.125 -> 3 loads behind the late prefetch (the paper's
        literal "smallest i' with T_G < T_C" ran it on the CPU). Time 0.5 + max(0.25, 1.625) = 2.125.
    hits 1 / 4, demand loads 2, CPU experts 1, prefetches asked 2, landed 1, bytes moved 2 + 2
    transfers, TPOT 4.75.
    With a 2.25 ms CPU expert L0's i' = 0 and 1 tie at 2.25: the smaller i' loads both, Eq. 6's gap
    max(0 - 2, 0) = 0, f = 0.5, |f| = 1, xi = 0.5 * 0.5 - 0.5 * 0.5 = 0 -> no prefetch; L1 the same:
    4 loads, no CPU expert, 2.75 ms per layer."""
    ts = _trace(tmp_path / "c", [[[0, 1], [2, 3]]])
    r = _run(ts, fast, PRESCHED, hardware=_profile(0.5, cpu_c_ms=2.125))
    assert r.hit_rate_per_layer == pytest.approx([0.0, 0.5])
    assert (r.loads, r.cpu_experts) == (2, 1)
    assert (r.prefetches_issued, r.prefetches_landed) == (2, 1)
    assert r.bytes_moved == 4 * EXPERT_BYTES
    assert r.layer_time_ms_per_layer == pytest.approx([2.625, 2.125])
    assert r.modeled_tpot_ms == pytest.approx(4.75)
    tie = _run(ts, fast, PRESCHED, hardware=_profile(0.5, cpu_c_ms=2.25))
    assert (tie.loads, tie.cpu_experts, tie.prefetches_issued) == (4, 0, 0)
    assert tie.layer_time_ms_per_layer == pytest.approx([2.75, 2.75])


def test_a_started_late_prefetch_costs_its_issue_time_in_both_engines(tmp_path):
    """test_presched_late_prefetch_and_no_prefetch_at_layer_0's token, with each copy's issue time
    (load_host_ms, a device fast tier's t_rc) at 0.01 ms: L0's PreSched asks 2 prefetches for L1 and
    the window fits 1, so 2 start and 1 lands. Each started copy is issued, so L1 is charged 2 x 0.01
    for them whatever lands; the general engine's step charges it so (test_a_transfers_cost_slows_the_layer_it_runs_beside pins its
    rule by hand), and the fast engine must agree. Catches the fast engine charging landed copies."""
    ts = _trace(tmp_path / "c", [[[0, 1], [2, 3]]])
    hw = _profile(0.5, cpu_c_ms=2.125)
    hw.load_host_ms = 0.01
    general, fast = (_run(ts, f, PRESCHED, hardware=hw) for f in (False, True))
    assert (general.prefetches_issued, general.prefetches_landed) == (2, 1)
    assert fast.layer_time_ms_per_layer == pytest.approx(general.layer_time_ms_per_layer, abs=1e-12)
    assert fast.modeled_tpot_ms == pytest.approx(general.modeled_tpot_ms, abs=1e-12)
    free = _run(ts, False, PRESCHED, hardware=_profile(0.5, cpu_c_ms=2.125))
    assert general.modeled_tpot_ms > free.modeled_tpot_ms  # the issue time is charged at all


def test_cold_presched_reports_its_preload(tmp_path):
    """The presched preset starts each cold request from the hot-expert table: 2 experts x 2 layers
    = 4 transfers of 1 ms at each of the 1 request's starts, spread over its 3 steps."""
    r = _run(_trace(tmp_path / "a", ROUTES_A), False, "presched")
    assert r.preload_ms == pytest.approx(4.0)
    assert r.modeled_tpot_ms_with_preload == pytest.approx(r.modeled_tpot_ms + 4.0 / 3)
    assert _run(_trace(tmp_path / "b", ROUTES_A), False).modeled_tpot_ms_with_preload is None


def test_predictor_latency_from_the_cli_and_the_profile(tmp_path, capsys):
    """`moecast replay --predictor_ms` charges the given latency; left out, the hardware profile's;
    a negative one is refused in one line."""
    import json

    from moecast.runtime.core.cost_model import load_profile

    from moecast.cli import main

    _trace(tmp_path / "a", ROUTES_A)
    base = ["replay", "--traces", str(tmp_path / "a"), "--policy", "prefetch", "--capacity", "2", "--json"]

    def row(*extra: str) -> dict:
        assert main([*base, *extra]) in (None, 0)
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    given = row("--predictor_ms", "0.6")
    assert (given["predictor_ms"], given["predictor_ms_from"]) == (0.6, "--predictor_ms")
    default = row()
    assert default["predictor_ms"] == load_profile("prescope-a100-pcie4").predictor_ms == 0.06
    assert default["predictor_ms_from"] == "hardware profile prescope-a100-pcie4"
    assert row("--predictor", "none")["predictor_ms"] == 0.0
    with pytest.raises(SystemExit) as exc:
        main([*base, "--predictor_ms", "-1"])
    msg = str(exc.value.code)
    assert len(msg.splitlines()) == 1 and "--predictor_ms must be a finite number of ms >= 0" in msg


@pytest.mark.parametrize("fast", [True, False])
def test_prefill_loads_what_it_needs(tmp_path, fast):
    """A balancer that sends every miss to the CPU (0.5 ms each), trace A with token 0 in prefill:
    t0 (prefill) loads its 4 experts: 3.75 ms per layer;
    t1: L0 {0,1} -> {0,4}: hit 0, 4 on the CPU: 1.5 + max(0.25, 0.5) = 2.0; L1 {2,3} -> {2,5}: 2.0
    t2: L0 {0,1} -> {4,6}: both on the CPU: 1.5 + 1.0 = 2.5; L1 {2,3} -> {3,5}: hit 3: 2.0
    hits 3 / 12, demand loads 4, CPU experts 5, TPOT (4.0 + 4.5) / 2."""
    cpu = Policy("cpu", "lru", balancer="cpu")
    ts = _trace(tmp_path / "a", ROUTES_A, decode=[False, True, True])
    r = replay(ts, ReplayConfig(policy=cpu, capacity=2, cold=True, fast=fast, hardware=_profile(1.5, 0.5)))
    assert r.hit_rate == pytest.approx(3 / 12)
    assert r.decode_hit_rate == pytest.approx(3 / 8)  # t1's hits 0 and 2, t2's 3, of the decode steps' 8 uses
    assert (r.loads, r.cpu_experts) == (4, 5)
    assert r.modeled_tpot_ms == pytest.approx(4.25)
    assert r.layer_time_ms_per_layer == pytest.approx([8.25 / 3, 7.75 / 3])


TIERS_CASES = {
    # (fast_tier, slow_tier): (TPOT, per-layer mean), worked out in the test's docstring
    ("device", "host"): (4.25, [8.25 / 3, 7.75 / 3]),
    ("cpu", "host"): (4.625, [8.5 / 3, 8.25 / 3]),
    ("device", "disk"): (6.5, [10.75 / 3, 9.75 / 3]),
}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("tiers", list(TIERS_CASES))
def test_cpu_set_on_the_profile_tiers(tmp_path, fast, tiers):
    """test_prefill_loads_what_it_needs's run (every decode miss on the CPU, C = 0.5 ms) on each tier:
    t0 (prefill) loads its 4 experts: 3.75 ms per layer on every tier.
    device/host: the CPU set overlaps the device: t1 2.0 + 2.0, t2 2.5 + 2.0: TPOT 4.25.
    cpu/host: the same cores, so times add: t1 L0 hit 0 (0.25) + 4 on the CPU (0.5) = 1.5 + 0.75 =
        2.25, L1 hit 2 + 5 on the CPU: 2.25; t2 L0 {4,6} on the CPU: 1.5 + 1.0 = 2.5, L1 hit 3 + 5:
        2.25: TPOT (4.5 + 4.75) / 2 = 4.625.
    device/disk: each CPU expert is read first (1 ms each, serial) and computes once read: t1 L0
        max(0.25, 1 + 0.5) = 1.5: 3.0, L1 3.0; t2 L0 reads at 1 and 2, computes 1..1.5, 2..2.5:
        max(1 + 1.0, 2 + 0.5) = 2.5: 4.0, L1 one read: 3.0: TPOT (6.0 + 7.0) / 2."""
    fast_tier, slow_tier = tiers
    cpu = Policy("cpu", "lru", balancer="cpu")
    ts = _trace(tmp_path / "a", ROUTES_A, decode=[False, True, True])
    hw = _profile(1.5, 0.5, fast_tier=fast_tier, slow_tier=slow_tier)
    r = replay(ts, ReplayConfig(policy=cpu, capacity=2, cold=True, fast=fast, hardware=hw))
    tpot, per_layer = TIERS_CASES[tiers]
    assert (r.loads, r.cpu_experts) == (4, 5)
    assert r.modeled_tpot_ms == pytest.approx(tpot)
    assert r.layer_time_ms_per_layer == pytest.approx(per_layer)


@pytest.mark.parametrize(
    "fast_tier, slow_tier, want",
    [
        # 8 resident experts (2.0 ms) and one CPU expert (C 0.5) after no demand load
        ("device", "host", 1.5 + 2.0),  # max(2.0, 0.5)
        ("cpu", "host", 1.5 + 2.5),  # 2.0 + 0.5
        ("device", "disk", 1.5 + 2.0),  # max(2.0, 1 read + 0.5)
        ("cpu", "disk", 1.5 + 2.5),  # max(2.0 + 0.5, 1 read + 0.5)
    ],
)
def test_layer_time_on_each_tier_by_hand(fast_tier, slow_tier, want):
    """step.layer_time and its compiled twin on one row: link 1 ms per read, t_g 0.25, C 0.5."""
    from moecast.runtime.core import step_kernels as sk
    from moecast.runtime.core.step import layer_time

    c = CostModel.from_profile(_profile(1.5, 0.5, fast_tier=fast_tier, slow_tier=slow_tier), EXPERT_BYTES)
    layer_t, link = layer_time(c, np.array([8]), np.array([0]), 0.0, np.array([0.5]), np.array([1]))
    assert layer_t[0] == pytest.approx(want)
    assert link[0] == pytest.approx(1.0 if slow_tier == "disk" else 0.0)  # the next prefetch waits for it
    fcost = sk.fcost_of(c)
    assert sk.layer_time(fcost, 8, 0, 0.0, 0.5, 1, 0.0) == (layer_t[0], link[0])


def test_reads_take_their_compute_time_from_the_layers_experts():
    """CPU fast tier over a disk, t_rc = 0.5 ms per read: 6 resident experts (1.5 ms), one demand
    load and one CPU expert (C 0.5) read behind it (link 2; its expert computes 2..2.5). The cores
    owe 1.5 + 0.5 and both reads' 1.0: the expert phase is 3.0, not 2.5: layer 1.5 + 3.0."""
    from moecast.runtime.core import step_kernels as sk
    from moecast.runtime.core.step import layer_time

    hw = _profile(1.5, 0.5, fast_tier="cpu", slow_tier="disk")
    for read_cpu_ms, want in ((0.0, 4.0), (0.5, 4.5)):
        hw.read_cpu_ms = read_cpu_ms
        c = CostModel.from_profile(hw, EXPERT_BYTES)
        layer_t, link = layer_time(c, np.array([6]), np.array([1]), 0.0, np.array([0.5]), np.array([1]))
        assert (layer_t[0], link[0]) == pytest.approx((want, 2.0))
        assert sk.layer_time(sk.fcost_of(c), 6, 1, 0.0, 0.5, 1, 0.0) == (layer_t[0], link[0])
    # a device's copies and a host tier leave the cores alone
    for tiers in ({"fast_tier": "device", "slow_tier": "disk"}, {"fast_tier": "cpu", "slow_tier": "host"}):
        hw = _profile(1.5, 0.5, **tiers)
        hw.read_cpu_ms = 0.5
        assert CostModel.from_profile(hw, EXPERT_BYTES).t_rc == 0.0


def test_cpu_experts_on_a_disk_compute_as_their_reads_land():
    """Two demand loads, then three CPU experts (0.5 ms each) read behind them, 1 ms per read, one
    resident expert: the loads land at 2 (their last computes 2..2.25); the CPU reads land at 3, 4, 5
    and each computes once read, the last 5..5.5: device/disk layer 1.5 + 5.5. With the CPU as the
    fast tier the resident experts' 0.75 ms and the CPU's 1.5 ms add, which the reads still cover."""
    from moecast.runtime.core import step_kernels as sk
    from moecast.runtime.core.step import layer_time

    for fast_tier in ("device", "cpu"):
        c = CostModel.from_profile(_profile(1.5, 0.5, fast_tier=fast_tier, slow_tier="disk"), EXPERT_BYTES)
        args = (np.array([3]), np.array([2]), 0.0, np.array([1.5]), np.array([3]))
        layer_t, link = layer_time(c, *args)
        assert (layer_t[0], link[0]) == pytest.approx((7.0, 5.0))
        fcost = sk.fcost_of(c)
        assert sk.layer_time(fcost, 3, 2, 0.0, 1.5, 3, 0.0) == (layer_t[0], link[0])


@pytest.mark.parametrize("fast", [True, False])
def test_a_late_prefetch_lands_and_the_layer_waits_for_it(tmp_path, fast):
    """Oracle prefetch-late, trace B, t_attn 0.5, 4 experts per layer: one prefetch more than the
    window holds is started; it is resident, delays the link by what it still needs and its expert
    computes no sooner than that delay + t_g.
    t0 L0: window 0.5 holds none; 0 lands late by 0.5; hit 0, load 1: link 1.5, 0.5 + 1.75 = 2.25
       L1: window 2.25 - 1.5 = 0.75: 2 late by 0.25; hit 2, load 3: link 1.25, 0.5 + 1.5 = 2.0
    t1 L0: {0,1} resident, nothing to prefetch; hits 2: 1.0
       L1: window 1.0 holds 4, and 5 lands late by 1.0; hits 2, the stall 1.0 + 0.25: 1.75
    t2 L0: 2 late by 0.5; hits 2, stall 0.75: 1.25
       L1: window 1.25 - 0.5 = 0.75: 6 late by 0.25 (evicts 2); hits 2: max(0.5, 0.5): 1.0
    hits 10 / 12, demand loads 2, 6 prefetches landed, TPOT (4.25 + 2.75 + 2.25) / 3 (in-window
    prefetch: 11.75 / 3, test_the_window_is_what_the_previous_layer_leaves)."""
    ts = _trace(tmp_path / "b", ROUTES_B)
    r = _run(ts, fast, "prefetch-late", capacity=4, hardware=_profile(0.5))
    assert r.hit_rate == pytest.approx(10 / 12)
    assert r.loads == 2
    assert (r.prefetches_issued, r.prefetches_landed) == (6, 6)
    assert r.modeled_tpot_ms == pytest.approx(9.25 / 3)
    assert r.layer_time_ms_per_layer == pytest.approx([4.5 / 3, 4.75 / 3])


@pytest.mark.parametrize("fast", [True, False])
def test_a_quantized_tier_moves_its_own_bytes(tmp_path, fast):
    """LRU on demand, trace A, with the slow tier at int8 and int4 (the synthetic expert: hidden 16,
    intermediate 32, bf16: gate-up [64, 16] and down [16, 32], 3072 bytes):
    int8: 1024 + 512 weight bytes + a bf16 scale per output row (64 + 16 rows x 2) = 1696 bytes, so
    t_io = 1696 / 3072 = 53/96 ms. Layer times: t0 1.5 + 2 x 53/96 + 0.25, t1 and t2 1.5 + 53/96 + 0.25.
    int4-g32: gate-up's 16 inputs take one group per row (per channel), down's 32 one group of 32:
    512 + 256 weight bytes + bf16 (scale, zero) per row and group (64 x 4 + 16 x 4) = 1088 bytes,
    t_io = 17/48 ms. A capacity in bytes counts what a slot holds. Where experts compute on the CPU,
    the stored copy: 6KB (6144) holds 2 model-dtype experts, 3 int8 (5088) and 5 int4 (5440; 6 would be
    6528). On a device, a quantized copy is dequantized into a model-dtype slot: 2 at every precision."""
    ts = _trace(tmp_path / "a", ROUTES_A)
    r = _run(ts, fast, "lru", expert_dtype="int8")
    assert r.config["expert_dtype"] == "int8" and r.config["expert_bytes"] == 1696
    assert r.loads == 8 and r.bytes_moved == 8 * 1696
    assert r.modeled_tpot_ms == pytest.approx((2 * (1.75 + 2 * 53 / 96) + 4 * (1.75 + 53 / 96)) / 3)
    r = _run(ts, fast, "lru", expert_dtype="int4", group_size=32)
    assert r.config["expert_dtype"] == "int4-g32" and r.bytes_moved == 8 * 1088
    # the tag names its group, as run and eval-accuracy take it (replay once refused int4-g32)
    t = _run(ts, fast, "lru", expert_dtype="int4-g32")
    assert t.config["expert_dtype"] == "int4-g32" and t.bytes_moved == 8 * 1088
    assert r.modeled_tpot_ms == pytest.approx((2 * (1.75 + 2 * 17 / 48) + 4 * (1.75 + 17 / 48)) / 3)
    for fast_tier, want in (("cpu", (2, 3, 5)), ("device", (2, 2, 2))):
        hw = _profile(1.5, fast_tier=fast_tier)
        caps = tuple(
            _run(ts, fast, "lru", expert_dtype=dt, group_size=32, capacity="6KB", hardware=hw).config[
                "capacity"
            ]
            for dt in ("model", "int8", "int4")
        )
        assert caps == want, fast_tier


def test_a_layer_with_one_demand_load_by_hand_in_both_step_paths():
    """One device expert, one demand load, t_io 1, t_g 0.25, t_attn 1.5: the load's expert computes once
    it lands, so 1.5 + max(0.25, 1 + 0.25) = 2.75 ms, link 1; the compiled step and the numpy one."""
    from moecast.runtime.core import step_kernels as sk
    from moecast.runtime.core.step import layer_time

    c = CostModel(t_io=1.0, t_g=0.25, beta=0.0, c=0.5, t_attn=1.5, expert_bytes=1)
    assert sk.layer_time(sk.fcost_of(c), 1, 1, 0.0, 0.0, 0, 0.0) == (2.75, 1.0)
    lt, link = layer_time(c, np.array([1]), np.array([1]), 0.0, np.array([0.0]))
    assert (lt[0], link[0]) == (2.75, 1.0)


def test_the_substitution_rate_counts_decode_uses_only(tmp_path):
    """One layer, 8 experts, top-2, capacity 2, cold: the prefill token routes {0, 1} (loaded); the decode
    token routes {2, 3} with 2 on top (.40) and 3 below it (.16) and missing, 0 (.14) resident: 3 becomes
    0. One of the 2 decode uses substituted: 0.5 (0.25 if the prefill's uses counted); hits: the
    decode's 0 of 4 uses, 1 / 4."""
    probs = np.array([[[0.40, 0.30, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0]],
                      [[0.14, 0.05, 0.40, 0.16, 0.10, 0.05, 0.05, 0.05]]])  # fmt: skip
    ids = np.array([[[0, 1]], [[2, 3]]])
    w = synthetic_writer(tmp_path / "s", num_layers=1, num_experts=8, top_k=2, with_optional=True)
    w.write([synthetic_record(0, np.arange(2), ids, np.array([False, True]),
                              topk_weights=np.full((2, 1, 2), 0.5, np.float16),
                              router_probs=probs.astype(np.float16),
                              gate_inputs=np.zeros((2, 1, 16), np.float16))])  # fmt: skip
    pol = Policy("sub-lru", "lru", substitutes=True, alpha=0.5)
    r = replay(TraceSet(tmp_path / "s"), ReplayConfig(policy=pol, capacity=2, cold=True))
    assert r.substitution_rate == 0.5 and r.hit_rate == pytest.approx(1 / 4)


# A slot's bytes and the link's, by hand, for the synthetic expert (hidden 16, intermediate 32, bf16:
# gate-up [64, 16] and down [16, 32], 3072 bytes). int8: 1024 + 512 weight bytes + one bf16 scale per
# output row (64 + 16 rows x 2) = 1696; int4-g32: 512 + 256 + bf16 (scale, zero) per row and group
# (64 x 4 + 16 x 4) = 1088 (test_a_quantized_tier_moves_its_own_bytes).
INT8_BYTES, INT4_G32_BYTES = 1696, 1088


@pytest.mark.parametrize(
    "fast_tier, expert_dtype, link, slot",
    [
        ("device", "model", EXPERT_BYTES, EXPERT_BYTES),
        ("device", "int8", INT8_BYTES, EXPERT_BYTES),  # dequantized into a model-dtype slot
        ("device", "int4", INT4_G32_BYTES, EXPERT_BYTES),
        ("cpu", "int8", INT8_BYTES, INT8_BYTES),  # the CPU computes from the copy the link moved
        ("cpu", "int4", INT4_G32_BYTES, INT4_G32_BYTES),
        ("device", "int8+int4", INT8_BYTES, INT8_BYTES),  # two copies: a slot holds the high one
        ("cpu", "int8+int4", INT8_BYTES, INT8_BYTES),
        ("device", "mixed", EXPERT_BYTES, EXPERT_BYTES),  # model+int4
    ],
)
def test_a_slot_holds_what_its_fast_tier_computes_from(tmp_path, fast_tier, expert_dtype, link, slot):
    """A capacity in bytes divides by one slot's bytes (slot_bytes). test_a_quantized_tier_moves_its_own_bytes
    checks it through the capacities one precision at a time, through replay only; this pins the figure
    itself on every branch, two copies included: a device dequantizes one quantized copy into a slot of
    the model's dtype, the CPU keeps the copy the link moved, and under two copies a slot holds the high
    copy as it was moved. 6KB then holds 2 experts on a device at int8 (6144 // 3072), 3 under int8+int4
    (6144 // 1696)."""
    from moecast.runtime.replay.engine import expert_link_bytes, slot_bytes

    ts = _trace(tmp_path / "a", ROUTES_A)
    cfg = ReplayConfig(expert_dtype=expert_dtype, group_size=32)
    assert expert_link_bytes(ts, expert_dtype, 32) == link
    assert slot_bytes(ts, cfg, _profile(1.5, fast_tier=fast_tier), link) == slot
    if fast_tier == "device" and expert_dtype in ("int8", "int8+int4"):
        hw = _profile(1.5, fast_tier="device")
        r = _run(ts, True, "lru", expert_dtype=expert_dtype, group_size=32, capacity="6KB", hardware=hw)
        assert r.config["capacity"] == 6144 // slot


@pytest.mark.parametrize("recorded", ["int8", "int8 (bitsandbytes, as recorded by MoE-Beyond)"])
def test_a_precision_quantizes_bf16_weights_where_the_traces_recorded_no_float_dtype(tmp_path, recorded):
    """An import records how its source stored the weights (MoE-Beyond: bitsandbytes int8) while its
    expert_bytes are the model's bf16 ones: a precision then quantizes bf16 weights, whose scales are
    bf16 too. int8: 1024 + 512 weight bytes + 80 rows x 2 = 1696 (float32 scales would make it 1856);
    int4-g32: 768 + 160 (scale, zero) pairs x 2 x 2 bytes = 1088 (1408 at float32)."""
    from moecast.runtime.replay.engine import expert_link_bytes

    path = tmp_path / "a"
    _trace(path, ROUTES_A)
    meta = json.loads((path / "meta.json").read_text())
    meta["collection"]["dtype"] = recorded
    (path / "meta.json").write_text(json.dumps(meta))
    ts = TraceSet(path)
    assert expert_link_bytes(ts, "int8", 128) == INT8_BYTES
    assert expert_link_bytes(ts, "int4-g32", 128) == INT4_G32_BYTES
    assert expert_link_bytes(ts, "model", 128) == EXPERT_BYTES


# ------------------------------------------------------------------ the step's rules on tiny direct cases


def _hand_step(policy: Policy, cost: CostModel, lanes: int = 1, E: int = 8, capacity: int = 4):
    from moecast.runtime.core.cache import ExpertCache
    from moecast.runtime.core.step import LayerStep

    cache = ExpertCache(E, capacity, policy.eviction, lanes=lanes)
    return LayerStep(cache, policy, cost, E, 1, stat_base=np.zeros(lanes, np.int64), n_stats=1)


def test_a_window_that_is_a_decimal_multiple_of_t_io_fits_that_many():
    """Pins landing's guard against float division: a window of 0.3 ms at t_io 0.1 ms holds 3
    transfers, though 0.3 / 0.1 = 2.9999999999999996 in float64.

    By hand: 5 candidates, no PreSched count, balancer none: floor(3) = 3 land, 3 start, no delay.
    Catches ST7 (without the 1e-9 guard floor gives 2)."""
    from moecast.runtime.core.step import landing

    want, landed, started, delay = landing(np.array([5]), np.array([-1]), np.array([0.3]), 0.1, "none")
    assert (want[0], landed[0], started[0], delay[0]) == (3, 3, 3, 0.0)


def test_ranked_predictions_scale_each_token_before_merging():
    """Pins ranked_predictions dividing each token's scores by its own largest |score| before the
    tokens' top-k are merged by summed score (B > 1, the numpy path).

    By hand: token 0 [8, 6, 0, 0] -> [1, .75, 0, 0], top-2 {0: 1, 1: .75}; token 1 [0, 0, 1, .9] ->
    itself, top-2 {2: 1, 3: .9}. Merged: 0 and 2 tie at 1 (lower id first), then 3 (.9), 1 (.75):
    candidates [0, 2, 3, 1]. Catches ST21 (raw scores: 0 (8), 1 (6), 2 (1), 3 (.9) -> [0, 1, 2, 3])."""
    from moecast.runtime.core.step import ranked_predictions

    ids, cand = ranked_predictions(np.array([[8, 6, 0, 0], [0, 0, 1, 0.9]], np.float32), k=2)
    assert sorted(ids[0, :2].tolist()) == [0, 1] and sorted(ids[0, 2:].tolist()) == [2, 3]
    assert cand.tolist() == [[0, 2, 3, 1]]


def test_a_batched_layers_hits_count_token_uses():
    """Pins the hits statistic (the hit rate's numerator) counting token uses, not distinct experts,
    when a lane runs B > 1 tokens.

    By hand: LRU, capacity 4, expert 0 resident; B = 2 tokens route {0, 1} and {0, 2}: uses 4, of which
    expert 0's two are hits: hits 2 (hit rate 0.5). Catches ST10 (distinct resident experts: 1)."""
    cost = CostModel(t_io=1.0, t_g=0.25, beta=0.0, c=0.5, t_attn=1.5, expert_bytes=1)
    step = _hand_step(Policy("lru-hand", "lru"), cost)
    step.cache.insert(np.array([0]), np.array([[0]]))
    step.layer(np.array([0]), np.array([0]), np.array([[[0, 1], [0, 2]]]), np.array([1]))
    assert step.stats["uses"][0] == 4 and step.stats["hits"][0] == 2


def test_the_cpu_sets_time_counts_each_experts_tokens():
    """Pins PreScope Eq. 3 on the multi-token path: the CPU set costs sum(beta * m + C) over its experts'
    token counts m.

    By hand: static (misses stay on the CPU), capacity 1 holding expert 0; B = 3 decode tokens all
    route to expert 1 (k = 1): one CPU expert with m = 3; beta 0.1, C 0.5: t_cpu = 0.3 + 0.5 = 0.8; no
    device expert, no load: layer_t = t_attn 1.0 + 0.8 = 1.8. Catches ST11 (beta + C per expert: 0.6,
    layer_t 1.6)."""
    cost = CostModel(t_io=1.0, t_g=0.2, beta=0.1, c=0.5, t_attn=1.0, expert_bytes=1)
    step = _hand_step(Policy("static-hand", "static", balancer="cpu"), cost, capacity=1)
    step.cache.preload(np.array([0]), np.array([[0]]))
    out = step.layer(np.array([0]), np.array([0]), np.array([[[1], [1], [1]]]), np.array([1]))
    assert step.stats["cpu"][0] == 1 and step.stats["loads"][0] == 0
    assert out.layer_t[0] == pytest.approx(1.8)


def test_algorithm_2_on_several_lanes_charges_beta_plus_c_per_token():
    """Pins SMoE Algorithm 2's per-token CPU cost beta + C on the multi-lane (vectorised) path.

    By hand: two lanes, one token each with 4 misses (k = 4, one token per expert); t_io 1, beta 0.5,
    C 0.3 (0.8 per token). Literal Alg. 2 (load while c_load <= c_cpu): 0 <= 0 -> load (c_load 1);
    1 > 0 -> CPU (c_cpu 0.8); 1 > 0.8 -> CPU (1.6); 1 <= 1.6 -> load: 2 loads and 2 CPU experts per
    lane, 4 and 4 over both. Catches B6 (C alone, 0.3 per token: CPU at
    0.3, 0.6, 0.9 before 1 <= 0.9 fails -> 1 load, 3 CPU)."""
    cost = CostModel(t_io=1.0, t_g=0.25, beta=0.5, c=0.3, t_attn=1.5, expert_bytes=1)
    step = _hand_step(Policy("smoe-hand", "lru", balancer="smoe"), cost, lanes=2)
    ids = np.array([[[0, 1, 2, 3]], [[4, 5, 6, 7]]])
    step.layer(np.array([0, 1]), np.array([0, 0]), ids, np.array([1, 1]))
    assert step.stats["loads"][0] == 4 and step.stats["cpu"][0] == 4  # both lanes share stat slot 0


def test_a_prefill_rows_substitutions_are_not_counted():
    """Pins the subs statistic counting decode rows only: a prefill row is routed unchanged and adds 0.

    By hand: two lanes (the vectorised route), each with experts {0, 2} resident, alpha 0.5; both
    rows' token has p = [.5, .28, .22, 0] and routes {0, 1}: beta = S_3 = .22, band (.11, .33]; 0 is
    top-score (.5 > .33), 1 low-score and missing, 2 its resident alternative. Lane 0's row is prefill
    (ids kept [0, 1], 0 subs), lane 1's decode ([0, 2], 1 sub). Catches ST22 (the prefill row's
    would-be substitution counted: lane 0's subs 1)."""
    from moecast.runtime.core.cache import ExpertCache
    from moecast.runtime.core.step import LayerStep

    cost = CostModel(t_io=1.0, t_g=0.25, beta=0.0, c=0.5, t_attn=1.5, expert_bytes=1)
    pol = Policy("sub-hand", "lru", substitutes=True, alpha=0.5)
    cache = ExpertCache(4, 4, "lru", lanes=2)
    cache.insert(np.array([0, 1]), np.array([[0, 2], [0, 2]]))
    step = LayerStep(cache, pol, cost, 4, 1, stat_base=np.array([0, 1]), n_stats=2)
    probs = np.tile(np.array([0.5, 0.28, 0.22, 0.0], np.float32), (2, 1, 1))
    ids = step.route(
        np.array([0, 1]), np.array([0, 0]), np.array([[[0, 1]], [[0, 1]]]), probs, np.array([False, True])
    )
    assert ids.tolist() == [[[0, 1]], [[0, 2]]]
    assert step.stats["subs"].tolist() == [0.0, 1.0]


def test_a_lane_that_restarts_drops_presched_s_count():
    """Pins a restart (the lane runs a token's first layer next) clearing PreSched's prefetch count, so
    the first layer's prefetch is sized by its window alone (with a shared cache the last layer's
    decision would otherwise reach layer 0).

    By hand: presched, one lane, t_attn 1.0, t_io 0.4, no predictor latency; PreSched's count for the
    lane is 0 before a layer run with restart; afterwards 3 non-resident candidates are prefetched into
    the first window 1.0: floor(1.0 / 0.4) = 2 land. Catches ST13 (the count 0 stays: nothing lands)."""
    from moecast.runtime.core.cache import ExpertCache
    from moecast.runtime.core.policy import POLICIES
    from moecast.runtime.core.step import LayerStep

    cost = CostModel(t_io=0.4, t_g=0.1, beta=0.0, c=0.5, t_attn=1.0, expert_bytes=1)
    step = LayerStep(ExpertCache(8, 4, "lru"), POLICIES["presched"], cost, 8, 1,
                     stat_base=np.zeros(1, np.int64), n_stats=1, prefetching=True)  # fmt: skip
    step.clock.pf_n[0] = 0
    step.layer(np.array([0]), np.array([0]), np.array([[[0, 1]]]), np.array([1]), restart=np.array([True]))
    assert step.clock.pf_n[0] == -1 and step.clock.free[0] == pytest.approx(1.0)
    step.prefetch(np.array([0]), np.array([0]), np.array([[5, 6, 7]]), np.array([2]))
    assert step.stats["pf_landed"][0] == 2
