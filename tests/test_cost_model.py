"""Hardware profiles, the cost model, PreSched's scheduling rule and `moecast profile`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml
from moecast.runtime.core.cost_model import CostModel, ProfileError, available_profiles, load_profile
from moecast.runtime.core.prefetch import gap_prefetch_count
from moecast.runtime.core.presched import PreSched, schedule

PAPER_PROFILES = {
    "smoe-s1-3080ti",
    "smoe-s2-4060ti",
    "smoe-s3-a6000",
    "prescope-v100-pcie3",
    "prescope-a100-pcie4",
}


def test_gh200_profile_fits_a_layer_ahead_transfer():
    """On NVLink-C2C a DeepSeek-V2-Lite expert (17.3 MB) crosses the link within one layer's compute, so
    PreScope's Eq. 6 admits prefetches at batch 1; on the PCIe profiles it does not (f < 1)."""
    k, ds = 6, 17301504
    gh = load_profile("gh200-nvlink-c2c")
    assert gh.source and gh.transfer_gbps > 0
    c = CostModel.from_profile(gh, ds)
    assert c.t_io < c.t_attn + k * c.t_g
    assert gap_prefetch_count(np.array([k * c.t_g]), c.t_attn, c.t_io, np.array([0.5]))[0] >= 1
    for name in ("prescope-a100-pcie4", "prescope-v100-pcie3"):
        pc = CostModel.from_profile(load_profile(name), ds)
        assert gap_prefetch_count(np.array([k * pc.t_g]), pc.t_attn, pc.t_io, np.array([0.5]))[0] == 0


def test_paper_profiles_load_and_scale():
    assert set(available_profiles()) >= PAPER_PROFILES
    for name in PAPER_PROFILES:
        p = load_profile(name)
        assert p.transfer_gbps > 0 and p.source
        c = CostModel.from_profile(p, p.ref_expert_bytes)
        # one transfer = bytes / bandwidth; PCIe moves an expert slower than the device computes it (Premise 5)
        assert c.t_io == pytest.approx(p.ref_expert_bytes / (p.transfer_gbps * 1e9) * 1e3)
        assert c.t_io > c.t_g
        double = CostModel.from_profile(p, 2 * p.ref_expert_bytes)
        assert double.t_io == pytest.approx(2 * c.t_io) and double.beta == pytest.approx(2 * c.beta)
    v100 = CostModel.from_profile(load_profile("prescope-v100-pcie3"), 17301504)
    a100 = CostModel.from_profile(load_profile("prescope-a100-pcie4"), 17301504)
    assert v100.t_io > a100.t_io  # PCIe 3 vs PCIe 4
    assert list(CostModel.t_cpu(a100, [0, 1, 4])) == pytest.approx(
        [0.0, a100.beta + a100.c, 4 * a100.beta + a100.c]
    )


def test_bad_profiles_one_clear_line(tmp_path):
    with pytest.raises(ProfileError, match="unknown hardware profile"):
        load_profile("gpu-from-the-future")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntransfer_gbps: [1,\n")
    with pytest.raises(ProfileError, match="malformed YAML"):
        load_profile(bad)
    missing = tmp_path / "missing.yaml"
    missing.write_text("name: x\ntransfer_gbps: 10\n")
    with pytest.raises(ProfileError, match="missing fields"):
        load_profile(missing)
    neg = tmp_path / "neg.yaml"
    from moecast import configs_dir

    data = yaml.safe_load((configs_dir() / "hardware" / "prescope-a100-pcie4.yaml").read_text())
    data["cpu_beta_ms"] = -1
    neg.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="cpu_beta_ms"):
        load_profile(neg)


