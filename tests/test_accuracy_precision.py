"""eval-accuracy's precision axis: experts_at swaps in the quantized weights and puts the exact ones back,
the sweep's rows at each precision are measured against the exact model at alpha 0, the CLI takes
``--precisions``, and an expert's output error at a precision."""

from __future__ import annotations

import json

import pytest
import torch
from moecast.collect.models import find_moe_structure
from moecast.runtime.live.commands import eval_accuracy, sweep, teacher_forced
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers import precision as P
from moecast.runtime.tiers.expert_store import expert_params
from test_live import make_model, model_dir  # noqa: F401  (model_dir: the CLI's model directory fixture)

from moecast.errors import InputError

torch.set_num_threads(1)

INT8, INT4 = P.Precision("int8"), P.Precision("int4", 32)
SETTING = dict(policy="smoe", capacity=0.25, hardware="smoe-s3-a6000")


def _experts(model) -> list:
    return [e.experts for e in find_moe_structure(model).layers]


def _rows() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 64, (2, 10), generator=g).tolist()


def test_experts_at_holds_the_fake_quantized_weights_and_restores_the_exact_tensors():
    model = make_model("qwen2_moe")
    before = [{n: t.detach().clone() for n, t in expert_params(m).items()} for m in _experts(model)]
    storage = [{n: t.data_ptr() for n, t in expert_params(m).items()} for m in _experts(model)]
    with P.experts_at(model, INT4):
        for mod, exact in zip(_experts(model), before):
            want = P.fake_quantized(INT4, exact, False)
            for name, t in expert_params(mod).items():
                assert torch.equal(t, want[name]) and not torch.equal(t, exact[name])
    with pytest.raises(RuntimeError, match="inside"), P.experts_at(model, INT8):
        raise RuntimeError("inside")  # an error in the block restores the weights too
    for mod, exact, ptrs in zip(_experts(model), before, storage):
        for name, t in expert_params(mod).items():
            assert torch.equal(t, exact[name]) and t.data_ptr() == ptrs[name]  # the same storage back


def _todays_perplexities(model, rows, alphas) -> list[float]:
    """The sweep as it was before the precision axis: attach at each alpha, score the rows."""
    out = []
    for a in alphas:
        rt = attach(model, alpha=a, **SETTING)
        try:
            nll, _ = teacher_forced(model, rows)
        finally:
            rt.detach()
        out.append(float(torch.tensor(nll).mean().exp()))
    return out


def test_sweep_at_each_precision_against_the_exact_model_at_alpha_zero():
    model, rows = make_model("qwen2_moe"), _rows()
    today = _todays_perplexities(model, rows, [0.0, 0.3])
    # model is swept first whatever the order asked: it is the reference
    res = sweep(model, rows, [0.3], progress=False, precisions=[INT4, INT8], **SETTING)
    assert [(r["expert_dtype"], r["alpha"]) for r in res] == [
        ("model", 0.0), ("model", 0.3), ("int4-g32", 0.0), ("int4-g32", 0.3), ("int8", 0.0), ("int8", 0.3),
    ]  # fmt: skip
    assert [r["perplexity"] for r in res[:2]] == pytest.approx(today, rel=1e-12)
    ref = res[0]
    assert ref["agreement"] == 1.0 and ref["ppl_change_pct"] == 0.0 and ref["substitution_rate"] == 0.0
    assert all(r["reference"] == {"expert_dtype": "model", "alpha": 0.0} for r in res)
    for r in res:
        assert r["ppl_change_pct"] == pytest.approx(100 * (r["perplexity"] / ref["perplexity"] - 1))
    at = {(r["expert_dtype"], r["alpha"]): r for r in res}
    # int8's step is max|w| / 127 per row, int4's (max - min) / 15 per group: the model moves less at int8
    assert 0 < abs(at["int8", 0.0]["ppl_change_pct"]) < abs(at["int4-g32", 0.0]["ppl_change_pct"])
    assert at["int8", 0.0]["agreement"] >= at["int4-g32", 0.0]["agreement"]
    # the quantized sweeps left the model exact: today's sweep gives today's figures again
    assert _todays_perplexities(model, rows, [0.0, 0.3]) == today


