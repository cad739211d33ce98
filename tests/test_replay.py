"""Replay: reference hit rates on real traces, prefetch bounds, bad input, CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import TraceSet
from moecast.runtime.core.cost_model import HardwareProfile
from moecast.runtime.replay.engine import ReplayConfig, replay

FREE_LINK = HardwareProfile(
    name="free-link",
    transfer_gbps=float("inf"),
    ref_expert_bytes=1,
    gpu_expert_ms=0.01,
    cpu_beta_ms=1.0,
    cpu_c_ms=1.0,
    attn_ms=0.1,
)
NO_LINK = HardwareProfile(
    name="no-link",
    transfer_gbps=0.0,
    ref_expert_bytes=1,
    gpu_expert_ms=0.01,
    cpu_beta_ms=1.0,
    cpu_c_ms=1.0,
    attn_ms=0.1,
)


def simple_hit_rate(ts: TraceSet, policy: str, cap: int) -> float:
    """Deliberately plain per-layer, cold-per-request, demand-only cache (docs/design.md, replay semantics)."""
    hits = uses = 0
    for rid in ts.request_ids:
        ids = ts.get(rid).topk_ids.astype(int)  # [T, L, k]
        T, L, _ = ids.shape
        for layer in range(L):
            cache: set[int] = set()
            last: dict[int, int] = {}
            freq: dict[int, int] = {}
            for t in range(T):
                acc = [int(e) for e in ids[t, layer]]
                hits += sum(e in cache for e in acc)
                uses += len(acc)
                missing = [e for e in acc if e not in cache]
                need = len(cache) + len(missing) - cap
                if need > 0:
                    victims = sorted(
                        (e for e in cache if e not in acc),
                        key=lambda e, t=t: _key(policy, e, t, ids[:, layer], last, freq),
                    )[:need]
                    cache -= set(victims)
                cache |= set(missing)
                for e in acc:
                    last[e] = t
                    freq[e] = freq.get(e, 0) + 1
    return hits / uses


def _key(policy, e, t, layer_ids, last, freq):
    if policy == "lru":
        return (last[e], e)
    if policy == "lfu":
        return (freq[e], last[e], e)
    nxt = next((u for u in range(t + 1, len(layer_ids)) if e in layer_ids[u]), 10**9)
    return (-nxt, e)


@pytest.fixture(scope="module")
def puffin_small(tmp_path_factory):
    from conftest import PUFFIN

    if not PUFFIN.is_dir():
        pytest.skip("../shared/traces (real DeepSeek traces) not present in this checkout")
    from moecast.collect.moe_beyond import import_moe_beyond

    out = tmp_path_factory.mktemp("puffin") / "ds5"
    import_moe_beyond(str(PUFFIN), out=str(out), max_files=5)
    return TraceSet(out)


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
@pytest.mark.parametrize("cap", [6, 16])
def test_reference_hit_rates_on_real_traces(puffin_small, policy, cap):
    got = replay(puffin_small, ReplayConfig(policy=policy, capacity=cap, cold=True)).hit_rate
    assert got == pytest.approx(simple_hit_rate(puffin_small, policy, cap), abs=1e-12)


def test_belady_bounds_lru_and_capacity_monotone(puffin_small):
    r = {
        p: replay(puffin_small, ReplayConfig(policy=p, capacity=12, cold=True)).hit_rate
        for p in ("lru", "lfu", "belady")
    }
    assert r["belady"] >= max(r["lru"], r["lfu"])
    small = replay(puffin_small, ReplayConfig(policy="lru", capacity=8, cold=True)).hit_rate
    assert small <= r["lru"]


def test_reference_on_synthetic(tmp_path):
    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=12, top_k=3, tokens=15
        )
    )
    for policy in ("lru", "lfu", "belady"):
        got = replay(ts, ReplayConfig(policy=policy, capacity=5, cold=True)).hit_rate
        assert got == pytest.approx(simple_hit_rate(ts, policy, 5), abs=1e-12)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("cold", [False, True])
def test_oracle_with_free_link_hits_everything(tmp_path, shared, cold):
    # decode steps only: a prefill token loads what it needs without prefetching (SMoE Sec. 4.1)
    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=16, top_k=2, tokens=10, decode_from=0
        )
    )
    r = replay(
        ts,
        ReplayConfig(
            policy="prefetch", predictor="oracle", capacity=4, cold=cold, shared=shared, hardware=FREE_LINK
        ),
    )
    assert r.hit_rate == 1.0
    assert r.prefetch_accuracy == 1.0


def test_zero_bandwidth_prefetch_adds_nothing(tmp_path):
    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=16, top_k=2, tokens=10
        )
    )
    base = replay(ts, ReplayConfig(policy="lru", capacity=4, hardware=NO_LINK))
    pf = replay(ts, ReplayConfig(policy="prefetch", predictor="oracle", capacity=4, hardware=NO_LINK))
    assert pf.hit_rate == base.hit_rate
    assert pf.prefetches_landed == 0


def test_prefetch_helps_on_real_link_and_smoe_runs(tmp_path):
    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=16, top_k=2, tokens=12
        )
    )
    base = replay(ts, ReplayConfig(policy="lru", capacity=4, hardware="prescope-v100-pcie3"))
    pf = replay(ts, ReplayConfig(policy="prefetch", capacity=4, hardware="prescope-v100-pcie3"))
    assert pf.hit_rate > base.hit_rate
    assert pf.modeled_tpot_ms < base.modeled_tpot_ms
    # without prefetch, substitution is what raises the hit rate
    s0 = replay(ts, ReplayConfig(policy="smoe", predictor="none", capacity=4, alpha=0.0, batch_size=2))
    s1 = replay(ts, ReplayConfig(policy="smoe", predictor="none", capacity=4, alpha=0.5, batch_size=2))
    assert s0.substitution_rate == 0.0 and s1.substitution_rate > 0
    assert s1.hit_rate >= s0.hit_rate
    ps = replay(ts, ReplayConfig(policy="presched", predictor="none", capacity=4))
    assert ps.cpu_experts > 0 and 0 <= ps.hit_rate <= 1
    assert ps.tpot_basis == "decode steps"


def test_bad_inputs_one_clear_error(tmp_path):
    ts = TraceSet(make_synthetic_traceset(tmp_path / "s", with_optional=False, num_experts=8, top_k=2))
    with pytest.raises(ValueError, match="router_probs"):
        replay(ts, ReplayConfig(policy="smoe", capacity=4, alpha=0.1))
    with pytest.raises(ValueError, match="below top-k"):
        replay(ts, ReplayConfig(policy="lru", capacity=1))
    with pytest.raises(ValueError, match="unknown policy"):
        replay(ts, ReplayConfig(policy="fifo", capacity=4))
    with pytest.raises(ValueError, match="unknown hardware profile"):
        replay(ts, ReplayConfig(policy="lru", capacity=4, hardware="tpu-v9"))
    with pytest.raises(ValueError, match="no requests"):
        replay(ts, ReplayConfig(policy="lru", capacity=4, requests=[]))


def _run_cli(argv, capsys):
    from moecast.cli import main

    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_replay_json_and_errors(tmp_path, capsys):
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    code, out, _ = _run_cli(
        ["replay", "--traces", str(path), "--policy", "lru", "--capacity", "0.5", "--cold", "--json"], capsys
    )
    obj = json.loads(out.strip().splitlines()[-1])
    assert {"hit_rate", "prefetch_accuracy", "modeled_tpot_ms"} <= set(obj) and obj["mode"] == "cold"
    code, _, _err = _run_cli(["replay", "--traces", str(path), "--capacity", "1"], capsys)
    assert "moecast: error:" in str(code) and "top-k" in str(code)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    code, _, _ = _run_cli(["replay", "--traces", str(path), "--hardware", str(bad)], capsys)
    assert "malformed YAML" in str(code)


def test_compare_plots_one_line_per_cell_and_precision():
    from moecast.runtime.replay.commands import _series_name

    rows = [
        dict(policy="lru", predictor="none", planner="none", expert_dtype=d) for d in ("model", "int4-g128")
    ]
    assert [_series_name(r) for r in rows] == ["lru/none", "lru/none int4-g128"]
    assert _series_name(dict(rows[1], planner="eam")) == "lru/none+eam int4-g128"


def test_cli_compare_writes_tables_plot_and_wandb(tmp_path, capsys):
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    out = tmp_path / "cmp"
    code, text, _ = _run_cli(
        [
            "compare",
            "--traces",
            str(path),
            "--policies",
            "lru",
            "prefetch",
            "--predictors",
            "none",
            "oracle",
            "--capacities",
            "0.5",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, text
    rows = (out / "table.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 1 + 2  # lru once, prefetch x 2 predictors
    assert (out / "plot.png").stat().st_size > 0 and "| policy |" in (out / "table.md").read_text()
    assert len(list(Path(out / "wandb").glob("offline-run-*"))) == 3


def test_compare_takes_comma_separated_names_as_the_docs_write_them():
    """`--policies lru,mru` (docs/adding-a-policy.md) was one unknown policy 'lru,mru'; names and
    capacities split at commas, checkpoint paths (which may hold one) do not."""
    from moecast.runtime.replay.commands import _compare_lists

    pols, preds, caps, plans = _compare_lists(
        ["lru,lfu", "score"], ["a,b.safetensors"], "0.1, 0.25", ["none"]
    )
    assert (pols, preds, caps, plans) == (
        ["lru", "lfu", "score"],
        ["a,b.safetensors"],
        ["0.1", "0.25"],
        ["none"],
    )


def test_capacities_in_one_pass_equal_separate_runs(tmp_path):
    from moecast.runtime.replay.engine import replay_capacities

    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=5, num_layers=3, num_experts=16, top_k=2, tokens=11
        )
    )
    for policy in ("lfu", "prefetch", "presched"):
        many = replay_capacities(ts, ReplayConfig(policy=policy, cold=False), [2, 5, 8])
        for c, r in zip([2, 5, 8], many):
            one = replay(ts, ReplayConfig(policy=policy, capacity=c, cold=False))
            assert r.hit_rate == one.hit_rate and r.modeled_tpot_ms == pytest.approx(one.modeled_tpot_ms)
            assert r.cpu_experts == one.cpu_experts


@pytest.mark.parametrize("policy", ["lru", "static", "belady", "presched"])
def test_cold_chunks_equal_one_pass(tmp_path, policy):
    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=7, num_layers=3, num_experts=16, top_k=2, tokens=9
        )
    )
    one = replay(ts, ReplayConfig(policy=policy, capacity=4, cold=True))
    chunked = replay(
        ts, ReplayConfig(policy=policy, capacity=4, cold=True, chunk_lanes=6)
    )  # 2 streams a chunk
    assert chunked.hit_rate == one.hit_rate and chunked.cpu_experts == one.cpu_experts
    assert chunked.modeled_tpot_ms == pytest.approx(one.modeled_tpot_ms)


class PlanPredictor:
    """A prompt-ahead test planner: the request's own expert counts (a perfect plan)."""

    name = "test-plan"
    horizon = "prompt-ahead"
    needs = ("topk_ids",)
    fingerprint = None

    def __init__(self, E: int, L: int = 0, k: int = 0) -> None:
        self.E = E
        self.num_layers, self.num_experts, self.top_k = L, E, k

    @classmethod
    def from_checkpoint(cls, tensors, meta, path):
        return cls(int(meta["num_experts"]), len(meta["moe_layers"]), int(meta["top_k"]))

    def plan(self, prompt):  # what makes it a planner; replay reads score_request's rows
        raise NotImplementedError("a replay-only test planner")

    def metadata(self):
        return {"kind": self.name, "horizon": self.horizon, "fingerprint": self.fingerprint}

    def score_request(self, trace):
        T, L, _k = trace.topk_ids.shape
        plan = np.zeros((L, self.E), dtype=np.float32)
        for layer in range(L):
            plan[layer] = np.bincount(trace.topk_ids[:, layer].reshape(-1).astype(int), minlength=self.E)
        return np.broadcast_to(plan, (T, L, self.E))