def test_presched_eq5_split_and_gap():
    cost = CostModel(t_io=1.0, t_g=0.1, beta=0.5, c=0.2, t_attn=0.3, expert_bytes=1)
    # missing experts with 1, 1, 4, 8 pending tokens (ascending); Eq. 5 takes the i' of least
    # max(T_G, T_C): spans 4.1, 3.1, 2.1, 3.6, 7.8 -> i' = 2 (the paper's literal rule took 3)
    sizes = np.array([[1.0, 1.0, 4.0, 8.0]])
    d = schedule(
        sizes, np.array([4]), np.array([[1.0, 2.0]]), np.array([2]), np.array([0.0]), np.array([0.9]), cost
    )
    tc = np.concatenate([[0], np.cumsum(0.5 * sizes[0] + 0.2)])
    first = int(np.argmin([max(0 + (4 - i) * 1.0 + 0.1, tc[i]) for i in range(5)]))
    assert first == 2 and d.n_cpu[0] == first and d.n_load[0] == 4 - first
    assert d.t_cpu[0] == pytest.approx(tc[first])
    # Eq. 4 / Q4: the cross-layer GPU queue holds only current-layer experts here (light next layer),
    # so nothing is worth prefetching
    assert d.n_prefetch[0] == 0
    # a heavy predicted next layer (6 and 9 pending tokens) enters the queue: prefetch sized by Eqs. 6-7.
    # The split is GPU-bound (T_C 1.4 < T_G 2.1), so Eq. 6's gap is clamped at 0 and only the
    # attention is left for prefetches: a longer one (1.3 ms) so that one fits
    long_attn = dataclasses.replace(cost, t_attn=1.3)
    d2 = schedule(
        sizes,
        np.array([4]),
        np.array([[6.0, 9.0]]),
        np.array([2]),
        np.array([0.0]),
        np.array([0.9]),
        long_attn,
    )
    gap = max(tc[first] - (4 - first) * 1.0, 0.0)
    f = (gap + 1.3) / 1.0
    fr = int(np.floor(f + 0.5))
    keep = 0.9 * (f - fr + 1) - 0.1 * (fr - f) > 0
    assert d2.n_prefetch[0] == max(0, min(2, fr if keep else fr - 1)) and d2.n_prefetch[0] > 0
    # online wrapper gives the same split: the smallest experts run on the CPU
    _load, cpu, _n_pf = PreSched(cost).decide(np.array([8, 1, 4, 1]), np.array([2, 1]))
    assert sorted(np.array([8, 1, 4, 1])[cpu].tolist()) == sorted(sizes[0][:first].tolist())


def test_gap_formula_eq6_eq7():
    # f = (gap + t_attn) / t_io = 2.4 -> |f| = 2; xi = R_hit * 0.6 - R_miss * (-0.4) > 0 -> 2
    assert gap_prefetch_count(np.array([2.1]), 0.3, 1.0, np.array([0.5]))[0] == 2
    # f = 2.6 -> |f| = 3, critical prefetch kept only when hits are likely (Eq. 7)
    assert gap_prefetch_count(np.array([2.3]), 0.3, 1.0, np.array([0.9]))[0] == 3
    assert gap_prefetch_count(np.array([2.3]), 0.3, 1.0, np.array([0.3]))[0] == 2
    assert gap_prefetch_count(np.array([5.0]), 0.3, math.inf, np.array([0.9]))[0] == 0


def test_profile_command_measures_cpu_and_writes_yaml(tmp_path, capsys):
    from moecast.runtime.profile.commands import profile

    out = tmp_path / "hw" / "local.yaml"
    profile(out=str(out), hidden_size=64, intermediate_size=32, name="test-local")
    p = load_profile(out)
    assert p.name == "test-local" and p.cpu_beta_ms > 0 and p.ref_expert_bytes == 3 * 64 * 32 * 2
    assert "measured" in p.source and "wrote" in capsys.readouterr().out
    # the predictor's latency measured on a stand-in too (a 0 would charge every prefetch nothing)
    assert p.predictor_ms > 0
    assert (
        "predictor_ms: LLaPor of the default size, random weights, on 26 layers of 64 experts, top-6"
        in p.source
    )
    # without --out it lands in $MOECAST_HOME/hardware and loads by name
    profile(hidden_size=32, intermediate_size=16, name="bench-box")
    assert load_profile("bench-box").ref_expert_bytes == 3 * 32 * 16 * 2


def test_schedule_unit_equals_schedule_for_one_token_sizes():
    """PreSched at decode batch 1 (every pending expert has one token) without sorts: same decisions."""
    from moecast.runtime.core.presched import schedule_unit

    rng = np.random.default_rng(0)
    for name in ("prescope-a100-pcie4", "prescope-v100-pcie3", "smoe-s1-3080ti", "gh200-nvlink-c2c"):
        for eb in (1_000_000, 17301504, 100_000_000):
            cost = CostModel.from_profile(load_profile(name), eb)
            n, M, Mn = 3000, 6, 6
            nc, nn = rng.integers(0, M + 1, n), rng.integers(0, Mn + 1, n)
            delay = np.where(rng.random(n) < 0.5, 0.0, rng.random(n) * 3)
            r_hit = rng.random(n)
            cur = (np.arange(M)[None] < nc[:, None]).astype(float)
            nxt = (np.arange(Mn)[None] < nn[:, None]).astype(float)
            for args_ref, args_unit in (
                ((cur, nc, nxt, nn), (nc, M, nn, Mn)),
                ((cur, nc, np.zeros((n, 0)), np.zeros(n, int)), (nc, M, np.zeros(n, int), 0)),
            ):
                a = schedule(*args_ref, delay, r_hit, cost)
                b = schedule_unit(*args_unit, delay, r_hit, cost)
                for f in ("n_load", "n_cpu", "t_cpu", "n_prefetch"):
                    assert (getattr(a, f) == getattr(b, f)).all(), f