def test_cli_takes_precisions_and_group_size(model_dir, capsys):  # noqa: F811
    from moecast.cli import main

    args = ["eval-accuracy", "--model", str(model_dir), "--alphas", "0", "0.3", "--texts", "1"]
    args += ["--tokens", "10", "--plot", "", "--tpot-budget", "1000"]
    main([*args, "--precisions", "model", "int8", "int4", "--group-size", "32", "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    rows, choice = lines[:-1], lines[-1]
    assert [r["expert_dtype"] for r in rows] == ["model", "model", "int8", "int8", "int4-g32", "int4-g32"]
    assert rows[0]["agreement"] == 1.0 and rows[0]["ppl_change_pct"] == 0.0
    assert all({"ppl_change_pct", "reference"} <= set(r) for r in rows)
    assert choice["expert_dtype"] == "model" and choice["met"]  # Eq. 5 on the model-precision rows
    main([*args, "--precisions", "int8"])
    out = capsys.readouterr().out
    assert "against the model-precision experts at alpha 0" in out and "experts  alpha" in out
    assert "model precision: alpha = " in out and "TPOT of the quantized rows" in out
    table = [x.split()[:2] for x in out.splitlines() if "%" in x]  # the rows: precision, alpha
    assert table == [["model", "0.00"], ["model", "0.30"], ["int8", "0.00"], ["int8", "0.30"]]


def test_a_precision_is_checked_before_the_model_loads():
    with pytest.raises(InputError, match=r"--precisions int3 .*unknown expert dtype 'int3'"):
        eval_accuracy(model="no-such-model-is-loaded", precisions=["int3"], plot="")
    with pytest.raises(InputError, match="int4 group size 48 is not one of"):
        eval_accuracy(model="no-such-model-is-loaded", precisions="int4", group_size=48, plot="")


# ------------------------------------------------------------------------------ expert output error
def test_gated_outputs_are_the_experts_modules_own():
    experts = _experts(make_model("qwen2_moe"))[0]
    params = expert_params(experts)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(6))
    ys = P.gated_expert_outputs(params, x, False)
    with torch.no_grad():
        for e in range(ys.shape[0]):  # every token to expert e with weight 1
            got = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            assert torch.allclose(ys[e], got, atol=1e-6)


def _outlier_free(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(8, rows, cols, generator=torch.Generator().manual_seed(seed))


def test_expert_output_error_by_hand():
    params = {"gate_up_proj": _outlier_free(64, 32, 7), "down_proj": _outlier_free(32, 32, 8)}
    assert torch.equal(P.expert_output_error(params, P.Precision()), torch.zeros(8))
    # every weight a multiple of 2^-7 and each row's largest 127 of them: s = 127 * 2^-7 / 127 = 2^-7
    # exactly, so int8 stores each weight exactly and the output does not move at all
    exact = {n: torch.randint(-127, 128, t.shape, generator=torch.Generator().manual_seed(9)).float()
             for n, t in params.items()}  # fmt: skip
    for t in exact.values():
        t[..., 0] = 127
    exact = {n: t * 2**-7 for n, t in exact.items()}
    assert torch.equal(P.expert_output_error(exact, INT8), torch.zeros(8))
    # N(0, 1) rows of 32: max|w| is about 2.5, a step of 2.5 / 127 and an rms weight error of step / sqrt(12),
    # 0.57 % of the weights' rms 1 in each of the two matrices: the output moves by about twice that
    plain = P.expert_output_error(params, INT8)
    assert (plain < 0.02).all()
    # one weight of 100 per row: the step is 100 / 127 and the 31 other weights' error grows 40x, while the
    # outlier itself is exact (127 steps) and adds 100 x_3 to the output. Estimated on gate-up's output:
    # (100 / 127 / sqrt(12)) sqrt(31) / sqrt(31 + 100^2) = 1.27 % against 0.57 %, 2.2x
    spiked = {n: t.clone() for n, t in params.items()}
    for t in spiked.values():
        t[..., 3] = 100.0
    assert (P.expert_output_error(spiked, INT8) > 1.5 * plain).all()
    # int4's step, (max - min) / 15 per group of 32 (about 5 / 15), is 17x int8's (2.5 / 127)
    assert (P.expert_output_error(params, INT4) > 8 * plain).all()


def test_expert_output_error_reads_transposed_experts():
    params = {"gate_up_proj": _outlier_free(64, 32, 10), "down_proj": _outlier_free(32, 32, 11)}
    flipped = {n: t.transpose(1, 2).contiguous() for n, t in params.items()}
    want = P.expert_output_error(params, INT4)
    assert torch.allclose(P.expert_output_error(flipped, INT4, transposed=True), want, rtol=1e-5)
    with pytest.raises(InputError, match="needs gate_up_proj and down_proj"):
        P.expert_output_error({"up_proj": params["down_proj"]}, INT8)


# ------------------------------------------------------------------------------------ two copies
def test_sweep_runs_two_copies_through_the_disk_tier():
    """mixed (model + int4-g32) runs the live runtime on a temporary disk tier: its rows carry the share
    of uses at the low copy, sit apart from the model's and the int4 rows', and leave the model exact."""
    model, rows = make_model("qwen2_moe"), _rows()
    today = _todays_perplexities(model, rows, [0.0])
    mixed = P.expert_setting("mixed", 32)
    res = sweep(model, rows, [0.3], progress=False, precisions=[INT4, mixed], **SETTING)
    assert [(r["expert_dtype"], r["alpha"]) for r in res] == [
        ("model", 0.0), ("model", 0.3), ("int4-g32", 0.0), ("int4-g32", 0.3),
        ("model+int4-g32", 0.0), ("model+int4-g32", 0.3),
    ]  # fmt: skip
    at = {(r["expert_dtype"], r["alpha"]): r for r in res}
    m0 = at["model+int4-g32", 0.0]
    assert 0 < m0["low_share"] < 1 and m0["upgrades"] >= 0
    assert m0["perplexity"] not in (at["model", 0.0]["perplexity"], at["int4-g32", 0.0]["perplexity"])
    assert "low_share" not in at["int4-g32", 0.0]
    assert _todays_perplexities(model, rows, [0.0]) == today


def test_cli_sweeps_mixed(model_dir, capsys):  # noqa: F811
    from moecast.cli import main

    args = ["eval-accuracy", "--model", str(model_dir), "--alphas", "0", "--texts", "1", "--tokens", "10"]
    main([*args, "--plot", "", "--precisions", "mixed", "--group-size", "32", "--json"])
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["expert_dtype"] for r in rows] == ["model", "model+int4-g32"]
    assert 0 <= rows[1]["low_share"] <= 1 and "low_share" not in rows[0]
    main([*args, "--plot", "", "--precisions", "mixed", "--group-size", "32"])
    out = capsys.readouterr().out
    assert "model+int4-g32: " in out and "% of the uses at the low copy" in out


def test_the_sweeps_table_keeps_its_columns_under_a_two_copy_label(capsys):
    from moecast.runtime.live.commands import _print_sweep

    row = dict(alpha=0.0, perplexity=10.0, ppl_change_pct=0.0, agreement=1.0, substitution_rate=0.0, hit_rate=0.5,
               modeled_tpot_ms=1.0, measured_tpot_ms=2.0, low_share=None, upgrades=0)  # fmt: skip
    results = [dict(row, expert_dtype="model"), dict(row, expert_dtype="model+int4-g128", low_share=0.5)]
    _print_sweep(results, None, "m", ["w"], [[1, 2]], "lru", "0.5", None, False)
    lines = capsys.readouterr().out.splitlines()
    table = [ln for ln in lines if "experts  alpha" in ln or ln.endswith("ms")]
    assert len(table) == 3 and len({len(ln) for ln in table}) == 1  # every column where the header puts it
    assert table[2].startswith("  model+int4-g128   0.00") and table[1].startswith("            model   0.00")