def test_planner_checkpoint_preloads_and_prefetches(tmp_path):
    from moecast.predictors import checkpoint, registry

    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=16, top_k=2, tokens=12
        )
    )
    registry.register("test-plan", "test_replay:PlanPredictor")
    ck = tmp_path / "plan.safetensors"
    m = ts.meta.model
    checkpoint.save(
        ck,
        {"dummy": np.zeros(1, dtype=np.float32)},
        {
            "kind": "test-plan",
            "fingerprint": m.fingerprint,
            "moe_layers": m.moe_layers,
            "num_experts": m.num_experts,
            "top_k": m.top_k,
        },
    )
    base = replay(ts, ReplayConfig(policy="lru", capacity=6, cold=True))
    planned = replay(ts, ReplayConfig(policy="lru", capacity=6, cold=True, planner=str(ck)))
    assert planned.hit_rate > base.hit_rate
    assert planned.prefetch_accuracy is not None and 0 < planned.prefetch_accuracy <= 1
    # under static the request's plan is pinned in the hot table's place (as the live runtime does):
    # this perfect plan then holds each layer's most used experts of the request itself
    from moecast.runtime.core.cache import StaticTable

    static = replay(ts, ReplayConfig(policy="static", capacity=6, cold=True))
    pinned = replay(ts, ReplayConfig(policy="static", capacity=6, cold=True, planner=str(ck)))
    uses = hits = moved = used = 0
    for rid in ts.request_ids:
        ids = ts.get(rid).topk_ids
        plan = StaticTable.from_topk(ids, 16).per_layer(6)
        hits += sum(e in plan[layer] for t in ids for layer, row in enumerate(t) for e in row)
        uses += ids.size
        # each request starts cold: every planned expert is moved, and counts as used once routed
        for layer, row in enumerate(plan):
            planned = [e for e in row if e >= 0]
            moved += len(planned)
            used += sum(e in ids[:, layer] for e in planned)
    assert pinned.hit_rate == pytest.approx(hits / uses) and pinned.hit_rate > static.hit_rate
    assert pinned.prefetches_landed == 0 and pinned.bytes_moved > 0  # plans are loaded, not prefetched
    # the plan's moved experts count as a plan's preloads do under lru: used once routed (they were all
    # counted wasted, accuracy 0, at any hit rate)
    assert pinned.prefetch_accuracy == pytest.approx(used / moved) and used > 0
    # compare pairs the planner with lru and static, not belady
    from moecast.runtime.replay.commands import compare

    out = tmp_path / "cmp"
    compare(str(ts.path), policies=["lru", "static", "belady"], predictors=["none"], capacities=["6"], planners=["none", str(ck)],
            out=str(out), cold=True, wandb=False, json=True)  # fmt: skip
    rows = (out / "table.csv").read_text().strip().splitlines()[1:]
    # the hot table is added beside the planner: lru and static with none, the plan and hot
    assert sorted(r.split(",")[0] for r in rows) == [
        "belady",
        "lru",
        "lru",
        "lru",
        "static",
        "static",
        "static",
    ]
    assert sorted(r.split(",")[2] for r in rows if r.startswith("lru,")) == ["hot", "none", "plan"]
    bad = tmp_path / "other.safetensors"
    checkpoint.save(
        bad,
        {"dummy": np.zeros(1, dtype=np.float32)},
        {
            "kind": "test-plan",
            "fingerprint": "0000",
            "moe_layers": m.moe_layers,
            "num_experts": m.num_experts,
            "top_k": m.top_k,
        },
    )
    with pytest.raises(ValueError, match="fingerprint"):
        replay(ts, ReplayConfig(policy="lru", capacity=6, planner=str(bad)))


