"""`moecast run` and `moecast eval-accuracy` (runtime/live/commands.py) without a model: the checks made
before one loads, the report's figures and units, and the sweep's rows and table."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from moecast.runtime.live import commands as C

from moecast.errors import InputError

NO_MODEL = "no-such-model-is-loaded"  # a check that passes goes on to load it, and fails otherwise


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alphas": [0, 1.0]}, r"--alphas \[0, 1\.0\]: every alpha must be in \[0, 1\)"),
        ({"tokens": 7}, "--texts must be >= 1 and --tokens >= 8"),
        ({"tpot_budget": math.inf}, "--tpot-budget must be a positive number of ms, got inf"),
        ({"tpot_budget": 0.0}, "--tpot-budget must be a positive number of ms, got 0.0"),
    ],
    ids=["alpha-1", "tokens-7", "budget-inf", "budget-0"],
)
def test_eval_accuracy_refuses_a_bad_setting_before_the_model_loads(kwargs, message):
    with pytest.raises(InputError, match=message):
        C.eval_accuracy(model=NO_MODEL, plot="", **kwargs)


def test_run_refuses_no_new_tokens_before_the_model_loads():
    with pytest.raises(InputError, match="--max-new-tokens must be at least 1, got 0"):
        C.run(model=NO_MODEL, max_new_tokens=0)


def test_a_sweep_row_against_the_reference_by_hand():
    """NLL ln 2 and ln 8: perplexity exp(ln 4) = 4; the reference's (ln 2, ln 2) is 2, so +100 %; one
    of two greedy tokens agrees (0.5); 10 transfers and 6 CPU experts over 4 decode steps."""
    stats = {"substitution_rate": 0.1, "hit_rate": 0.9, "transfers": 10, "cpu_experts": 6, "decode_steps": 4,
             "modeled_tpot_ms": 1.0, "measured_tpot_ms": 2.0}  # fmt: skip
    ref = (np.log([2.0, 2.0]), np.array([1, 3]))
    r = C._result(0.2, np.log([2.0, 8.0]), np.array([1, 2]), stats, ref)
    assert r["perplexity"] == pytest.approx(4.0)
    assert (r["perplexity_change"], r["ppl_change_pct"]) == (pytest.approx(1.0), pytest.approx(100.0))
    assert r["agreement"] == 0.5 and r["tokens"] == 2
    assert (r["transfers_per_token"], r["cpu_experts_per_token"]) == (2.5, 1.5)


def test_eq5_is_fitted_on_the_model_precision_rows_only():
    """Model rows fall 10, 8, 6 ms over alpha 0, 0.2, 0.4 (T = 10 - 10 alpha): a 8.5 ms budget is met from
    alpha 0.15. The int4 rows (4 ms at every alpha) would pull the fit to 7 - 5 alpha, met at 0."""
    rows = [{"expert_dtype": p, "alpha": a, "modeled_tpot_ms": t}
            for p, ts in (("model", (10.0, 8.0, 6.0)), ("int4-g128", (4.0, 4.0, 4.0)))
            for a, t in zip((0.0, 0.2, 0.4), ts)]  # fmt: skip
    choice = C._choose(rows, 8.5)
    assert choice.met and choice.alpha == pytest.approx(0.15, abs=1e-3)
    assert C._choose(rows, None) is None


def _columns(head: str, line: str, names: list[str]) -> dict[str, str]:
    """The cell under each right-aligned header."""
    return {n: line[: head.index(n) + len(n)].split()[-1] for n in names}


def test_the_sweep_table_counts_the_scored_tokens_and_keeps_each_rate_in_its_column(capsys):
    """Two rows of 3 and 2 tokens score 2 + 1 = 3 next tokens (the first token of a row is never
    predicted); substitution 10 % and hit 90 % under their headers."""
    row = dict(expert_dtype="model", alpha=0.3, perplexity=10.0, ppl_change_pct=1.5, agreement=0.95,
               substitution_rate=0.1, hit_rate=0.9, modeled_tpot_ms=1.0, measured_tpot_ms=2.0)  # fmt: skip
    C._print_sweep([row], None, "m", ["w"], [[1, 2, 3], [4, 5]], "smoe", "0.25", None, False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "m on w: 3 held-out tokens, policy smoe, capacity 0.25"
    assert _columns(lines[2], lines[3], ["agree", "subst", "hit"]) == {
        "agree": "95.0%", "subst": "10.0%", "hit": "90.0%"
    }  # fmt: skip


def _stats(**kw):
    base = dict(
        policy="lru", capacity=4, num_experts=8, alpha=0.0, prefetch="online", decode_steps=4, hit_rate=0.5,
        hits=10, uses=20, substitution_rate=0.25, substituted=3, routed=12, transfers=5, loads=4,
        prefetches_landed=1, prefetches_issued=2, prefetch_accuracy=float("nan"), cpu_experts=2, cpu_uses=7,
        measured_tpot_ms=1.0, device="cpu", modeled_tpot_ms=1.0, hardware="h", hardware_from="f",
        peak_rss_mb=100.0, offload="ram",
        **{f"{p}_ms": 0.0 for p in ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")},
    )  # fmt: skip
    return {**base, **kw}


def _report(capsys, stats) -> dict[str, str]:
    C._print_stats(stats)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        name, value = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        rows[name] = value
    return rows


def test_the_run_report_counts_and_sizes_in_binary_units(capsys):
    """3 MiB of wasted prefetch (3.0, not 3.1); 3 substitutions of 12 routed decode uses (not of all 20
    uses); 2 CPU experts for 7 token uses; an expert of exactly 1 MiB and its int4 copy of 256 KiB; a
    quarter of the uses at the low copy."""
    stats = _stats(expert_dtype="model+int4-g32", expert_bytes=2**20,
                   low_expert_bytes=2**18, low_share=0.25, upgrades=2, bytes_by_copy={"model": 2**21, "int4-g32": 2**19},
                   wasted_bytes=3 * 2**20)  # fmt: skip
    got = _report(capsys, stats)
    assert got["substitution rate"] == "0.250  (3 of 12 decode uses)"
    assert got["CPU-computed experts"] == "2  (7 token uses)"
    assert got["expert precision"] == "model+int4-g32 (1 MiB an expert at model, 256 KiB at int4-g32)"
    assert (
        got["two copies"]
        == "25.0% of the uses at the low copy, 2 upgrades; read model 2.0 MiB, int4-g32 0.5 MiB"
    )
    assert got["wasted prefetch"] == "3.0 MiB (prefetched, never used)"