def test_profile_reads_the_expert_shape_in_the_traces_dtype(tmp_path, monkeypatch):
    """expert_bytes are in the dtype the traces were collected in: a float32 set's experts are half
    the width a 2-byte reading would give."""
    import json

    from conftest import make_synthetic_traceset
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.profile import commands
    from moecast.runtime.profile import measure as prof

    path = make_synthetic_traceset(tmp_path / "t", hidden=16)
    m = TraceSet(path).meta.model
    seen = {}

    def fake(hidden, intermediate, name="local", dtype="float32"):
        seen["shape"], seen["dtype"] = (hidden, intermediate), dtype
        return load_profile("prescope-a100-pcie4")

    monkeypatch.setattr(prof, "measure", fake)
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        meta = json.loads((path / "meta.json").read_text())
        meta["collection"]["dtype"] = dtype
        (path / "meta.json").write_text(json.dumps(meta))
        commands.profile(traces=str(path), out=str(tmp_path / f"{dtype}.yaml"))
        assert seen["shape"] == (16, max(1, m.expert_bytes // (3 * 16 * width)))
        assert seen["dtype"] == dtype  # the CPU expert is timed in the traces' dtype


def test_live_models_time_on_this_machines_profile_where_one_was_measured(tmp_path, monkeypatch):
    """No hardware given: the replay's default until `moecast profile` writes this machine's
    ``local`` profile, then that one; the stats say which and why."""
    import dataclasses

    from moecast.runtime.core.cost_model import DEFAULT_HARDWARE, default_hardware
    from moecast.runtime.live.runtime import attach
    from test_live import make_model

    monkeypatch.setenv("MOECAST_HOME", str(tmp_path))
    assert default_hardware()[0] == DEFAULT_HARDWARE == "prescope-a100-pcie4"
    rt = attach(make_model("qwen2_moe"), policy="lru", capacity=0.5)
    try:
        st = rt.stats()
    finally:
        rt.detach()
    assert st["hardware"] == "prescope-a100-pcie4" and "moecast profile" in st["hardware_from"]
    local = dataclasses.replace(load_profile("smoe-s2-4060ti"), name="local")
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "local.yaml").write_text(local.to_yaml())
    rt = attach(make_model("qwen2_moe"), policy="lru", capacity=0.5)
    try:
        st = rt.stats()
    finally:
        rt.detach()
    assert st["hardware"] == "local" and st["hardware_from"] == "this machine's profile (moecast profile)"
    rt = attach(make_model("qwen2_moe"), policy="lru", capacity=0.5, hardware="gh200-nvlink-c2c")
    try:
        assert rt.stats()["hardware_from"] == "given"
    finally:
        rt.detach()


def _cpu_profile(**kw):
    from moecast.runtime.core.cost_model import HardwareProfile

    base = dict(
        name="hand-cpu",
        transfer_gbps=1.0,
        ref_expert_bytes=1_000_000,
        gpu_expert_ms=0.5,
        cpu_beta_ms=0.2,
        cpu_c_ms=1.0,
        attn_ms=1.0,
        fast_tier="cpu",
        slow_tier="host",
    )
    return HardwareProfile(**{**base, **kw})


def test_a_cpu_fast_tiers_c_at_a_measured_precision_is_its_time_less_beta():
    """Pins from_profile taking C from cpu_c_at(precision): on a CPU fast tier that timed int8,
    C = expert_ms['int8'] - beta, so t_cpu(1 token) = expert_ms['int8'].

    By hand: beta 0.2, cpu_c_ms 1.0, expert_ms {'int8': 0.8}, expert of ref_expert_bytes (scale 1):
    c = 0.8 - 0.2 = 0.6, t_cpu(1) = 0.2 + 0.6 = 0.8. Catches CM5 (cpu_c_at returns expert_ms itself:
    c = 0.8) and CM9 (from_profile reads cpu_c_ms: c = 1.0)."""
    p = _cpu_profile(expert_ms={"int8": 0.8})
    cost = CostModel.from_profile(p, p.ref_expert_bytes, precision="int8")
    assert cost.c == pytest.approx(0.6) and cost.beta == pytest.approx(0.2)
    assert float(cost.t_cpu(1)) == pytest.approx(0.8)


def test_a_cpu_tier_reading_a_disk_pays_its_read_share_per_byte_read():
    """Pins t_rc of a CPU fast tier over a disk scaling with the bytes the link moves.

    By hand: read_cpu_ms 0.4 per ref_expert_bytes (1_000_000); an expert of 2_000_000 bytes stored as
    500_000 on disk: t_rc = 0.4 * 500_000 / 1_000_000 = 0.2 ms. Catches CM7 (t_rc = read_cpu_ms:
    0.4)."""
    p = _cpu_profile(slow_tier="disk", read_cpu_ms=0.4, disk_read_gbps=1.0)
    cost = CostModel.from_profile(p, expert_bytes=2_000_000, link_bytes=500_000)
    assert cost.t_rc == pytest.approx(0.2)