FAST_LINK = HardwareProfile(
    name="fast-link",
    transfer_gbps=400.0,
    ref_expert_bytes=17301504,
    gpu_expert_ms=0.03,
    cpu_beta_ms=0.03,
    cpu_c_ms=0.25,
    attn_ms=0.08,
)
# no accelerator, the experts on a disk, each read taking compute time from the cores
CPU_DISK = replace(FAST_LINK, name="cpu-disk", fast_tier="cpu", slow_tier="disk", read_cpu_ms=0.02)


POLICY_PREFETCHES = {
    "lru": False,
    "lfu": False,
    "belady": False,
    "static": False,
    "prefetch": True,
    "prefetch-late": True,
    "lfu-prefetch": True,
    "presched": True,
}


def _same_result(a, b):
    assert a.hit_rate == b.hit_rate
    assert a.hit_rate_per_layer == pytest.approx(b.hit_rate_per_layer, abs=1e-14)
    for f in ("loads", "cpu_experts", "prefetches_issued", "prefetches_landed", "bytes_moved"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.prefetch_accuracy == b.prefetch_accuracy
    assert a.modeled_tpot_ms == pytest.approx(b.modeled_tpot_ms, rel=1e-9)
    assert a.layer_time_ms_per_layer == pytest.approx(b.layer_time_ms_per_layer, rel=1e-9)


def test_fast_demand_engine_serves_the_eviction_tables_fast_policies(tmp_path):
    """runtime/core/eviction.py's fast_replay flags are what the replay does: a demand-only run of each
    eviction policy goes to the batch-1 engine exactly where its row says so."""
    from moecast.runtime.core import eviction
    from moecast.runtime.core.policy import Policy
    from moecast.runtime.replay.engine import _fast_demand_engine, _prepare

    ts = TraceSet(make_synthetic_traceset(tmp_path / "s", num_requests=2, num_experts=8, top_k=2, tokens=5))
    for name, rule in eviction.TABLE.items():
        run = _prepare(ts, ReplayConfig(policy=Policy(name, name)), [4])
        assert (_fast_demand_engine(run) is not None) == rule.fast_replay, name


@pytest.mark.parametrize("cold", [True, False])
@pytest.mark.parametrize(
    "policy", ["lru", "lfu", "belady", "static", "prefetch", "prefetch-late", "lfu-prefetch", "presched"]
)
def test_fast_paths_equal_general_engine(tmp_path, policy, cold):
    """The fast batch-1 paths (LRU stack distances, lane simulation, contiguous wavefront) reproduce the
    general engine exactly, with prefetches that land (fast link) and that never fit (PCIe)."""
    from moecast.runtime.replay.engine import replay_capacities

    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=5, num_layers=3, num_experts=16, top_k=3, tokens=14
        )
    )
    hws = [FAST_LINK, "prescope-a100-pcie4"] if POLICY_PREFETCHES[policy] else ["prescope-a100-pcie4"]
    hws.append(CPU_DISK)
    for hw in hws:
        cfg = dict(policy=policy, cold=cold, hardware=hw)
        fast = replay_capacities(ts, ReplayConfig(**cfg), [3, 5, 8, 12])
        ref = replay_capacities(ts, ReplayConfig(**cfg, fast=False), [3, 5, 8, 12])
        for a, b in zip(fast, ref):
            _same_result(a, b)


def test_fast_paths_equal_general_engine_on_real_traces(puffin_small):
    from moecast.runtime.replay.engine import replay_capacities

    rids = list(puffin_small.request_ids)[:12]
    for policy in ("lfu", "belady", "presched", "prefetch-late", "lfu-prefetch"):
        cfg = dict(policy=policy, cold=True, requests=rids)
        fast = replay_capacities(puffin_small, ReplayConfig(**cfg), [6, 16, 32])
        ref = replay_capacities(puffin_small, ReplayConfig(**cfg, fast=False), [6, 16, 32])
        for a, b in zip(fast, ref):
            _same_result(a, b)


def test_lru_stack_distances_match_simple_cache(puffin_small):
    """Every capacity from one set of distances, stream mode included (cross-request persistence)."""
    from moecast.runtime.replay.fastreplay import lru_distances

    rids = list(puffin_small.request_ids)[:6]
    topk = puffin_small.array("topk_ids", rids).astype(np.int64)
    lengths = puffin_small.request_lengths(rids)
    dist = lru_distances(topk, lengths, cold=False)
    for cap in (6, 9, 20):
        hits = uses = 0
        for layer in range(topk.shape[1]):
            cache: list[int] = []  # most recent last; ties (one access) by id
            for t in range(len(topk)):
                acc = sorted(int(e) for e in topk[t, layer])
                hits += sum(e in cache for e in acc)
                uses += len(acc)
                cache = [e for e in cache if e not in acc] + acc
                cache = cache[-cap:]
        assert (dist < cap).sum() / dist.size == pytest.approx(hits / uses, abs=1e-12)


def test_bad_input_each_one_clear_line(tmp_path, capsys):
    """capacity below top-k, a policy needing missing fields, unknown / malformed hardware profile,
    empty TraceSet: each one `moecast: error:` line from the CLI."""
    path = make_synthetic_traceset(tmp_path / "s", with_optional=False, num_experts=8, top_k=2)
    empty = make_synthetic_traceset(tmp_path / "e", num_requests=0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    cases = [
        (["--capacity", "1"], "below top-k"),
        (["--policy", "score"], "router_probs"),
        (["--policy", "smoe", "--alpha", "0.1"], "router_probs"),
        (["--hardware", "tpu-v9"], "unknown hardware profile"),
        (["--hardware", str(bad)], "malformed YAML"),
        (["--policy", "fifo"], "unknown policy"),
    ]
    for extra, needle in cases:
        code, _, _ = _run_cli(["replay", "--traces", str(path), *extra], capsys)
        msg = str(code)
        assert msg.startswith("moecast: error:") and needle in msg and "\n" not in msg, (extra, msg)
    code, _, _ = _run_cli(["replay", "--traces", str(empty)], capsys)
    assert str(code).startswith("moecast: error:") and "no requests" in str(code)


def test_predictor_checkpoint_scored_once_per_request(tmp_path, monkeypatch):
    """--predictor CKPT: score_request runs once per request (a whole [T, L, E] at a time)."""
    from moecast.predictors import checkpoint, registry

    ts = TraceSet(
        make_synthetic_traceset(
            tmp_path / "s", num_requests=4, num_layers=3, num_experts=16, top_k=2, tokens=9
        )
    )
    registry.register("test-plan", "test_replay:PlanPredictor")
    calls = []
    orig = PlanPredictor.score_request

    def counting(self, trace):
        calls.append(trace.request_id)
        return orig(self, trace)

    monkeypatch.setattr(PlanPredictor, "score_request", counting)
    monkeypatch.setattr(PlanPredictor, "horizon", "layer-ahead")
    ck = tmp_path / "p.safetensors"
    m = ts.meta.model
    checkpoint.save(
        ck,
        {"dummy": np.zeros(1, dtype=np.float32)},
        {
            "kind": "test-plan",
            "fingerprint": m.fingerprint,
            "moe_layers": m.moe_layers,
            "num_experts": m.num_experts,
            "top_k": m.top_k,
        },
    )
    from moecast.runtime.replay.engine import replay_capacities

    res = replay_capacities(
        ts, ReplayConfig(policy="prefetch", predictor=str(ck), hardware=FAST_LINK), [4, 8]
    )
    assert sorted(calls) == sorted(ts.request_ids)
    assert res[0].prefetches_landed > 0


def test_plan_prior_only_reorders_close_scores():
    from moecast.runtime.core.prefetch import plan_prior

    scores = np.array([[[0.99, 0.97, 0.20, 0.01]]], dtype=np.float32)  # [T=1, L=1, E=4]
    plan = np.array([[0.05, 0.60, 0.30, 0.05]], dtype=np.float32)
    order = lambda s: list(np.argsort(-s[0, 0], kind="stable"))  # noqa: E731
    assert order(plan_prior(scores, plan, 0.0)) == order(scores)  # weight 0: the predictor alone
    mixed = order(plan_prior(scores, plan, 0.5))
    assert mixed[:2] == [1, 0]  # the plan breaks the near-tie between experts 0 and 1
    assert mixed[2:] == [2, 3]  # but does not lift an expert the predictor rules out
    logits = np.array([[[2.0, -1.0, 0.5, -3.0]]], dtype=np.float32)  # logits pass through
    assert plan_prior(logits, plan, 0.0)[0, 0] == pytest.approx(logits[0, 0])


def test_negative_plan_weight_is_refused(tmp_path):
    ts = TraceSet(make_synthetic_traceset(tmp_path / "s", num_requests=2))
    with pytest.raises(ValueError, match="plan-weight"):
        replay(ts, ReplayConfig(policy="lru", capacity=4, plan_weight=-1.0))


def test_static_and_planners_refuse_what_would_change_nothing(tmp_path, capsys):
    """static never inserts, so a predictor's prefetches would only move bytes; a prompt-ahead
    checkpoint without a plan (MoE-Infinity matches the routing so far) is no planner; a predictor
    that never lands a prefetch is said to have changed nothing."""
    from moecast.predictors.baselines import ActivationMatrixPredictor, FrequencyPredictor

    path = make_synthetic_traceset(tmp_path / "s", num_requests=6, num_layers=3, num_experts=16, top_k=2)
    ts = TraceSet(path)
    with pytest.raises(ValueError, match="static pins its experts and never inserts"):
        replay(ts, ReplayConfig(policy="static", capacity=4, predictor="oracle"))
    mi = ActivationMatrixPredictor.fit(ts, ts.request_ids).save(tmp_path / "mi.safetensors")
    with pytest.raises(ValueError, match=r"moe-infinity \(prompt-ahead\) does not plan from the prompt"):
        replay(ts, ReplayConfig(policy="lru", capacity=4, planner=str(mi)))
    assert replay(ts, ReplayConfig(policy="prefetch", capacity=4, predictor=str(mi))).prefetches_landed > 0
    hot = FrequencyPredictor.fit(ts, ts.request_ids).save(tmp_path / "hot.safetensors")
    code, out, _ = _run_cli(
        ["replay", "--traces", str(path), "--policy", "prefetch", "--capacity", "4", "--predictor", str(hot),
         "--hardware", "prescope-v100-pcie3"],
        capsys,
    )  # fmt: skip
    assert not code and "note: no prefetch landed" not in out
    code, out, _ = _run_cli(
        ["replay", "--traces", str(path), "--policy", "prefetch", "--capacity", "4", "--predictor", str(hot),
         "--hardware", str(_profile(tmp_path, NO_LINK))],
        capsys,
    )  # fmt: skip
    assert not code and "note: no prefetch landed, so the predictor changed nothing" in out


def _profile(tmp_path: Path, prof: HardwareProfile) -> Path:
    import dataclasses

    import yaml

    f = tmp_path / f"{prof.name}.yaml"
    f.write_text(yaml.safe_dump({k: v for k, v in dataclasses.asdict(prof).items()}))
    return f


def _one_line_error(code: object, *needles: str) -> str:
    msg = str(code)
    assert msg.startswith("moecast: error: ") and "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_compare_with_no_cell_fails_before_writing(tmp_path, capsys):
    """No policy, or only policies that take no planner with only planners: one line, no out/ left behind."""
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    ckpt = tmp_path / "plan.safetensors"
    ckpt.write_bytes(b"")  # never loaded: the cell list is empty before any checkpoint is read
    out = tmp_path / "cmp"
    base = ["compare", "--traces", str(path), "--capacities", "0.5", "--wandb", "false", "--out", str(out)]
    code, _, _ = _run_cli([*base, "--policies", " "], capsys)
    _one_line_error(code, "--policies is empty")
    code, _, _ = _run_cli([*base, "--policies", "belady", "--planners", str(ckpt)], capsys)
    _one_line_error(code, "belady", "--planners none")
    assert not out.exists()


def test_compare_refuses_a_bad_predictor_checkpoint_before_writing(tmp_path, capsys):
    """A --predictors checkpoint that is missing or made for another model is refused in one line before
    out/ is made or any cell replays (a missing one left an empty out/ behind, found at its cell)."""
    from moecast.cli import main

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    other = make_synthetic_traceset(tmp_path / "o", num_experts=6, top_k=2)
    theirs = tmp_path / "theirs.safetensors"
    main(["predictors", "eval", "frequency", "--traces", str(other), "--save", str(theirs)])
    capsys.readouterr()
    out = tmp_path / "cmp"
    base = ["compare", "--traces", str(path), "--policies", "lru", "prefetch", "--capacities", "0.5",
            "--wandb", "false", "--out", str(out)]  # fmt: skip
    code, _, _ = _run_cli([*base, "--predictors", "oracle", str(tmp_path / "nope.safetensors")], capsys)
    _one_line_error(code, "nope.safetensors: no such checkpoint; build one with")
    code, _, _ = _run_cli([*base, "--predictors", "oracle", str(theirs)], capsys)
    _one_line_error(code, "theirs.safetensors was trained for model", f"TraceSet {path}")
    assert not out.exists()


def test_compare_skips_capacities_below_top_k(tmp_path, capsys):
    """The default 0.1 is 3 of 32 experts, below top-4: compare skips it with a note; replay still refuses it."""
    path = make_synthetic_traceset(tmp_path / "s", num_experts=32, top_k=4, num_requests=3, tokens=6)
    out = tmp_path / "cmp"
    code, text, _ = _run_cli(
        ["compare", "--traces", str(path), "--policies", "lru", "--wandb", "false", "--out", str(out)], capsys
    )
    assert not code, code
    notes = [ln for ln in text.splitlines() if ln.startswith("note: skipping")]
    assert len(notes) == 1 and "0.1 (3 experts)" in notes[0] and "top-k = 4" in notes[0], text
    rows = list(csv_rows(out / "table.csv"))
    assert [r["capacity"] for r in rows] == ["8", "16"]  # 0.25 and 0.5 of 32
    # --json keeps stdout one JSON object per cell: the note goes to stderr
    code, text, err = _run_cli(
        ["compare", "--traces", str(path), "--policies", "lru", "--capacities", "0.1", "4", "--wandb", "false",
         "--json", "--out", str(out)],
        capsys,
    )  # fmt: skip
    assert not code and [json.loads(ln)["capacity"] for ln in text.splitlines()] == [4]
    assert "note: skipping capacities 0.1" in err
    code, _, _ = _run_cli(
        ["compare", "--traces", str(path), "--capacities", "0.1", "2", "--wandb", "false", "--out", str(out)],
        capsys,
    )
    _one_line_error(code, "0.1, 2", "top-k = 4")
    code, _, _ = _run_cli(
        ["compare", "--traces", str(path), "--capacities", "0.1", "lots", "--out", str(out)], capsys
    )
    _one_line_error(code, "'lots'")  # a malformed capacity is still an error, not a skip
    code, _, _ = _run_cli(["replay", "--traces", str(path), "--capacity", "0.1"], capsys)
    _one_line_error(code, "below top-k")


def csv_rows(path: Path):
    import csv

    with open(path, newline="") as f:
        yield from csv.DictReader(f)


def _squash(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help at the terminal width


def test_predictor_help_states_the_policy_default(capsys):
    from moecast.runtime.core.policy import POLICIES

    oracle = [p for p, s in POLICIES.items() if s.prefetches]
    others = [p for p, s in POLICIES.items() if not s.prefetches]
    assert oracle and len(oracle) + len(others) == len(POLICIES)
    code, out, _ = _run_cli(["replay", "--help"], capsys)
    want = f"null: the policy's own (oracle, i.e. future knowledge, for {', '.join(oracle[:-1])} and {oracle[-1]}; none for the others)"
    assert not code and want in _squash(out), _squash(out)
    code, out, _ = _run_cli(["compare", "--help"], capsys)
    text = _squash(out)
    assert not code and "oracle (future knowledge" in text
    # compare passes none itself, so there the prefetching policies run without a predictor
    assert f"none (no predictor, also for {', '.join(oracle[:-1])} and {oracle[-1]}, whose" in text, text


def test_replay_flags_an_oracle_it_chose_itself(tmp_path, capsys):
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    note = "note: predictor oracle (future knowledge): the policy's default; pass --predictor CKPT or none"
    base = ["replay", "--traces", str(path), "--capacity", "4"]
    for policy in ("prefetch", "presched"):
        code, out, _ = _run_cli([*base, "--policy", policy], capsys)
        assert not code and note in out.splitlines(), out
    for extra in (["--policy", "prefetch", "--predictor", "oracle"], ["--policy", "prefetch", "--predictor", "none"],
                  ["--policy", "lru"], ["--policy", "prefetch", "--json"]):  # fmt: skip
        code, out, _ = _run_cli([*base, *extra], capsys)
        assert not code and "note: predictor oracle" not in out, (extra, out)


def test_replay_json_is_strict_without_a_link(tmp_path, capsys):
    """A profile with no link (transfer_gbps 0) has infinite transfer times: null in --json, not Infinity."""
    path = make_synthetic_traceset(tmp_path / "s", num_requests=3, num_experts=8, top_k=2)
    code, out, _ = _run_cli(
        ["replay", "--traces", str(path), "--policy", "lru", "--capacity", "4", "--json",
         "--hardware", str(_profile(tmp_path, NO_LINK))],
        capsys,
    )  # fmt: skip

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    obj = json.loads(out.strip().splitlines()[-1], parse_constant=refuse)
    assert not code and None in obj["layer_time_ms_per_layer"]


@pytest.mark.parametrize("fast", [True, False])
def test_static_table_comes_from_the_requests_not_replayed(tmp_path, fast):
    """Replaying held-out requests, the hot-expert table is a profile of the other requests (what a
    deployment would have), not of the replayed ones; replaying all of them, it is in-sample and
    the result says so."""
    from moecast.runtime.core.cache import StaticTable

    ts = TraceSet(
        make_synthetic_traceset(tmp_path / "s", num_requests=8, num_layers=3, num_experts=16, top_k=2)
    )
    rids = ts.request_ids[:3]
    others = [r for r in ts.request_ids if r not in rids]
    cap = 4
    table = StaticTable.from_topk(ts.array("topk_ids", others), 16).per_layer(cap)  # [L, cap]
    ids = ts.array("topk_ids", rids)  # [N, L, k]
    want = np.mean([[e in table[layer] for e in row] for t in ids for layer, row in enumerate(t)])
    res = replay(ts, ReplayConfig(policy="static", capacity=cap, cold=True, requests=rids, fast=fast))
    assert res.hit_rate == pytest.approx(want)
    assert res.extra["hot_table_from"] == "the 5 requests not replayed"
    in_sample = replay(ts, ReplayConfig(policy="static", capacity=cap, cold=True, fast=fast))
    assert "in-sample" in in_sample.extra["hot_table_from"]
    # hot_requests names where it is counted, for the table as for `--planner hot`
    table = StaticTable.from_topk(ts.array("topk_ids", others[:2]), 16).per_layer(cap)
    want = np.mean([[e in table[layer] for e in row] for t in ids for layer, row in enumerate(t)])
    named = ReplayConfig(
        policy="static", capacity=cap, cold=True, requests=rids, hot_requests=others[:2], fast=fast
    )
    assert replay(ts, named).hit_rate == pytest.approx(want)


def test_alpha_defaults_to_one_value_for_substituting_policies(tmp_path, capsys):
    """--alpha left out: smoe substitutes with DEFAULT_ALPHA in replay and compare alike (as
    `moecast run` does), policies that do not substitute get 0; given, it is used as is."""
    from moecast.runtime.core.policy import DEFAULT_ALPHA

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)

    def replay_alpha(*extra: str) -> float:
        code, out, _ = _run_cli(
            ["replay", "--traces", str(path), "--capacity", "4", "--json", *extra], capsys
        )
        assert code in (None, 0), code
        return json.loads(out.strip().splitlines()[-1])["alpha"]

    assert replay_alpha("--policy", "smoe") == DEFAULT_ALPHA
    assert replay_alpha("--policy", "smoe", "--alpha", "0") == 0.0
    assert replay_alpha("--policy", "lru") == 0.0
    code, out, _ = _run_cli(
        [
            "compare",
            "--traces",
            str(path),
            "--policies",
            "lru",
            "smoe",
            "--capacities",
            "4",
            "--out",
            str(tmp_path / "cmp"),
            "--wandb",
            "false",
            "--json",
        ],
        capsys,
    )
    assert code in (None, 0), code
    cells = {c["policy"]: c["alpha"] for c in map(json.loads, out.strip().splitlines())}
    assert cells == {"lru": 0.0, "smoe": DEFAULT_ALPHA}


def test_hot_planner_pins_the_training_requests_top_experts(tmp_path, capsys):
    """--planner hot under static: each layer's c most used experts of the counted requests, pinned;
    the hit rate is the held-out uses inside them, counted here by hand."""
    from conftest import synthetic_record, synthetic_writer

    writer = synthetic_writer(tmp_path / "s", num_layers=3, num_experts=16, top_k=2, with_optional=False)
    # counted requests: per layer experts 0..3 (shifted by 2 per layer) used 9, 6, 3, 2 times, others once
    pairs = [[0, 1]] * 6 + [[0, 2]] * 3 + [[3, 4], [3, 5], [6, 7]]
    counted = np.array([[[(e + 2 * layer) % 16 for e in p] for layer in range(3)] for p in pairs])
    rng = np.random.default_rng(0)
    records = [synthetic_record(r, np.arange(12), counted) for r in range(6)]
    for r in range(6, 10):
        held = np.stack([np.stack([rng.choice(16, 2, replace=False) for _ in range(3)]) for _ in range(12)])
        records.append(synthetic_record(r, np.arange(12), held))
    writer.write(records)
    ts = TraceSet(tmp_path / "s")
    cfg = ReplayConfig(policy="static", capacity=4, cold=True, planner="hot", hot_requests=ts.request_ids[:6])
    res = replay(ts, replace(cfg, requests=ts.request_ids[6:]))
    held = ts.array("topk_ids", ts.request_ids[6:])
    top = [{(e + 2 * layer) % 16 for e in (0, 1, 2, 3)} for layer in range(3)]
    hits = sum(int(e) in top[layer] for row in held for layer in range(3) for e in row[layer])
    assert res.hit_rate == pytest.approx(hits / held.size) and res.config["planner"] == "hot"
    # the CLI: --planner hot with --holdout test replays the test side of the default split
    argv = ["replay", "--traces", str(ts.path), "--policy", "lru", "--capacity", "4", "--cold", "true"]
    code, out, _ = _run_cli([*argv, "--planner", "hot", "--holdout", "test", "--json", "true"], capsys)
    row = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and row["planner"] == "hot" and row["requests"] == len(ts.splits().test)
    assert row["hot_table_from"] == f"the {len(ts.splits().train)} requests of hot_requests"  # the train side
    # every request replayed: its table counted on them, and the result says so (it saw the answers)
    code, out, _ = _run_cli([*argv, "--planner", "hot", "--json", "true"], capsys)
    assert (
        json.loads(out.strip().splitlines()[-1])["hot_table_from"]
        == "the replayed requests themselves (in-sample)"
    )
    assert (
        replay(ts, replace(cfg, requests=ts.request_ids[6:])).extra["hot_table_from"]
        == "the 6 requests of hot_requests"
    )


def test_a_checkpoint_saved_again_at_its_path_is_scored_anew(tmp_path, capsys):
    """Replays in one process keep a checkpoint's predictions (compare runs each under several
    policies); a checkpoint written again at the same path (fit, save, replay in a notebook) must be
    scored as it is now. The second version ranks the experts the other way round, so its prefetches
    differ; its replay must equal one with nothing kept. Catches predictions kept by path alone."""
    from moecast.predictors import checkpoint
    from moecast.runtime.replay import engine

    from moecast.cli import main

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    ckpt = tmp_path / "freq.safetensors"
    main(["predictors", "eval", "frequency", "--traces", str(path), "--save", str(ckpt)])
    capsys.readouterr()
    cfg = ReplayConfig(policy="prefetch", capacity=3, predictor=str(ckpt), cold=True)
    engine._PRED_MEMO.clear()
    first = replay(path, cfg)
    tensors, meta = checkpoint.load_raw(ckpt)
    table = np.asarray(tensors["table"])
    checkpoint.save(ckpt, {"table": table.max() - table}, meta)  # the other ranking, same header
    second = replay(path, cfg)
    engine._PRED_MEMO.clear()
    fresh = replay(path, cfg)
    assert second.prefetches_issued == fresh.prefetches_issued and second.hit_rate == fresh.hit_rate
    assert second.prefetch_accuracy == fresh.prefetch_accuracy
    assert (first.hit_rate, first.prefetch_accuracy) != (second.hit_rate, second.prefetch_accuracy)


def test_replay_notes_say_why_a_predictor_changed_nothing(tmp_path, capsys):
    """The replay's text notes: under static the predictor is the table the policy pins, so neither its
    latency nor a "no prefetch landed" note is printed; the note names both reasons (nothing asked for
    that was not resident, or no room on the link) and never suggests the profile already in use."""
    import dataclasses

    from moecast.runtime.replay.commands import FAST_LINK, _print_result

    from moecast.cli import main

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    freq = tmp_path / "freq.safetensors"
    main(["predictors", "eval", "frequency", "--traces", str(path), "--save", str(freq)])
    capsys.readouterr()
    static = replay(path, ReplayConfig(policy="static", capacity=3, predictor=str(freq)))
    _print_result(static)
    text = capsys.readouterr().out
    assert "predictor latency" not in text and "note:" not in text, text
    assert f"hot-expert table counted on the table of {freq}" in text
    r = replay(path, ReplayConfig(policy="prefetch", capacity=3, predictor=str(freq), hardware=FAST_LINK))
    assert r.prefetches_issued > 0
    _print_result(dataclasses.replace(r, prefetches_landed=0))
    text = capsys.readouterr().out
    assert "note: no prefetch landed" in text and "asked for no expert that was not resident" in text, text
    assert f"compare --hardware {FAST_LINK}" not in text  # the profile in use is not advice
    other = dataclasses.replace(r, prefetches_issued=5, prefetches_landed=0)
    other.config["hardware"] = "prescope-a100-pcie4"
    _print_result(other)
    assert f"compare --hardware {FAST_LINK}" in capsys.readouterr().out


def _cell(**kw) -> dict:
    """One compare row with every table column (and a field the table leaves out)."""
    from moecast.runtime.replay.commands import COMPARE_COLUMNS

    row = {c: None for c in COMPARE_COLUMNS}
    row.update(policy="lru", predictor="none", planner="none", capacity=2, capacity_fraction=0.25,
               mode="cold", expert_dtype="model", hit_rate=0.123456, modeled_tpot_ms=1.5,
               tpot_basis="decode steps", hardware="h100-x", wall_s=9.0)  # fmt: skip
    row.update(kw)
    return row


@pytest.mark.parametrize("cold", [True, False])
def test_compare_tables_write_each_column_as_given_and_say_the_mode(tmp_path, capsys, monkeypatch, cold):
    """table.csv holds the raw figures under the column names, table.md the same rounded to four
    places with "-" for an undefined one, and the note names the run's mode, hardware and TPOT basis."""
    from moecast.runtime.replay import commands
    from moecast.runtime.replay.commands import COMPARE_COLUMNS, _write_compare

    plotted = []
    monkeypatch.setattr(commands, "_plot", lambda rows, path: plotted.append(path))  # matplotlib: seconds
    rows = [_cell(), _cell(policy="lfu", capacity=4, capacity_fraction=0.5, hit_rate=0.5)]
    _write_compare(rows, tmp_path, Path("tr/set"), cold, json=False)
    got = list(csv_rows(tmp_path / "table.csv"))
    assert list(got[0]) == COMPARE_COLUMNS and "wall_s" not in got[0]
    assert [(r["policy"], r["capacity_fraction"], r["hit_rate"]) for r in got] == [
        ("lru", "0.25", "0.123456"),
        ("lfu", "0.5", "0.5"),
    ]
    md = (tmp_path / "table.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(COMPARE_COLUMNS) + " |"
    cells = dict(zip(COMPARE_COLUMNS, md[2].strip("| ").split(" | ")))
    assert (cells["hit_rate"], cells["capacity_fraction"], cells["decode_hit_rate"]) == (
        "0.1235",
        "0.2500",
        "-",
    )
    mode = "cold per request" if cold else "stream"
    assert f"Traces: tr/set; mode: {mode}; hardware: h100-x; TPOT basis: decode steps" in md[-1]
    assert plotted == [tmp_path / "plot.png"]
    assert capsys.readouterr().out.splitlines()[0] == md[0]
    _write_compare(rows, tmp_path, Path("tr/set"), cold, json=True)  # --json: stdout stays the cells' objects
    assert capsys.readouterr().out == ""


def test_compare_runs_each_cell_once_and_only_where_it_means_something(monkeypatch):
    """By hand: lru never prefetches, so it runs with predictor none only; prefetch runs with each
    predictor; belady (and any policy that evicts by the next use, whatever its name) takes no
    planner; a policy named twice runs once; a checkpoint planner brings hot beside it."""
    from moecast.runtime.core.policy import POLICIES, Policy
    from moecast.runtime.replay.commands import _cells, _compare_lists

    monkeypatch.setitem(POLICIES, "opt", Policy("opt", "belady", help="belady under another name"))
    pols, preds, _, plans = _compare_lists(
        ["lru", "prefetch,belady", "opt", "lru"], ["none", "oracle"], ["4"], ["plan.safetensors"]
    )
    assert plans == ["plan.safetensors", "hot"]
    assert _cells(pols, preds, ["none", *plans]) == [
        ("lru", "none", "none"),
        ("lru", "none", "plan.safetensors"),
        ("lru", "none", "hot"),
        ("prefetch", "none", "none"),
        ("prefetch", "none", "plan.safetensors"),
        ("prefetch", "none", "hot"),
        ("prefetch", "oracle", "none"),
        ("prefetch", "oracle", "plan.safetensors"),
        ("prefetch", "oracle", "hot"),
        ("belady", "none", "none"),
        ("opt", "none", "none"),
    ]
    assert _compare_lists(["lru"], ["none"], ["4"], [])[3] == ["none"]  # no planner given: none
    assert _compare_lists(["lru"], ["none"], ["4"], ["hot"])[3] == ["hot"]  # hot alone is not doubled


def test_compare_names_a_checkpoint_by_its_stem_and_gives_alpha_only_to_substituting_policies(
    tmp_path, monkeypatch
):
    """The cells' replays stubbed out: each cell's ReplayConfig gets --alpha only where its policy
    substitutes (smoe; lru would refuse it), a row names a predictor checkpoint by its file's stem (a
    keyword as it is), as the table and the plot show it, and the held-out split is the one every
    checkpoint was trained on."""
    from moecast.predictors.baselines import FrequencyPredictor
    from moecast.predictors.provenance import InSampleWarning
    from moecast.runtime.replay import commands, engine

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    ckpt = FrequencyPredictor.fit(TraceSet(path), TraceSet(path).request_ids).save(
        tmp_path / "freq.safetensors"
    )
    seen, written = [], []

    class Result:
        def __init__(self, cfg):
            self.cfg = cfg

        def to_json(self):
            return {"policy": self.cfg.policy, "predictor": self.cfg.predictor, "capacity": 4}

    def cells(ts, cfg, caps):
        seen.append((cfg.policy, cfg.predictor, cfg.alpha))
        return [Result(cfg)]

    monkeypatch.setattr(engine, "replay_capacities", cells)
    monkeypatch.setattr(commands, "_write_compare", lambda rows, *a: written.extend(rows))
    with pytest.warns(InSampleWarning, match="freq.safetensors was fitted on 6 requests"):  # no --holdout
        commands.compare(
            traces=str(path), policies=["lru", "smoe"], predictors=["none", str(ckpt)], capacities=["4"],
            alpha=0.2, out=str(tmp_path / "cmp"), wandb=False, json=True,
        )  # fmt: skip
    assert seen == [("lru", "none", None), ("smoe", "none", 0.2), ("smoe", str(ckpt), 0.2)]
    assert [(r["policy"], r["predictor"], r["planner"]) for r in written] == [
        ("lru", "none", "none"),
        ("smoe", "none", "none"),
        ("smoe", "freq", "none"),
    ]
    # --holdout splits by every checkpoint the cells read, a planner's as a predictor's
    held = []
    monkeypatch.setattr(commands, "_held_out", lambda ts, holdout, ckpts: held.append(ckpts) or (None, None))
    commands.compare(
        traces=str(path), policies=["lru"], predictors=["oracle"], planners=[str(ckpt)], capacities=["4"],
        holdout="test", out=str(tmp_path / "cmp"), wandb=False, json=True,
    )  # fmt: skip
    assert held == [[str(ckpt)]]
